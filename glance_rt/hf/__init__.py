"""Hugging Face adapted: loading targets (folders, GGUF, in-memory models), the supported
architectures and their prefill (images, M-RoPE), processors, and the embedded default."""
