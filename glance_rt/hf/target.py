"""The target model: a Hugging Face model (text LLM or VLM), its processor, and what glance-rt
needs to know about it. `load_target` is the one way in."""

import hashlib
import json
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from glance_rt.errors import GlanceError, GlanceWarning
from glance_rt.files import atomic_folder, cache_root, clear_leftovers, exclusive
from glance_rt.hf.arch import SUPPORTED, capture_prefill, text_parts
from glance_rt.hf.processors import load_processor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Target:
    name: str
    hf_model: nn.Module
    parts: object  # glance_rt.hf.arch.TextParts
    processor: object | None  # the HF processor (VLMs) or tokenizer (text models), or None
    tokenizer: object | None
    eos_token_ids: frozenset
    # prepared copies of the linear layers' weights (oneDNN-packed, transposed: `KernelPlan.linear`), made
    # by the first Decoder that chooses each and shared by every later one on this target
    layouts: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def text_config(self):
        return self.parts.text_config

    @property
    def vocab_size(self) -> int:
        return self.parts.lm_head.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.parts.lm_head.weight.device

    @property
    def is_vlm(self) -> bool:
        return SUPPORTED[self.parts.model_type] == "vlm"

    def prefill_inputs(self, inputs: dict):
        """Processor outputs (batch 1) -> merged embeddings, positions and rope delta."""
        return capture_prefill(self.hf_model, self.parts, inputs)

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def encode_chat(self, prompt: str, images=()) -> dict:
        """One user turn through the chat template (if any) and the processor, as a user would."""
        images = list(images)
        return self.encode_messages([{"role": "user", "content": [{"type": "image"} for _ in images]
                                      + [{"type": "text", "text": prompt}]}], images)

    def encode_messages(self, messages: list[dict], images=()) -> dict:
        """A conversation through the chat template (if any) and the processor. `messages`: role and
        content, a string or a list of {"type": "text", "text"} / {"type": "image"} parts; `images`: the
        images of the image parts, in order."""
        if self.processor is None:
            raise GlanceError(f"{self.name} has no processor or tokenizer: pass token ids to Decoder.generate")
        images = list(images)
        if images and not self.is_vlm:
            raise GlanceError(f"{self.name} is a text model: it takes no images (drop --image)")
        template = getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)
        if template:
            if not self.is_vlm:  # text templates take plain strings
                messages = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                             "".join(p["text"] for p in m["content"] if p["type"] == "text")} for m in messages]
            text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "\n".join(m["content"] if isinstance(m["content"], str) else
                             "".join(p.get("text", "") for p in m["content"]) for m in messages)
        if self.is_vlm:
            return dict(self.processor(text=text, images=images or None, return_tensors="pt"))
        return dict(self.tokenizer(text, return_tensors="pt", add_special_tokens=not template))


