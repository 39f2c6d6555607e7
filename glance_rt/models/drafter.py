"""The GLANCE drafter: a DFlash-compatible block-diffusion head, and its checkpoint folder.

Architecture (weight names as DFlash's, so published DFlash drafters load and ours serve there):
`fc: Linear(len(target_layer_ids) * H -> H)` + `hidden_norm` over the concatenated target
features; decoder layers (RMSNorm, attention with q/k norm whose K/V are projections of both the
context features and the block, SwiGLU MLP); 1-D RoPE; final `norm`. The target's `embed_tokens`
and `lm_head` are shared and frozen (they are not part of the checkpoint).

The DFlash contract (README, "DFlash interoperability"). A folder is DFlash-compatible, so z-lab/dflash's
`DFlashDraftModel` + `dflash_generate` (and vLLM / SGLang's DFlash support) draft exactly the tokens
glance-rt drafts, when it uses no glance-only extension: its mask is the embedding of a target token
(`dflash_config.mask_token_id`) and it drafts over the whole vocabulary. `init_drafter` and
`glance-rt train` make such folders by default. Three extensions are opt-in, declared in config.json's
`glance` section and refused by `check_dflash` (they have no DFlash form: DFlash reads none of their tensors):
- a learned mask embedding (`mask_embedding` [H]) instead of a mask token's embedding;
- a draft vocabulary (as EAGLE-3's): the drafter may propose only `draft_vocab` [Vd], a sorted subset
  of the target's token ids; its logits are the lm_head rows of that subset (a head over 8k rows
  instead of 49k, at the cost of never drafting a rare token; verification still decides every token);
- a copy head (`copy_q`, `copy_k`, `copy_gate`): a pointer from each block row over the context rows,
  proposing the token that followed each, mixed into the row's distribution by a learned gate
  (`GlanceDrafter.copy_mix`), so an answer that copies what the target read is drafted by copying;
  in its span form (`copy_span`) one pointer, the first draft row's, finds where in the context the block
  is, and depth d copies the d-th token after that row (a learned prompt lookup: the span read forward).
A folder with an extension is written as architecture `GlanceDraftModel`, so a DFlash loader that
dispatches on the architecture refuses it instead of drafting other tokens.

Config is read as the reference reads it (a transformers `Qwen3Config`): RoPE scaling (`rope_parameters`
or legacy `rope_scaling`) through transformers' own rotary embedding, a missing
`dflash_config.target_layer_ids` by DFlash's default rule; what the reference's model would run
differently from ours (biased projections, another activation, sliding windows, partial or
position-dependent RoPE) is a `GlanceError` naming the field.
"""

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glance_rt.errors import GlanceError
from glance_rt.files import atomic_folder, check_json_fields
from glance_rt.hf.embedded import default_drafter_path
from glance_rt.models.target import apply_rope

