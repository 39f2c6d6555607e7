"""What glance-rt knows about each Hugging Face architecture.

We run our own text decoder over the HF text model's weights; HF only does vision + the image-feature
merge at prefill. `text_parts` finds the text decoder inside an HF model, `capture_prefill` runs HF up to
the text decoder's input and returns the merged embeddings and positions it would have fed it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from glance_rt.errors import GlanceError

# top-level HF model_type -> "text" (*ForCausalLM) | "vlm" (*ForConditionalGeneration, images merged by HF)
SUPPORTED: dict[str, str] = {
    "llama": "text",
    "qwen2": "text",
    "qwen3": "text",
    "qwen2_vl": "vlm",
    "qwen2_5_vl": "vlm",
    "llava": "vlm",
    "llava_onevision": "vlm",
    "idefics3": "vlm",
    "smolvlm": "vlm",
}
# text-config model_type -> decoder family; a VLM whose text model is not listed here is rejected
TEXT_FAMILIES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_vl_text": "qwen2",
    "qwen2_5_vl_text": "qwen2",
}
MROPE = ("qwen2_vl", "qwen2_5_vl")
# rope types whose frequencies are a fixed function of the config (not of the running sequence length)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _supported_msg() -> str:
    return "glance-rt supports these HF model_types: " + ", ".join(SUPPORTED)


@dataclass(frozen=True, eq=False)
class TextParts:
    """The HF modules our decoder runs (weights are shared, not copied)."""

    model_type: str  # top-level model_type
    text_model: nn.Module  # HF decoder: .embed_tokens, .layers, .norm, .rotary_emb
    lm_head: nn.Module
    text_config: PretrainedConfig
    mrope: bool  # 3-axis M-RoPE positions (qwen2_vl, qwen2_5_vl)
    image_token_id: int | None

    @property
    def family(self) -> str:
        """Text decoder family: "llama" | "qwen2" (qkv bias) | "qwen3" (q/k norm)."""
        return TEXT_FAMILIES[self.text_config.model_type]


def _find_text_model(hf_model: nn.Module) -> nn.Module | None:
    inner = getattr(hf_model, "model", None)
    if inner is None:
        return None
    for name in ("language_model", "text_model"):
        if isinstance(sub := getattr(inner, name, None), nn.Module):
            return sub
    return inner


def _check_text_config(tc: PretrainedConfig, model_type: str) -> None:
    where = f"{model_type} (text model {tc.model_type})"
    if tc.model_type not in TEXT_FAMILIES:
        raise GlanceError(
            f"{where}: text decoder type {tc.model_type!r} is not supported; text decoders glance-rt runs: "
            + ", ".join(TEXT_FAMILIES)
        )
    layer_types = list(getattr(tc, "layer_types", None) or [])
    if any(t != "full_attention" for t in layer_types) or (
        getattr(tc, "use_sliding_window", False) and getattr(tc, "sliding_window", None)
    ):
        raise GlanceError(
            f"{where}: sliding-window attention layers are not supported (layer_types={layer_types}); "
            "use a checkpoint with full attention in every layer (use_sliding_window=False)"
        )
    rope = getattr(tc, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in STATIC_ROPE:
        raise GlanceError(
            f"{where}: rope_type {rope.get('rope_type')!r} is not supported; supported: {', '.join(STATIC_ROPE)}"
        )
    if getattr(tc, "hidden_act", "silu") != "silu":
        raise GlanceError(f"{where}: hidden_act {tc.hidden_act!r} is not supported; only 'silu' is")


def text_parts(hf_model: nn.Module) -> TextParts:
    """Locate the text decoder, lm_head and text config inside an HF *ForCausalLM / *ForConditionalGeneration."""
    config = getattr(hf_model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise GlanceError(f"unsupported model_type {model_type!r} ({type(hf_model).__name__}); {_supported_msg()}")
    text_model = _find_text_model(hf_model)
    lm_head = getattr(hf_model, "lm_head", None)
    if text_model is None or not isinstance(lm_head, nn.Module):
        raise GlanceError(
            f"{type(hf_model).__name__} has no lm_head: pass the full *ForCausalLM / *ForConditionalGeneration "
            f"model, not its base model; {_supported_msg()}"
        )
    missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(text_model, a)]
    if missing:
        raise GlanceError(
            f"{type(text_model).__name__} lacks {missing}: not a supported text decoder; {_supported_msg()}"
        )
    text_config = text_model.config
    _check_text_config(text_config, model_type)
    mrope = model_type in MROPE
    if mrope and len((text_config.rope_parameters or {}).get("mrope_section") or ()) != 3:
        raise GlanceError(f"{model_type}: text config has no 3-axis rope_parameters['mrope_section']")
    image_token_id = getattr(config, "image_token_id", None) if SUPPORTED[model_type] == "vlm" else None
    return TextParts(model_type, text_model, lm_head, text_config, mrope, image_token_id)


@dataclass(frozen=True, eq=False)
class PrefillInputs:
    """What HF feeds its text decoder at prefill, plus the rule for positions after it."""

    embeds: torch.Tensor  # [P, H] merged text+image embeddings, as HF feeds its text decoder
    positions: torch.Tensor  # [3, P] int64 for mrope models, [P] otherwise
    rope_delta: int  # generated token i (i >= P) sits at position i + rope_delta (all 3 axes for mrope)


class _Captured(Exception):
    """Raised by the pre-hook to stop the HF forward once the text decoder's inputs are known."""


