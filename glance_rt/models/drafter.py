"""The GLANCE drafter: a DFlash-compatible block-diffusion head, and its checkpoint folder.

Architecture (weight names as DFlash's, so published DFlash drafters load and ours serve there):
`fc: Linear(len(target_layer_ids) * H -> H)` + `hidden_norm` over the concatenated target
features; decoder layers (RMSNorm, attention with q/k norm whose K/V are projections of both the
context features and the block, SwiGLU MLP); 1-D RoPE; final `norm`. The target's `embed_tokens`
and `lm_head` are shared and frozen (they are not part of the checkpoint).

Draft vocabulary (as EAGLE-3's): a drafter may propose only `draft_vocab` [Vd], a sorted subset of the
target's token ids (the most frequent in its training responses). Its logits are then the lm_head
rows of that subset: a pass over 8k rows instead of 49k, in training and at inference, at the cost
of never drafting a rare token (verification still decides every token, so output is unchanged).
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glance_rt.errors import GlanceError
from glance_rt.hf.embedded import default_drafter_path
from glance_rt.models.target import apply_rope

FORMAT_VERSION = 1
MAX_BLOCK_SIZE = 64


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
    block_size: int = 8
    mask_token_id: int | None = None  # a target token used as the mask ...
    learned_mask: bool = True  # ... or a learned mask embedding (`mask_embedding`)
    draft_vocab_size: int | None = None  # None: draft over the whole vocabulary; else a `draft_vocab` buffer

    def validate(self) -> None:
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise GlanceError(f"block_size must be in [2, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if not self.target_layer_ids:
            raise GlanceError("target_layer_ids is empty: the drafter needs at least one target layer")
        if self.mask_token_id is None and not self.learned_mask:
            raise GlanceError("a drafter needs a mask_token_id or a learned mask embedding")
        if self.num_attention_heads % self.num_key_value_heads:
            raise GlanceError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise GlanceError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default choice: the middle layer for one draft layer, else spread over [1, L-3]."""
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
    def __init__(self, c: DrafterConfig):
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


def rope_tables(inv_freq: Tensor, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
    """positions [T] -> cos, sin [1, T, D] (1-D RoPE, HF/Qwen3 layout)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def inv_freq(c: DrafterConfig) -> Tensor:
    return 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))


class GlanceDrafter(nn.Module):
    """Weights, config and the forward of a drafter: `context` + `context_kv` turn target features
    into every layer's keys and values, `forward` runs the block rows. The inference pass
    (`glance_rt.round.draft.DraftPass`, a KV cache and tree attention) and the training pass
    (`glance_rt.tools.train.block_forward`, many blocks under a block-sparse mask) both call them."""

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

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def save(self, path) -> None:
        save_drafter(self, path)


# ----------------------------------------------------------------------------- checkpoints


def _config_json(c: DrafterConfig, dtype: torch.dtype) -> dict:
    """DFlash-style config.json (a Qwen3 config plus block_size / num_target_layers / dflash_config)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
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
                   "draft_vocab_size": c.draft_vocab_size},
    }


def _config_from_json(d: dict) -> DrafterConfig:
    dflash = d.get("dflash_config", {})
    glance = d.get("glance", {})
    rope = d.get("rope_parameters") or {}
    ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
    if ids is None:
        raise KeyError("dflash_config.target_layer_ids")
    heads = d["num_attention_heads"]
    return DrafterConfig(
        hidden_size=d["hidden_size"],
        vocab_size=d["vocab_size"],
        target_layer_ids=tuple(int(i) for i in ids),
        num_target_layers=int(d.get("num_target_layers", max(ids) + 1)),
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"],
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        block_size=int(dflash.get("block_size", d.get("block_size", 16))),
        mask_token_id=dflash.get("mask_token_id", d.get("mask_token_id")),
        learned_mask=bool(glance.get("learned_mask", False)),
        draft_vocab_size=glance.get("draft_vocab_size"),
    )


def save_drafter(drafter: GlanceDrafter, path, dtype: torch.dtype | None = None) -> None:
    """Write `config.json` + `model.safetensors` into a temp folder, then rename it into place,
    so an interrupted save never leaves a folder that looks complete."""
    from safetensors.torch import save_file

    path = Path(path)
    dtype = dtype or next(drafter.parameters()).dtype
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    state = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
             for k, v in drafter.state_dict().items()}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(_config_json(drafter.config, dtype), indent=2))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a drafter folder is meant to be shared
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        os.replace(path, old)
        os.replace(tmp, path)

        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


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
    except (ValueError, KeyError, TypeError) as e:
        raise GlanceError(
            f"{cfg_file} is corrupt or not a DFlash/GLANCE drafter config ({e!r}); re-save or re-train it"
        ) from e
    try:
        state = load_file(weights)
    except (SafetensorError, OSError, ValueError) as e:
        raise GlanceError(f"{weights} is corrupt ({e}); re-save or re-train the drafter") from e
    drafter = GlanceDrafter(config)
    if not config.learned_mask and "mask_embedding" in state:
        drafter = GlanceDrafter(replace(config, learned_mask=True))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise GlanceError(
            f"{weights} does not match its config.json (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}); re-save or re-train the drafter"
        )
    if config.draft_vocab_size is not None:
        v = drafter.draft_vocab
        if v.numel() and (int(v.min()) < 0 or int(v.max()) >= config.vocab_size or not bool((v[1:] > v[:-1]).all())):
            raise GlanceError(f"{weights}: draft_vocab must hold sorted, distinct token ids below "
                              f"{config.vocab_size}; re-save or re-train the drafter")
    return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)


def drafter_config_for(target, num_layers: int = 1, block_size: int = 8, **overrides) -> DrafterConfig:
    """A config sized for `target`: its hidden size and vocab, DFlash's default layer choice."""
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


def load_drafter(path=None, target=None) -> GlanceDrafter:
    """Load a drafter folder for `target`; with no path, the drafter shipped for the default target."""
    if target is None:
        raise GlanceError("load_drafter needs the target it will draft for: load_drafter(path, target)")
    if path is None:

        path = default_drafter_path(target)
    drafter = read_drafter(path, dtype=target.dtype, device=target.device)
    check_compatible(drafter.config, target)
    return drafter
