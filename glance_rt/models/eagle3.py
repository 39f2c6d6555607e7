"""The EAGLE-3 draft head: the autoregressive baseline GLANCE is compared against.

EAGLE-3 (Li et al., 2025) drafts one token per pass from the target's own hidden states:
- `fc: Linear(3 * H_target -> H)` fuses the target's low, middle and high layer outputs (concatenated in
  that order) into one state per position;
- one decoder layer (`midlayer`) reads the token's embedding and that state side by side: its q, k and
  v project `cat(input_layernorm(embedding), hidden_norm(state))` (2H wide); the residual stream is
  the state (`hidden_norm(state)` with vLLM's `norm_before_residual`); then the usual SwiGLU MLP;
- the layer's output (before the final `norm`) is the state of the next draft step, which has no target
  state yet (training-time test trains the head on its own states);
- `norm` and `lm_head` over a draft vocabulary of `draft_vocab_size` tokens: draft id i is target id
  `i + d2t[i]`.

Weight names are those of the published format (SpecForge writes it, vLLM and SGLang load it), so a
checkpoint's state dict loads as it is. The token embedding is the target's (a checkpoint may carry its
own copy, `embed_tokens`). Attention goes through an `attend(q, k, v)` the caller supplies (the
drafter's own KV cache and mask), as the GLANCE drafter's does.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from glance_rt.errors import GlanceError
from glance_rt.files import check_json_fields
from glance_rt.models.drafter import STATIC_ROPE_TYPES, DraftMLP, RMSNorm, write_model_folder
from glance_rt.models.target import apply_rope


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # H: the head's width (= the target's text hidden size in published heads)
    target_hidden_size: int  # H_target: the width of each fused target state
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # the head's output rows (d2t maps them to target ids)
    target_layer_ids: tuple[int, int, int]  # target decoder layers whose outputs are fused: low, middle, high
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] = ()  # other rope_parameters: (("factor", 8.0), ...)
    max_position_embeddings: int = 32768
    own_embeddings: bool = False  # the checkpoint carries `embed_tokens` (else the target's are used)
    norm_before_residual: bool = False  # vLLM's: the residual stream is hidden_norm(state), not the state

    def __post_init__(self):  # one spelling per config, as DrafterConfig's
        rope = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(self.rope_scaling).items()}
        if rope.get("rope_type") == "default":
            del rope["rope_type"]
        object.__setattr__(self, "rope_scaling", tuple(sorted(rope.items())))
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))

    @property
    def rope_parameters(self) -> dict:
        return {"rope_type": "default", "rope_theta": self.rope_theta, **dict(self.rope_scaling)}

    def validate(self) -> None:
        if len(self.target_layer_ids) != 3:
            raise GlanceError(f"an EAGLE-3 head fuses 3 target layers (low, middle, high), got "
                              f"{self.target_layer_ids}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise GlanceError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got "
                              f"{self.draft_vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise GlanceError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")


def default_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers of an L-layer target, as layer indices whose outputs are
    fused: layers 1, L//2 - 1 and L - 4 (hidden_states 2, L//2 and L-3 in Hugging Face's numbering,
    where hidden_states[0] is the embedding), clamped into the target for tiny targets."""
    top = num_target_layers - 1
    return tuple(min(max(i, 0), top) for i in (1, num_target_layers // 2 - 1, num_target_layers - 4))


class Eagle3Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        h, nh, nkv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * h, nh * d, bias=False)  # [embedding, state]: 2H wide
        self.k_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = Eagle3Attention(c)
        self.mlp = DraftMLP(c)  # the GLANCE drafter's SwiGLU MLP, same names
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # the token embedding's
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # the state's
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Head(nn.Module):
    """Weights, config and the forward of an EAGLE-3 head (names as the published checkpoints')."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        config.validate()
        self.config = c = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # draft id i is target id i + d2t[i]; t2d[j]: target id j is in the draft vocabulary (the first
        # draft_vocab_size ids until a vocabulary is chosen)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(c.vocab_size) < c.draft_vocab_size)
        if c.own_embeddings:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)

    @property
    def target_layer_ids(self) -> tuple[int, int, int]:
        return self.config.target_layer_ids

    def fuse(self, feats: Tensor) -> Tensor:
        """Target features [..., 3 * H_target] (low, middle, high layer outputs, concatenated) -> the
        state of the first draft step [..., H]."""
        return self.fc(feats.to(self.norm.weight.dtype))

    def qkv(self, embeds: Tensor, state: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rows' token embeddings and states [1, T, H] at RoPE cos, sin [1, T, D] -> q [1, nh, T, D] and
        k, v [1, nkv, T, D] (RoPE applied): what a cache stores and the attention reads."""
        c, layer, t = self.config, self.midlayer, embeds.shape[1]
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(state)], -1)  # [1, T, 2H]
        a = layer.self_attn
        q = a.q_proj(x).view(1, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(1, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(1, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, embeds: Tensor, state: Tensor, cos: Tensor, sin: Tensor, attend) -> tuple[Tensor, Tensor]:
        """One draft step over T rows. embeds, state [1, T, H]: each row's token embedding and state
        (`fuse` of the target's features for rows the target has seen, else the state this head
        returned for the row's parent). `attend(q, k, v)` -> attention output [1, nh, T, D]: it adds the
        cached rows and the mask. -> (the rows' next states [1, T, H], draft logits [1, T, Vd])."""
        h = self.step(embeds, state, cos, sin, attend)
        return h, self.lm_head(self.norm(h))

    def step(self, embeds: Tensor, state: Tensor, cos: Tensor, sin: Tensor, attend) -> Tensor:
        """`forward` without the logits: the rows' next states [1, T, H] (training reads the logits of
        some rows only)."""
        t = embeds.shape[1]
        q, k, v = self.qkv(embeds, state, cos, sin)
        layer = self.midlayer
        residual = layer.hidden_norm(state) if self.config.norm_before_residual else state  # [1, T, H]
        h = residual + layer.self_attn.o_proj(attend(q, k, v).transpose(1, 2).reshape(1, t, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target token ids (`d2t` holds the offsets)."""
        return draft_ids + self.d2t[draft_ids]

    def use_vocabulary(self, target_ids: Tensor) -> None:
        """Make the draft vocabulary the sorted target ids `target_ids` [Vd] (d2t and t2d, as SpecForge's
        vocabulary mapping writes them)."""
        c = self.config
        if target_ids.shape != (c.draft_vocab_size,) or bool((target_ids[1:] <= target_ids[:-1]).any()):
            raise GlanceError(f"a draft vocabulary is {c.draft_vocab_size} distinct sorted target ids")
        with torch.no_grad():
            self.d2t.copy_(target_ids - torch.arange(c.draft_vocab_size, device=target_ids.device))
            self.t2d.zero_()
            self.t2d[target_ids] = True


# ----------------------------------------------------------------------------- checkpoints
#
# The published format: a Llama config (`architectures` LlamaForCausalLMEagle3) and the state dict's
# bare names (fc, midlayer.*, norm, lm_head, d2t, t2d; embed_tokens optional). The three fused layers
# are named two ways: vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` as Hugging Face
# hidden_states indices (j: the output of layer j - 1), SGLang and SpecForge read
# `eagle_config.eagle_aux_hidden_state_layer_ids` as layer indices (k: the output of layer k). glance-rt
# writes both, saying the same layers; it reads vLLM's key, as vLLM does, and refuses a folder whose
# SGLang key names other layers than vLLM would use (it would draft differently in the two runtimes).

ARCHITECTURE = "LlamaForCausalLMEagle3"
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM", "LlamaForCausalLM")  # vLLM's names; EAGLE's own


def _config_json(c: Eagle3Config, dtype: torch.dtype) -> dict:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.target_hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": dict(c.rope_scaling) or None,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "norm_before_residual": c.norm_before_residual,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],  # vLLM: hidden_states indices
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.target_layer_ids)},  # SGLang: layer indices
    }


def _refuse(field: str, why: str) -> None:
    raise GlanceError(f"EAGLE-3 config field {field}: {why}; glance-rt would not draft what vLLM drafts with this "
                      "head, so it refuses the folder")


# fields whose other values make vLLM, SGLang or SpecForge draft differently from this head: value allowed
DRAFTING_FIELDS = {"num_hidden_layers": (1,), "attention_bias": (False,), "hidden_act": ("silu",),
                   "tie_word_embeddings": (False,), "fc_norm": (False,),
                   "norm_output": (True,), "mlp_bias": (False,)}


CONFIG_FIELDS = {  # the kind (glance_rt.files.JSON_KINDS) of each config.json field the reader takes
    **dict.fromkeys(("eagle_config", "rope_scaling", "rope_parameters"), "object"),
    **dict.fromkeys(("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings"), "integer"),
    **dict.fromkeys(("rms_norm_eps", "rope_theta"), "number"),
    **dict.fromkeys(("eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids"),
                    "integers"),
    "norm_before_residual": "boolean",
}


def _config_from_json(d: dict, num_target_layers: int | None) -> Eagle3Config:
    """Read a config.json as vLLM does (see above); `num_target_layers` gives the default layers where
    the config names none."""
    check_json_fields(d, CONFIG_FIELDS, "an EAGLE-3 config.json")
    archs = d.get("architectures") or [ARCHITECTURE]
    if not set(archs) & set(ARCHITECTURES):
        raise GlanceError(f"architectures {archs} is not an EAGLE-3 head ({', '.join(ARCHITECTURES)})")
    for field, allowed in DRAFTING_FIELDS.items():
        if field in d and d[field] not in allowed:
            _refuse(field, f"{d[field]!r} is not supported (only {allowed[0]!r})")
    eagle = d.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is not True:
        _refuse("eagle_config.use_aux_hidden_state", "a head over the target's last state alone is not supported")
    vllm_ids, sglang_ids = d.get("eagle_aux_hidden_state_layer_ids"), eagle.get("eagle_aux_hidden_state_layer_ids")
    if vllm_ids is not None:
        layers = tuple(int(j) - 1 for j in vllm_ids)
    elif num_target_layers is not None:
        layers = default_layer_ids(num_target_layers)
    else:
        raise GlanceError("this EAGLE-3 config names no target layers (eagle_aux_hidden_state_layer_ids): load it "
                          "with its target, whose layer count gives EAGLE-3's default layers")
    if sglang_ids is not None and tuple(int(k) for k in sglang_ids) != layers:
        _refuse("eagle_config.eagle_aux_hidden_state_layer_ids",
                f"it names layer outputs {list(sglang_ids)} (SGLang's reading) where vLLM reads "
                f"{'eagle_aux_hidden_state_layer_ids' if vllm_ids is not None else 'its default layers'} as layer "
                f"outputs {list(layers)}; set the top-level eagle_aux_hidden_state_layer_ids to "
                f"{[k + 1 for k in sglang_ids]} (hidden_states indices) if SGLang's reading is the one it was "
                "trained with")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})  # transformers' new spelling, or the old
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope["rope_type"] = rope.pop("rope_type", rope.pop("type", "default"))
    if rope["rope_type"] not in STATIC_ROPE_TYPES:
        _refuse("rope_scaling", f"RoPE type {rope['rope_type']!r} changes with the sequence length (static caches "
                f"take {', '.join(STATIC_ROPE_TYPES)})")
    heads = d["num_attention_heads"]
    return Eagle3Config(
        hidden_size=d["hidden_size"],
        target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
        vocab_size=d["vocab_size"],
        draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
        target_layer_ids=layers,
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"],
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=tuple(rope.items()),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        norm_before_residual=bool(d.get("norm_before_residual", False)),  # vLLM's getattr(config, ..., False)
    )


def save_eagle3(head: Eagle3Head, path, dtype: torch.dtype | None = None) -> None:
    """Write the folder vLLM, SGLang and SpecForge load: `config.json` + `model.safetensors` (written
    into a temp folder, then renamed into place)."""
    dtype = dtype or head.fc.weight.dtype
    write_model_folder(head, _config_json(head.config, dtype), path, dtype)


def read_eagle3(path, num_target_layers: int | None = None, dtype: torch.dtype = torch.float32,
                device="cpu") -> Eagle3Head:
    """Load an EAGLE-3 folder (config.json + model.safetensors, as SpecForge writes and vLLM loads).
    `num_target_layers`: the target's, for EAGLE-3's default layers where the config names none. A
    checkpoint without d2t drafts the whole vocabulary's first ids (identity map, as vLLM); one with
    `embed_tokens` keeps its own embeddings."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise GlanceError(f"{path} is not an EAGLE-3 folder: it needs config.json and model.safetensors")
    try:
        d = json.loads(cfg_file.read_text())
        config = _config_from_json(d, num_target_layers)
    except GlanceError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise GlanceError(f"{cfg_file} is corrupt or not an EAGLE-3 config ({e!r})") from e
    try:
        state = load_file(weights)
    except (SafetensorError, OSError, ValueError) as e:
        raise GlanceError(f"{weights} is corrupt ({e})") from e
    state = {k.removeprefix("model."): v for k, v in state.items()}  # SGLang accepts both spellings
    if "embed_tokens.weight" in state:
        config = Eagle3Config(**{**config.__dict__, "own_embeddings": True})
    head = Eagle3Head(config)
    expected = head.state_dict()
    state.setdefault("d2t", expected["d2t"])  # absent: the identity map (vLLM's zeros)
    state.setdefault("t2d", expected["t2d"])  # vLLM and SGLang never read it
    wrong = [k for k, v in state.items() if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        raise GlanceError(f"{weights}: tensors {wrong[:5]} have other shapes than its config.json gives")
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise GlanceError(f"{weights} does not match an EAGLE-3 head of its config.json (missing "
                          f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    ids = head.target_ids(torch.arange(config.draft_vocab_size))
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
        raise GlanceError(f"{weights}: d2t maps draft ids outside the target's {config.vocab_size} tokens")
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


# ----------------------------------------------------------------------------- a head for a target

DEFAULT_DEPTH = 6  # draft tokens deep (one draft pass each)
DEFAULT_TOP_K = 8  # children per expanded node, nodes expanded per depth


@dataclass(frozen=True)
class Eagle3Drafter:
    """An EAGLE-3 head and how it drafts: `depth` passes a round (the tree's deepest row; a chain's
    length), expanding the `top_k` best nodes of each depth into `top_k` children each (EAGLE's dynamic
    tree), then the round's budget of nodes with the highest cumulative log-probability."""

    head: Eagle3Head
    depth: int = DEFAULT_DEPTH
    top_k: int = DEFAULT_TOP_K

    def __post_init__(self):
        if not 1 <= self.depth <= 31 or not 1 <= self.top_k <= 64:
            raise GlanceError(f"an EAGLE-3 drafter drafts 1-31 tokens deep with top_k 1-64, got depth={self.depth}, "
                              f"top_k={self.top_k}")

    def depth_rows(self, budget: int, chain: bool) -> int:
        """Rows of each depth pass: the beam, `top_k` nodes (1 for a chain; at most the budget)."""
        return 1 if chain else min(self.top_k, budget, self.head.config.draft_vocab_size)

    @property
    def block_size(self) -> int:  # the round loop's scratch and chain rules read a block: depth + 1 rows
        return self.depth + 1

    @property
    def target_layer_ids(self) -> tuple[int, int, int]:
        return self.head.target_layer_ids


def check_target(config: Eagle3Config, target) -> None:
    """Refuse a head built for another target, saying what differs."""
    tc = target.text_config
    problems = []
    if config.target_hidden_size != tc.hidden_size:
        problems.append(f"target_hidden_size {config.target_hidden_size} != the target's {tc.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} != the target's {target.vocab_size}")
    if not config.own_embeddings and config.hidden_size != tc.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} needs its own embed_tokens (the target's are "
                        f"{tc.hidden_size} wide)")
    bad = [i for i in config.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        problems.append(f"target layers {bad} outside the target's {tc.num_hidden_layers}")
    if problems:
        raise GlanceError("this EAGLE-3 head was built for another target: " + "; ".join(problems))


def init_eagle3(target, draft_vocab_size: int | None = None, seed: int = 0, depth: int = DEFAULT_DEPTH,
                top_k: int = DEFAULT_TOP_K, **overrides) -> Eagle3Drafter:
    """A randomly initialised head for `target` (EAGLE-3's default layers, the target's width, a draft
    vocabulary of the first `draft_vocab_size` ids): what training starts from, and the tests' drafter."""
    tc = target.text_config
    heads = max(1, tc.hidden_size // 64)
    fields = dict(hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size, vocab_size=target.vocab_size,
                  draft_vocab_size=draft_vocab_size or target.vocab_size,
                  target_layer_ids=default_layer_ids(tc.num_hidden_layers), num_attention_heads=heads,
                  num_key_value_heads=heads, head_dim=tc.hidden_size // heads,
                  intermediate_size=getattr(tc, "intermediate_size", 4 * tc.hidden_size),
                  rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6))
    with torch.random.fork_rng(devices=[]):  # the caller's random state untouched
        torch.manual_seed(seed)
        head = Eagle3Head(Eagle3Config(**{**fields, **overrides}))
    return Eagle3Drafter(head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False), depth, top_k)


def is_eagle3(path) -> bool:
    """Whether a drafter folder holds an EAGLE-3 head (its config.json's architecture), not a GLANCE /
    DFlash drafter."""
    try:
        d = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = set(d.get("architectures") or ())
    return bool(archs & {ARCHITECTURE, "Eagle3LlamaForCausalLM"}) or ("LlamaForCausalLM" in archs
                                                                        and "draft_vocab_size" in d)


def load_eagle3(path, target, depth: int = DEFAULT_DEPTH, top_k: int = DEFAULT_TOP_K) -> Eagle3Drafter:
    """An EAGLE-3 folder (SpecForge's, or `save_eagle3`'s) as a drafter for `target`."""
    head = read_eagle3(path, target.text_config.num_hidden_layers, dtype=target.dtype, device=target.device)
    check_target(head.config, target)
    return Eagle3Drafter(head, depth, top_k)


def open_drafter(path, target, eagle3: dict | None = None):
    """A drafter folder for `target`: an EAGLE-3 head (`is_eagle3`: drafting `eagle3`'s depth and top_k,
    else the defaults) or a GLANCE / DFlash drafter (`load_drafter`; None: the one shipped for the target)."""
    from glance_rt.models.drafter import load_drafter

    if path is not None and is_eagle3(path):
        return load_eagle3(path, target, **(eagle3 or {}))
    return load_drafter(path, target)