def _input_ids(inputs: Mapping) -> torch.Tensor:
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise GlanceError(
            "inputs need 'input_ids' as a tensor: pass the processor/tokenizer output with return_tensors='pt'"
        )
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise GlanceError(
            f"input_ids must have shape [1, P] (batch size 1), got {list(ids.shape)}: run one prompt at a time"
        )
    if ids.shape[1] == 0:
        raise GlanceError("input_ids is empty: the prompt needs at least one token")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise GlanceError("attention_mask has padded positions: pass a single unpadded prompt (padding=False)")
    return ids


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a 1-D bool mask."""
    m = mask.to(torch.int8)
    edges = torch.diff(m, prepend=m.new_zeros(1), append=m.new_zeros(1))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends, strict=True))


_HOW_TO_FIX = (
    "build `inputs` with the model's own processor from the text and the same list of images, with exactly one "
    "image placeholder per image in the text"
)


def _check_images(hf_model: nn.Module, parts: TextParts, ids: torch.Tensor, inputs: Mapping) -> None:
    """Cheap placeholder-vs-image consistency checks before HF runs (HF's own errors are converted too)."""
    has_pixels = inputs.get("pixel_values") is not None
    if parts.image_token_id is None:
        if has_pixels:
            raise GlanceError(f"{parts.model_type} is a text-only model: drop pixel_values from inputs")
        return
    is_img = ids[0] == parts.image_token_id  # [P]
    n_tok = int(is_img.sum())
    if n_tok and not has_pixels:
        raise GlanceError(f"the prompt has {n_tok} image placeholder tokens but no pixel_values: {_HOW_TO_FIX}")
    if has_pixels and not n_tok:
        raise GlanceError(f"pixel_values were given but the prompt has no image placeholder tokens: {_HOW_TO_FIX}")
    if parts.mrope and has_pixels:
        grid = inputs.get("image_grid_thw")
        if grid is None:
            raise GlanceError(f"{parts.model_type} needs image_grid_thw with pixel_values: {_HOW_TO_FIX}")
        merge = hf_model.config.vision_config.spatial_merge_size
        want = [int(n) for n in grid.prod(-1) // merge**2]  # tokens per image
        got = [e - s for s, e in _runs(is_img)]  # tokens per placeholder run
        if got != want:
            raise GlanceError(
                f"{len(want)} image(s) needing {want} placeholder tokens, but the prompt has {len(got)} placeholder "
                f"run(s) of {got} tokens: {_HOW_TO_FIX}"
            )


def _hf_call(hf_model: nn.Module, parts: TextParts, inputs: Mapping) -> dict:
    """Run HF's forward until its text decoder is called; return the kwargs it was called with."""
    seen: dict = {}

    def hook(module, args, kwargs):
        seen.update(kwargs)
        if args:
            seen.setdefault("input_ids", args[0])
        raise _Captured

    handle = parts.text_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            hf_model(**inputs)
    except _Captured:
        return seen
    except torch.OutOfMemoryError:
        raise
    except (ValueError, IndexError, RuntimeError, StopIteration) as e:
        raise GlanceError(f"{parts.model_type} rejected the inputs ({type(e).__name__}: {e}); {_HOW_TO_FIX}") from e
    finally:
        handle.remove()
    raise GlanceError(f"{type(hf_model).__name__} never called its text decoder: unsupported model; {_supported_msg()}")


def _to(inputs: Mapping, device: torch.device, dtype: torch.dtype) -> dict:
    """Tensors onto the model's device; floating ones (pixel_values, ...) to its dtype."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, dtype) if v.is_floating_point() else v.to(device)
        out[k] = v
    return out


def _mrope_positions(pos: torch.Tensor | None, P: int) -> torch.Tensor:
    if pos is None:
        return torch.arange(P).expand(3, P)
    if pos.ndim == 3:  # [3 or 4, 1, P]; generate() prepends a text-only row
        return pos[-3:, 0]
    return pos.reshape(1, P).expand(3, P)  # [1, P]: text-only, same on all axes


def capture_prefill(hf_model: nn.Module, parts: TextParts, inputs: Mapping) -> PrefillInputs:
    """Embeddings + positions HF feeds its text decoder for this prompt (batch 1), and the decode rope delta."""
    if not isinstance(inputs, Mapping):
        raise GlanceError(f"inputs must be the processor/tokenizer output (a dict), got {type(inputs).__name__}")
    ids = _input_ids(inputs)
    P = ids.shape[1]
    if inputs.get("position_ids") is not None:
        raise GlanceError("position_ids in inputs are not supported: drop them, positions are derived from the prompt")
    _check_images(hf_model, parts, ids, inputs)
    weight = parts.text_model.embed_tokens.weight
    if SUPPORTED[parts.model_type] == "text":
        with torch.no_grad():
            embeds = parts.text_model.embed_tokens(ids.to(weight.device))[0]  # [P, H]
        return PrefillInputs(embeds, torch.arange(P, device=weight.device), 0)

    inner = hf_model.model
    saved_deltas = getattr(inner, "rope_deltas", None)
    if hasattr(inner, "rope_deltas"):
        inner.rope_deltas = None  # a stale value from an earlier generate() must not leak in
    try:
        seen = _hf_call(hf_model, parts, _to(inputs, weight.device, weight.dtype))
        hf_deltas = getattr(inner, "rope_deltas", None)
    finally:
        if hasattr(inner, "rope_deltas"):
            inner.rope_deltas = saved_deltas  # capture leaves no state behind

    embeds = seen.get("inputs_embeds")
    if embeds is None:
        with torch.no_grad():
            embeds = parts.text_model.embed_tokens(seen["input_ids"])
    embeds = embeds[0].detach()  # [P, H]
    pos = seen.get("position_ids")
    if embeds.shape[0] != P:
        raise GlanceError(f"HF fed its text decoder {embeds.shape[0]} positions for a {P}-token prompt: unsupported")

    if not parts.mrope:
        positions = torch.arange(P, device=embeds.device)  # [P]
        if pos is not None and not torch.equal(pos.reshape(-1).cpu(), positions.cpu()):
            raise RuntimeError(f"internal: {parts.model_type} fed its text decoder positions {pos.tolist()}")
        return PrefillInputs(embeds, positions, 0)

    return _mrope_prefill(embeds, pos, P, hf_deltas)


def _mrope_prefill(embeds: torch.Tensor, pos: torch.Tensor | None, P: int, hf_deltas=None) -> PrefillInputs:
    """PrefillInputs for an M-RoPE model from the position ids HF computed for the prompt."""
    positions = _mrope_positions(pos, P).to(device=embeds.device, dtype=torch.long).contiguous()  # [3, P]
    rope_delta = int(positions.max()) + 1 - P
    if hf_deltas is not None and int(hf_deltas.reshape(-1)[0]) != rope_delta:
        raise RuntimeError(f"internal: HF rope_deltas {hf_deltas.tolist()} != max(position)+1-P = {rope_delta}")
    if not bool((positions[:, -1] == P - 1 + rope_delta).all()):
        # HF generate continues each axis from the last prompt position; that only matches one shared delta
        # when the prompt ends with a text token
        raise GlanceError("the prompt ends inside an image: end it with text (e.g. the chat template's assistant turn)")
    return PrefillInputs(embeds, positions, rope_delta)


def merge_image_features(hf_model: nn.Module, parts: TextParts, inputs: Mapping,
                         features: torch.Tensor) -> PrefillInputs:
    """`capture_prefill` with the image features computed elsewhere (an engine's vision graph):
    features [N, H] replace the N image placeholder rows of the prompt's token embeddings, in order,
    as every supported VLM merges them; M-RoPE positions come from HF's own rope index (no vision
    compute). tests/test_vision.py holds this equal to capture_prefill on every VLM."""
    ids = _input_ids(inputs)
    P = ids.shape[1]
    _check_images(hf_model, parts, ids, inputs)
    weight = parts.text_model.embed_tokens.weight
    ids = ids.to(weight.device)
    is_img = ids[0] == parts.image_token_id  # [P]
    if int(is_img.sum()) != features.shape[0]:
        raise GlanceError(f"the prompt has {int(is_img.sum())} image placeholder tokens but the vision graph gave "
                          f"{features.shape[0]} feature rows: {_HOW_TO_FIX}")
    with torch.no_grad():
        embeds = parts.text_model.embed_tokens(ids)[0].clone()  # [P, H]
    embeds[is_img] = features.to(embeds.dtype)
    if not parts.mrope:
        return PrefillInputs(embeds, torch.arange(P, device=weight.device), 0)
    kw = {k: inputs[k].to(weight.device) for k in ("mm_token_type_ids", "image_grid_thw", "attention_mask")
          if inputs.get(k) is not None}
    pos, _ = hf_model.model.get_rope_index(ids, **kw)  # [3, 1, P]
    return _mrope_prefill(embeds, pos, P)


def extend_inputs(inputs: Mapping, tokens: list[int]) -> dict:
    """Processor outputs for the prompt followed by `tokens` (per-token extras such as
    `mm_token_type_ids` extended as text), for one full-sequence HF forward."""
    ids = inputs["input_ids"]
    more = torch.tensor([tokens], dtype=ids.dtype, device=ids.device)
    out = {
        k: (torch.cat([v, v.new_zeros(1, len(tokens))], 1) if isinstance(v, torch.Tensor) and v.shape[:2] == ids.shape
            else v)
        for k, v in inputs.items()
        if k not in ("input_ids", "attention_mask")
    }
    full = torch.cat([ids, more], 1)
    return {"input_ids": full, "attention_mask": torch.ones_like(full), **out}