FORMAT_VERSION = 1
MAX_BLOCK_SIZE = 64
# RoPE types whose frequencies are fixed (transformers' ROPE_INIT_FUNCTIONS; "dynamic" and "longrope"
# change with the sequence length, which static caches cannot follow)
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int  # = the target's text hidden size (shared embeddings and lm_head)
    vocab_size: int  # = the target's vocab size
    target_layer_ids: tuple[int, ...]  # target decoder layers whose outputs are the context
    num_target_layers: int
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] = ()  # other rope_parameters: (("factor", 4.0), ("rope_type", "yarn"))
    max_position_embeddings: int = 32768  # read by some RoPE types (yarn)
    block_size: int = 8
    mask_token_id: int | None = None  # a target token whose embedding is the mask (DFlash) ...
    learned_mask: bool = False  # ... or a learned mask embedding `mask_embedding` (glance-only)
    draft_vocab_size: int | None = None  # None: the whole vocabulary; else a `draft_vocab` buffer (glance-only)
    copy_head: bool = False  # glance-only: a pointer over the context rows, mixed into each depth (`copy_mix`)
    copy_span: bool = False  # the copy head's span form: one pointer, depth d copies the d-th token after it

    def __post_init__(self):  # one spelling per config: sorted, hashable, without the default rope_type
        rope = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(self.rope_scaling).items()}
        if rope.get("rope_type") == "default":
            del rope["rope_type"]
        object.__setattr__(self, "rope_scaling", tuple(sorted(rope.items())))
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))

    def validate(self) -> None:
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise GlanceError(f"block_size must be in [2, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if not self.target_layer_ids:
            raise GlanceError("target_layer_ids is empty: the drafter needs at least one target layer")
        if self.mask_token_id is None and not self.learned_mask:
            raise GlanceError("a drafter needs a mask token (dflash_config.mask_token_id in config.json, DFlash's "
                              "form) or a learned mask embedding (glance.learned_mask)")
        if self.copy_span and not self.copy_head:
            raise GlanceError("copy_span is a form of the copy head: it needs copy_head")
        if self.copy_head and self.draft_vocab_size is not None:
            raise GlanceError("a copy head proposes any context token: it needs the whole vocabulary (no draft_vocab)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise GlanceError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise GlanceError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        kind = self.rope_parameters.get("rope_type", "default")
        if kind not in STATIC_ROPE_TYPES:
            raise GlanceError(
                f"rope_parameters.rope_type {kind!r} is not supported: its frequencies change with the sequence "
                f"length, which glance-rt's static caches cannot follow (supported: {', '.join(STATIC_ROPE_TYPES)})")
        if float(self.rope_parameters.get("partial_rotary_factor", 1.0)) != 1.0:
            raise GlanceError("rope_parameters.partial_rotary_factor != 1 is not supported: DFlash's drafter "
                              "rotates the whole head dimension")

    @property
    def rope_parameters(self) -> dict:
        """RoPE as transformers' `config.rope_parameters` holds it."""
        params = {"rope_type": "default", **{k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_scaling}}
        return {**params, "rope_theta": self.rope_theta}

    def dflash_problems(self) -> list[str]:
        """Why DFlash's reference would not draft what glance-rt drafts with this config ([] = compatible)."""
        problems = []
        if self.learned_mask:
            problems.append("a learned mask embedding (`mask_embedding`): DFlash masks with the embedding of "
                            "dflash_config.mask_token_id")
        elif self.mask_token_id is None:
            problems.append("no dflash_config.mask_token_id")
        if self.draft_vocab_size is not None:
            problems.append(f"a draft vocabulary of {self.draft_vocab_size} tokens (`draft_vocab`): DFlash drafts "
                            "over the target's whole vocabulary")
        if self.copy_head:
            problems.append("a copy head (`copy_q`, `copy_k`, `copy_gate`): DFlash drafts from the lm_head alone")
        return problems


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default choice: the middle layer for one draft layer, else spread over [1, L-3] (for
    targets of fewer than 5 layers, where DFlash's rule leaves the layers, clamped to layer 1)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, max(num_target_layers - 3, 1)
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DraftAttention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        h, nh, nkv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(h, nh * d, bias=False)
        self.k_proj = nn.Linear(h, nkv * d, bias=False)
        self.v_proj = nn.Linear(h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)
        self.q_norm = RMSNorm(d, c.rms_norm_eps)
        self.k_norm = RMSNorm(d, c.rms_norm_eps)


class DraftMLP(nn.Module):
    """SwiGLU over `c.hidden_size` and `c.intermediate_size` (the GLANCE drafter's and the EAGLE-3 head's)."""

    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = DraftMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def layer_kv(layer: DraftLayer, c: DrafterConfig, x: Tensor) -> tuple[Tensor, Tensor]:
    """One drafter layer's keys and values for rows x [1, T, H] -> k, v [1, nkv, T, D] (before RoPE)."""
    a, t = layer.self_attn, x.shape[1]
    k = a.k_norm(a.k_proj(x).view(1, t, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
    v = a.v_proj(x).view(1, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
    return k, v


def layer_q(layer: DraftLayer, c: DrafterConfig, x: Tensor) -> Tensor:
    """One drafter layer's queries for rows x [1, Q, H] -> q [1, nh, Q, D] (before RoPE)."""
    q_len = x.shape[1]
    return layer.self_attn.q_norm(layer.self_attn.q_proj(x).view(1, q_len, c.num_attention_heads, c.head_dim)
                                  ).transpose(1, 2)


def layer_out(layer: DraftLayer, h: Tensor, attn: Tensor) -> Tensor:
    """attn [1, nh, Q, D] -> the layer's output hidden [1, Q, H] (residuals and MLP)."""
    q_len = h.shape[1]
    h = h + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(1, q_len, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def rope_tables(inv_freq: Tensor, positions: Tensor, dtype, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """positions [T] -> cos, sin [1, T, D] (1-D RoPE, HF/Qwen3 layout; `scaling`: the RoPE type's
    attention scaling, 1 for most)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    if scaling == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


@functools.lru_cache(maxsize=16)
def rope(c) -> tuple[Tensor, float]:
    """-> (inv_freq [D/2], attention_scaling): exactly what transformers' `Qwen3RotaryEmbedding` (the
    rotary embedding of DFlash's reference drafter) computes for this config, scaled types included.
    `c`: a DrafterConfig or an `Eagle3Config` (the EAGLE-3 head's Llama rotary embedding computes the same
    tables; its tests check them against `LlamaRotaryEmbedding`)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    c.validate()
    hf = Qwen3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                     num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                     rope_parameters=c.rope_parameters)
    emb = Qwen3RotaryEmbedding(hf)
    return emb.inv_freq.float(), float(emb.attention_scaling)  # (cached: do not modify inv_freq in place)


class GlanceDrafter(nn.Module):
    """Weights, config and the forward of a drafter: `context` + `context_kv` turn target features
    into every layer's keys and values, `forward` runs the block rows. The inference pass
    (`glance_rt.round.draft.DraftPass`, a KV cache and tree attention) and the training pass
    (`glance_rt.tools.training.glance.block_forward`, many blocks under a block-sparse mask) both call them."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        config.validate()
        self.config = config
        c = config
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.learned_mask:
            self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size))
        if c.draft_vocab_size is not None:  # [Vd] target token ids the drafter may propose, sorted
            self.register_buffer("draft_vocab", torch.arange(c.draft_vocab_size))
        if c.copy_head:  # a pointer from each block row to the context rows, and how much of it to trust
            self.copy_q = nn.Linear(c.hidden_size, c.head_dim, bias=False)
            self.copy_k = nn.Linear(c.hidden_size, c.head_dim, bias=False)
            self.copy_gate = nn.Linear(c.hidden_size, 1)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def context(self, feats: Tensor) -> Tensor:
        """Target features [..., F] (the chosen layers' hidden states, concatenated) -> the drafter's
        context rows [..., H]."""
        return self.hidden_norm(self.fc(feats.to(self.hidden_norm.weight.dtype)))

    def context_kv(self, i: int, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Layer i's keys (with RoPE cos, sin [1, m, D]) and values of context rows ctx [1, m, H]
        -> k, v [1, nkv, m, D]. Every layer projects the same context rows."""
        k, v = layer_kv(self.layers[i], self.config, ctx)
        return apply_rope(k, cos, sin), v

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attend) -> Tensor:
        """The block pass. h [1, Q, H]: the block rows' input embeddings, at RoPE cos, sin [1, Q, D].
        `attend(i, q, k, v)` -> layer i's attention output [1, nh, Q, D] for the block's queries
        q [1, nh, Q, D] and keys / values k, v [1, nkv, Q, D] (RoPE applied): it supplies the context's
        keys (a cache at inference, the whole sequence's in training) and the mask.
        -> the final-normed hidden [1, Q, H] (logits through the target's lm_head)."""
        c = self.config
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            q, (k, v) = layer_q(layer, c, x), layer_kv(layer, c, x)
            h = layer_out(layer, h, attend(i, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v))
        return self.norm(h)

    def copy_targets(self, next_ids: Tensor, start: Tensor, depths: int) -> tuple[Tensor, Tensor]:
        """What each draft depth's pointer proposes: context rows 0..m-1 hold next_ids [..., m] (the token after
        each row); a block whose bonus token is at row `start` (a tensor broadcasting to [..., 1, 1]) drafts
        `depths` rows. -> (ids [..., Q, m], visible [..., Q, m]): row j proposes to depth q the token after it
        (next_ids[j]) or, in the span form, the q-th token after that (next_ids[j + q]), a token committed
        before the block (j + shift < start)."""
        m = next_ids.shape[-1]
        rows = torch.arange(m, device=next_ids.device)  # [m]
        shift = torch.arange(depths, device=next_ids.device) if self.config.copy_span else rows.new_zeros(depths)
        at = rows + shift[:, None]  # [Q, m] the row whose next token depth q copies from pointed row j
        ids = next_ids[..., at.clamp(max=m - 1)]  # [..., Q, m]
        return ids, at < start

    def copy_mix(self, hidden: Tensor, logits: Tensor, keys: Tensor, ids: Tensor, visible: Tensor) -> Tensor:
        """The copy head (`copy_head`, glance-only): block rows hidden [..., Q, H] point at the context rows
        whose pointer keys are keys [..., m, D] (`copy_k` of the context rows); pointing at row j proposes
        ids[..., q, j] to depth q where visible[..., q, j] (`copy_targets`). The span form points once, from
        the first draft row. The pointer's distribution is mixed with the head's softmax(logits [..., Q, V])
        by a learned gate per row (a pointer-generator), so copying a span of what the target read is one
        cheap choice. -> log-probs [..., Q, V] (drafts and trees read them as logits)."""
        c = self.config
        query = hidden[..., :1, :] if c.copy_span else hidden  # [..., 1 or Q, H]
        scores = self.copy_q(query) @ keys.transpose(-1, -2) * c.head_dim**-0.5  # [..., 1 or Q, m]
        scores = scores.float().masked_fill(~visible, float("-inf"))  # [..., Q, m]
        can = visible.any(-1, keepdim=True)  # [..., Q, 1] rows with a context row to point at
        point = torch.where(can, scores.softmax(-1), 0.0)  # [..., Q, m] (no NaN where nothing is visible)
        p_copy = torch.zeros_like(logits, dtype=torch.float32).scatter_add(-1, ids, point)  # [..., Q, V]
        gate = torch.sigmoid(self.copy_gate(hidden).float()) * can  # [..., Q, 1]
        p = (1 - gate) * logits.float().softmax(-1) + gate * p_copy
        return p.clamp_min(torch.finfo(torch.float32).tiny).log()

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def save(self, path) -> None:
        save_drafter(self, path)


# ----------------------------------------------------------------------------- checkpoints


def _config_json(c: DrafterConfig, dtype: torch.dtype) -> dict:
    """DFlash-style config.json: a Qwen3 config plus block_size / num_target_layers / dflash_config (what
    DFlash's reference reads), and a `glance` section declaring the glance-only extensions in use."""
    return {
        "architectures": ["GlanceDraftModel" if c.dflash_problems() else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": c.rope_parameters,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {
            "block_size": c.block_size,
            "target_layer_ids": list(c.target_layer_ids),
            "mask_token_id": c.mask_token_id,
        },
        "glance": {"format_version": FORMAT_VERSION, "learned_mask": c.learned_mask,
                   "draft_vocab_size": c.draft_vocab_size, "copy_head": c.copy_head,
                   "copy_span": c.copy_span},
    }


def _refuse(field: str, why: str) -> None:
    raise GlanceError(f"DFlash config field {field}: {why}; glance-rt's drafter would not draft what DFlash's "
                      "reference drafts, so it refuses the folder")


CONFIG_FIELDS = {  # the kind (glance_rt.files.JSON_KINDS) of each config.json field the reader takes
    **dict.fromkeys(("dflash_config", "glance", "rope_scaling", "rope_parameters"), "object"),
    **dict.fromkeys(("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "num_hidden_layers", "num_target_layers", "block_size", "max_position_embeddings",
                     "dflash_config.block_size", "dflash_config.mask_token_id", "mask_token_id",
                     "glance.draft_vocab_size"), "integer"),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "partial_rotary_factor"), "number"),
    **dict.fromkeys(("target_layer_ids", "dflash_config.target_layer_ids"), "integers"),
    **dict.fromkeys(("glance.learned_mask", "glance.copy_head", "glance.copy_span"), "boolean"),
}


def _config_from_json(d: dict) -> DrafterConfig:
    """Read a DFlash / GLANCE config.json as DFlash's reference does (through transformers' Qwen3Config,
    which also turns a legacy `rope_scaling` into `rope_parameters`)."""
    from transformers import Qwen3Config

    check_json_fields(d, CONFIG_FIELDS, "a drafter config.json")
    dflash = d.get("dflash_config") or {}
    glance = d.get("glance") or {}
    heads = d["num_attention_heads"]
    keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "partial_rotary_factor",
            "num_hidden_layers", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
    hf = Qwen3Config(hidden_size=d["hidden_size"], num_attention_heads=heads,
                     num_key_value_heads=d.get("num_key_value_heads", heads),
                     head_dim=d.get("head_dim") or d["hidden_size"] // heads, **{k: d[k] for k in keys if k in d})
    if d.get("attention_bias"):
        _refuse("attention_bias", "biased q/k/v/o projections are not supported")
    if d.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", f"{d['hidden_act']!r} is not supported (only silu)")
    if "sliding_attention" in (hf.layer_types or []):
        _refuse("use_sliding_window", "sliding-window attention in the drafter is not supported")
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse("partial_rotary_factor", "partial RoPE is not supported")
    block_size = d.get("block_size", dflash.get("block_size"))
    if block_size is None:
        raise KeyError("block_size")
    if "block_size" in dflash and dflash["block_size"] != block_size:
        _refuse("dflash_config.block_size", f"{dflash['block_size']} differs from block_size {block_size} "
                "(the one DFlash's reference uses)")
    ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
    if ids is None:  # DFlash's default rule, which needs num_target_layers
        if "num_target_layers" not in d:
            raise GlanceError("the drafter config has neither dflash_config.target_layer_ids nor num_target_layers "
                              "(DFlash's default rule needs it): add one of them to config.json")
        ids = build_target_layer_ids(int(d["num_target_layers"]), d["num_hidden_layers"])
        n, layers = int(d["num_target_layers"]), d["num_hidden_layers"]
        if layers > 1 and n - 3 <= 1:  # DFlash's rule reaches below layer 1 here (ours clamps): say so
            raise GlanceError(f"DFlash's default target layers for num_target_layers={n} and {layers} draft layers "
                              "are not real layers: add dflash_config.target_layer_ids to config.json")
    rope = dict(hf.rope_parameters)
    rope.pop("type", None)  # the legacy spelling of rope_type
    theta = float(rope.pop("rope_theta", 10000.0))
    return DrafterConfig(
        hidden_size=d["hidden_size"],
        vocab_size=d["vocab_size"],
        target_layer_ids=tuple(int(i) for i in ids),
        num_target_layers=int(d.get("num_target_layers", max(ids) + 1)),
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        intermediate_size=d["intermediate_size"],
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=tuple(rope.items()),
        max_position_embeddings=int(hf.max_position_embeddings),
        block_size=int(block_size),
        mask_token_id=dflash.get("mask_token_id", d.get("mask_token_id")),
        learned_mask=bool(glance.get("learned_mask", False)),
        draft_vocab_size=glance.get("draft_vocab_size"),
        copy_head=bool(glance.get("copy_head", False)),
        copy_span=bool(glance.get("copy_span", False)),
    )


def save_drafter(drafter: GlanceDrafter, path, dtype: torch.dtype | None = None) -> None:
    """Write `config.json` + `model.safetensors` into a temp folder, then rename it into place,
    so an interrupted save never leaves a folder that looks complete."""
    dtype = dtype or next(drafter.parameters()).dtype
    write_model_folder(drafter, _config_json(drafter.config, dtype), path, dtype)


def write_model_folder(module: nn.Module, config: dict, path, dtype: torch.dtype) -> None:
    """`module`'s state dict (floating tensors as `dtype`) as `model.safetensors` beside `config` as
    `config.json`, written as one folder (`atomic_folder`)."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
             for k, v in module.state_dict().items()}

    def write(tmp: Path) -> None:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    atomic_folder(path, write)


def read_drafter(path, dtype: torch.dtype = torch.float32, device="cpu") -> GlanceDrafter:
    """Load a drafter folder on its own (no target checks: `load_drafter` does those)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise GlanceError(
            f"{path} is not a drafter folder: it needs config.json and model.safetensors "
            "(make one with glance_rt.init_drafter(...).save(path) or `glance-rt train`)"
        )
    try:
        config = _config_from_json(json.loads(cfg_file.read_text()))
    except GlanceError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise GlanceError(
            f"{cfg_file} is corrupt or not a DFlash/GLANCE drafter config ({e!r}); re-save or re-train it"
        ) from e
    try:
        state = load_file(weights)
    except (SafetensorError, OSError, ValueError) as e:
        raise GlanceError(f"{weights} is corrupt ({e}); re-save or re-train the drafter") from e
    drafter = GlanceDrafter(config)
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    wrong = [k for k, v in state.items() if tuple(v.shape) != shapes.get(k, tuple(v.shape))]
    if wrong:
        raise GlanceError(f"{weights}: tensors {wrong[:5]} have other shapes than its config.json gives; "
                          "re-save or re-train the drafter")
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise GlanceError(
            f"{weights} does not match its config.json (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; glance-only tensors must be declared in its `glance` "
            "section); re-save or re-train the drafter"
        )
    if config.draft_vocab_size is not None:
        v = drafter.draft_vocab
        if v.numel() and (int(v.min()) < 0 or int(v.max()) >= config.vocab_size or not bool((v[1:] > v[:-1]).all())):
            raise GlanceError(f"{weights}: draft_vocab must hold sorted, distinct token ids below "
                              f"{config.vocab_size}; re-save or re-train the drafter")
    return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)


def default_mask_token_id(target) -> int:
    """The target token whose embedding a new drafter masks with (DFlash's `mask_token_id`): the
    tokenizer's mask token; else the first embedding row past the tokenizer, which no text produces (as
    DFlash's Qwen3 drafters use); else the last added token that is not special (SmolLM2: `<empty_output>`,
    16); else the last id. Any id is lossless: it only decides what the drafter reads at masked rows."""
    tok = getattr(target, "tokenizer", None)
    if tok is None:
        return target.vocab_size - 1
    if getattr(tok, "mask_token_id", None) is not None and tok.mask_token_id < target.vocab_size:
        return int(tok.mask_token_id)
    if len(tok) < target.vocab_size:
        return len(tok)
    special = set(getattr(tok, "all_special_ids", ()))
    added = [i for i in getattr(tok, "added_tokens_decoder", {}) if i not in special and i < target.vocab_size]
    return max(added) if added else target.vocab_size - 1


def drafter_config_for(target, num_layers: int = 1, block_size: int = 8, **overrides) -> DrafterConfig:
    """A config sized for `target`: its hidden size and vocab, DFlash's default layer choice, masking with
    `default_mask_token_id` (so the folder is DFlash-compatible; `learned_mask=True` opts out)."""
    tc = target.text_config
    n_target = tc.num_hidden_layers
    heads = max(tc.num_attention_heads, 1)
    kv = tc.num_key_value_heads
    fields = dict(
        hidden_size=tc.hidden_size,
        vocab_size=target.vocab_size,
        target_layer_ids=build_target_layer_ids(n_target, num_layers),
        num_target_layers=n_target,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv if heads % kv == 0 else heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        intermediate_size=tc.intermediate_size,
        rms_norm_eps=tc.rms_norm_eps,
        block_size=block_size,
    )
    fields.update(overrides)
    if fields.get("mask_token_id") is None and not fields.get("learned_mask"):
        fields["mask_token_id"] = default_mask_token_id(target)
    return DrafterConfig(**fields)


def init_drafter(target, num_layers: int = 1, block_size: int = 8, seed: int = 0, **overrides) -> GlanceDrafter:
    """An untrained drafter for `target` (small normal init, seeded)."""
    config = drafter_config_for(target, num_layers, block_size, **overrides)
    gen = torch.Generator().manual_seed(seed)
    drafter = GlanceDrafter(config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return drafter.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def check_compatible(config: DrafterConfig, target) -> None:
    """Refuse a drafter built for another target, saying what differs."""
    tc = target.text_config
    problems = []
    if config.hidden_size != tc.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target's {tc.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab size {config.vocab_size} != target's {target.vocab_size}")
    bad = [i for i in config.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        problems.append(f"target layer ids {bad} outside the target's {tc.num_hidden_layers} layers")
    if config.mask_token_id is not None and not 0 <= config.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {config.mask_token_id} outside the target's vocabulary")
    if problems:
        raise GlanceError(
            "this drafter was built for another target: " + "; ".join(problems)
            + ". Train one for this target with `glance-rt train` or glance_rt.init_drafter(target)."
        )


def check_dflash(drafter) -> None:
    """Refuse (GlanceError) a drafter, or a drafter folder, that DFlash's reference (and vLLM / SGLang's
    DFlash support) would not run with the same draft tokens: it uses a glance-only extension."""
    if not isinstance(drafter, GlanceDrafter):
        drafter = read_drafter(drafter)
    problems = drafter.config.dflash_problems()
    if problems:
        raise GlanceError(
            "this drafter runs in glance-rt only, not in DFlash (z-lab/dflash, vLLM, SGLang): it uses "
            + "; ".join(problems) + ". These extensions have no DFlash form; for one, train with "
            "`glance-rt train`'s defaults (a mask token, the whole vocabulary), or continue this drafter's "
            "training that way with `--init-from`.")


def load_drafter(path=None, target=None) -> GlanceDrafter:
    """Load a drafter folder for `target`; with no path, the drafter shipped for the default target."""
    if target is None:
        raise GlanceError("load_drafter needs the target it will draft for: load_drafter(path, target)")
    if path is None:

        path = default_drafter_path(target)
    drafter = read_drafter(path, dtype=target.dtype, device=target.device)
    check_compatible(drafter.config, target)
    return drafter