def _eos_ids(hf_model) -> frozenset:
    gen = getattr(hf_model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(hf_model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def from_model(hf_model, processor=None, name: str | None = None) -> Target:
    parts = text_parts(hf_model)
    tokenizer = getattr(processor, "tokenizer", processor)
    name = name or getattr(hf_model.config, "_name_or_path", None) or parts.model_type
    hf_model.eval().requires_grad_(False)
    return Target(name, hf_model, parts, processor, tokenizer, _eos_ids(hf_model))


GGUF_CACHE_FORMAT = 1  # bump when what a converted folder holds changes


def _read_gguf(path: Path, dtype: torch.dtype):
    """The GGUF file through transformers: its tokenizer and the model, de-quantized to `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype, local_files_only=True
        )
    except ImportError as e:
        raise GlanceError(f"loading GGUF files needs the gguf extra: pip install 'glance-rt[gguf]' ({e})") from e
    except (ValueError, OSError, KeyError) as e:
        raise GlanceError(f"{path} could not be read as a GGUF model ({e})") from e
    return model, tok


def gguf_cache_folder(path: Path, dtype: torch.dtype) -> Path:
    """Where a GGUF file's converted copy is kept: under `cache_root()/gguf/`, named by the file (its
    resolved path, size and modification time: a rewritten file is a new one, as for Python's bytecode
    cache; no read of its bytes at every start-up, 5 s for a 4 GB file), the dtype and the transformers
    and gguf versions that converted it (any change: a new copy)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        versions = [version("transformers"), version("gguf")]
    except PackageNotFoundError as e:
        raise GlanceError(f"loading GGUF files needs the gguf extra: pip install 'glance-rt[gguf]' ({e})") from e
    st = path.stat()
    key = json.dumps([GGUF_CACHE_FORMAT, str(path.resolve()), st.st_size, st.st_mtime_ns, str(dtype), *versions])
    return cache_root() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _write_converted(model, tok, folder: Path) -> None:
    """The de-quantized model as a Hugging Face folder: safetensors, config (without the GGUF
    quantization entry: the weights in it are plain tensors), generation config, tokenizer files."""
    from safetensors.torch import save_model

    save_model(model, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(folder)
    tok.save_pretrained(folder)


def _load_gguf(path: Path, dtype: torch.dtype, cache: bool):
    """A GGUF model and its tokenizer. Converting one (parsing, de-quantizing) takes transformers tens of
    seconds, so the result is kept as a Hugging Face folder (`gguf_cache_folder`) and later loads read
    that: the same tensors, config and tokenizer. The folder appears whole or not at all."""
    folder = gguf_cache_folder(path, dtype) if cache else None
    if folder is None:
        return _read_gguf(path, dtype)
    with exclusive(folder) as locked:  # two processes loading the file at once: one converts, the other reads
        if locked:  # no live writer: a killed conversion's temp folder (half a GB for the default) goes
            for p in clear_leftovers(folder):
                warnings.warn(f"removed {p}, left by a conversion that did not finish", GlanceWarning, stacklevel=3)
        return _load_gguf_cached(path, dtype, folder)


def _load_gguf_cached(path: Path, dtype: torch.dtype, folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if folder.is_dir():
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
            return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # a damaged copy raises what its reader raises (safetensors, tokenizers)
            warnings.warn(f"the converted copy of {path} in {folder} could not be read ({e}); converting the "
                          "GGUF file again", GlanceWarning, stacklevel=4)
    start = time.perf_counter()  # tens of seconds with no other sign of life but transformers' bar
    print(f"[glance-rt] converting {path.name} ({path.stat().st_size / 2**20:.0f} MiB) into a Hugging Face copy "
          f"in {folder}: once, later loads read the copy", file=sys.stderr, flush=True)
    model, tok = _read_gguf(path, dtype)
    try:
        atomic_folder(folder, lambda tmp: _write_converted(model, tok, tmp))
        print(f"[glance-rt] converted in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    except OSError as e:  # an unwritable cache costs the next load a conversion, nothing else
        warnings.warn(f"could not keep a converted copy of {path} in {folder} ({e}); set GLANCE_RT_CACHE to "
                      "a writable folder to load it faster next time", GlanceWarning, stacklevel=4)
    return model, tok


def _load_folder(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText


    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise GlanceError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type")
    except ValueError as e:
        raise GlanceError(f"{cfg_file} is not valid JSON ({e})") from e
    if model_type not in SUPPORTED:
        raise GlanceError(f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(SUPPORTED))}")
    auto = AutoModelForImageTextToText if SUPPORTED[model_type] == "vlm" else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise GlanceError(f"{path}: the model weights could not be loaded ({e})") from e

    processor = load_processor(path, is_vlm=SUPPORTED[model_type] == "vlm")
    return model, processor


def load_target(source=None, dtype="float32", device="cpu", processor=None, gguf_cache: bool = True) -> Target:
    """Load a target: None (the embedded SmolLM2-135M-Instruct), a local Hugging Face model folder
    (safetensors), a GGUF file, or a transformers model already in memory (pass its processor).
    Never downloads. A GGUF file's first load keeps a converted copy in glance-rt's cache folder
    (`gguf_cache=False`: neither read nor write it)."""
    from glance_rt.hf.embedded import DEFAULT_NAME, default_gguf_path

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise GlanceError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if isinstance(source, nn.Module):
        target = from_model(source, processor)
    elif source is None or isinstance(source, (str, Path)):
        path = default_gguf_path() if source is None else Path(source).expanduser()
        name = DEFAULT_NAME if source is None else path.stem
        if path.is_file() and path.suffix == ".gguf":
            model, proc = _load_gguf(path, dtype, gguf_cache)
        elif path.is_dir():
            model, proc = _load_folder(path, dtype)
        else:
            raise GlanceError(
                f"{source!r} is not a local model folder or .gguf file (glance-rt never downloads: "
                "give a folder with config.json + safetensors, a .gguf file, or a transformers model)"
            )
        target = from_model(model, processor or proc, name)
    else:
        raise GlanceError(
            f"load_target takes a folder, a .gguf file, a transformers model or None, not {type(source).__name__}"
        )
    target.hf_model.to(device=device, dtype=dtype)
    return target
