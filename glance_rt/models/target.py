"""Our own text decoder over a Hugging Face model's weights (Llama / Qwen2 / Qwen3 families).

Projections, norms, MLPs and the rotary table are the HF modules themselves (shared, not copied),
so numerics match the HF forward; what is ours is the forward: explicit positions (1-D or M-RoPE),
a static KV cache written by index, and attention through `glance::tree_attention`. On a GPU each
layer's q, k, v and its gate, up projections run as one GEMM each (`fuse`). With a
`KernelPlan` (fp32 on a CPU, eager or compiled) each linear layer runs the kernel the plan chose for
its shape and row count: torch's own, MKL over a transposed copy, or oneDNN's prepacked copy
(`glance_rt.models.kernels`). The decoder keeps one layer stack per row class of the plan (the
stacks share the norms, the rotary table and each kernel's weight layout) and each call runs the
stack of its row count.
"""

import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glance_rt.errors import GlanceError
from glance_rt.models.attention import attend
from glance_rt.models.exact import ExactNumerics, RowBlockLinear
from glance_rt.models.fused import FusedLinear, fusable
from glance_rt.models.kernels import KernelPlan, class_index, with_plan
from glance_rt.models.kv_cache import KVCache, LayerKV
from glance_rt.models.linear import can_pack


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [1, H, T, D]; cos, sin [1, T, D]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def linear_for(plan: KernelPlan | None, module: nn.Module, rows: int, exact: ExactNumerics | None) -> nn.Module:
    """The module a linear layer runs as: the plan's kernel at `rows` rows (`with_plan`); with `exact`
    numerics, that kernel at `exact.rows` rows, always called with exactly that many, or, where a kernel
    proved row-invariant on this machine for calls of up to `exact.invariant_rows` rows
    (`invariant_kernel`), that kernel in calls of up to that many rows, unpadded."""
    if exact is not None:
        whole = invariant_kernel(plan, module, exact)
        if whole is not None:
            return RowBlockLinear(whole, exact.invariant_rows, pad=False)
        return RowBlockLinear(with_plan(plan, module, exact.rows), exact.rows)
    return with_plan(plan, module, rows)


def invariant_kernel(plan: KernelPlan | None, module: nn.Module, exact: ExactNumerics) -> nn.Module | None:
    """The module that runs the CPU linear `module` in exact numerics' whole calls, where `exact.tuner`'s
    probe (once per machine and weight shape) proves its kernel gives every row of a call of up to
    `exact.invariant_rows` rows a one-row call's bits: oneDNN's prepacked kernel laid out for the plan's
    rows (weights the plan packs: fp32), else torch's own linear in eager passes (bf16, fp16: a compiled
    graph may lower a plain linear otherwise at other row counts, so compiled passes keep the blocks).
    None: padded blocks (no tuner, not proved, CUDA: the Triton matmul)."""
    if not (exact.tuner is not None and exact.invariant_rows and isinstance(module, nn.Linear)
            and module.weight.device.type == "cpu"):
        return None
    packs = plan is not None and can_pack(module.weight)
    if not packs and exact.static:
        return None
    kernel = "onednn" if packs else "mkl"
    out_f, in_f = module.weight.shape
    request = (kernel, out_f, in_f, plan.layout_rows if packs else 0, exact.invariant_rows, module.weight.dtype,
               module.bias is not None)
    if not exact.tuner.invariance(request):
        return None
    return plan.kernel(module, "onednn") if packs else module


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a pass: `length` rows from row `offset` of the pass, written at cache rows
    `rows` [length] (`start + arange(length)`) of cache slot `slot`; they see that slot's committed prefix
    [0, rows[0]) and each other where `tree_mask` [length, length]; attention reads slot rows
    [0, kv_len)."""

    slot: int
    offset: int
    length: int
    rows: Tensor  # [length] int64
    tree_mask: Tensor  # [length, length] bool
    kv_len: int


@dataclass(frozen=True)
class SlotBatch:
    """The sequences of cache slots 0..S-1 in a pass, T rows each in slot order (a static batched pass, its
    trees padded to T rows, has this form): row s*T + t of the pass is slot s's row t, written at the
    slot's cache row `rows[s, t]`; it sees the slot's prefix [0, rows[s, 0]) and its own rows where
    `masks[s]`; attention reads rows [0, kv_len) of each slot. Its attention is ONE call of the op over
    the batch (`attend_slots`)."""

    rows: Tensor  # [S, T] int64
    masks: Tensor  # [S, T, T] bool
    kv_len: int

    @staticmethod
    def of(segments: "tuple[Segment, ...]") -> "SlotBatch | None":
        """The segments as a SlotBatch, or None where they are not one (one sequence; slots not 0..S-1 in
        order; another row count or read length)."""
        if len(segments) < 2 or [s.slot for s in segments] != list(range(len(segments))) \
                or len({(s.length, s.kv_len) for s in segments}) > 1:
            return None
        return SlotBatch(torch.stack([s.rows for s in segments]), torch.stack([s.tree_mask for s in segments]),
                         segments[0].kv_len)


def layout(segments: "tuple[Segment, ...]") -> "tuple[Segment, ...] | SlotBatch":
    """How a pass's sequences attend (`attend_pass`): as one SlotBatch where they are one, else segment by
    segment."""
    batch = SlotBatch.of(segments)
    return segments if batch is None else batch


def attend_pass(attend_fn, seqs: "tuple[Segment, ...] | SlotBatch", q: Tensor, k: Tensor, v: Tensor, cache: LayerKV,
                scale: float) -> Tensor:
    """One layer's attention in a pass (the target's or the drafter's): q, k, v [1, heads, T, D], the pass's
    rows laid out by `seqs` (`layout`), the layer's cache -> [1, heads, T, D]. Each sequence's k, v go into
    its own cache slot and its queries see that slot alone: one call of `attend_fn` for a SlotBatch, one per
    segment else."""
    if isinstance(seqs, SlotBatch):
        return attend_slots(attend_fn, seqs, q, k, v, cache, scale)
    outs = [attend_segment(attend_fn, s, q, k, v, cache, scale) for s in seqs]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)  # [1, heads, T, D]


def attend_segment(attend_fn, s: Segment, q: Tensor, k: Tensor, v: Tensor, cache: LayerKV, scale: float) -> Tensor:
    """One sequence's rows of q, k, v [1, heads, T, D] (all of them when it is the only one): its k, v into
    its cache slot, its queries over that slot -> [1, heads, s.length, D]."""
    if s.length != q.shape[2]:
        q, k, v = (x.narrow(2, s.offset, s.length) for x in (q, k, v))
    cache.write(s.rows, k, v, s.slot)
    k_all, v_all = cache.read(s.kv_len, s.slot)  # [1, KVH, L, D]
    return attend_fn(q, k_all, v_all, s.tree_mask, s.rows[0], scale)


def attend_slots(attend_fn, batch: SlotBatch, q: Tensor, k: Tensor, v: Tensor, cache: LayerKV, scale: float) -> Tensor:
    """A SlotBatch's attention in one layer: q, k, v [1, heads, S*T, D] (slot s's rows at s*T) -> k, v into
    their slots (one scatter), every slot's queries over its own cache rows in ONE call of `attend_fn`
    (the op, batched: block-diagonal) -> [1, heads, S*T, D]."""
    slots, t = batch.masks.shape[:2]
    cache.write_slots(batch.rows, k, v)
    k_all, v_all = cache.read_slots(slots, batch.kv_len)  # [S, KVH, L, D]
    qs = q[0].unflatten(1, (slots, t)).transpose(0, 1)  # [S, H, T, D]
    out = attend_fn(qs, k_all, v_all, batch.masks, batch.rows[:, 0], scale)  # [S, H, T, D]
    return out.transpose(0, 1).flatten(1, 2)[None]  # [1, H, S*T, D]


class Attention(nn.Module):
    """`exact`: exact numerics (`glance_rt.models.exact`), linear layers in GEMMs of a fixed row count and
    attention row by row."""

    def __init__(self, hf_attn: nn.Module, n_heads: int, n_kv_heads: int, head_dim: int, plan: KernelPlan | None,
                 rows: int, fuse: bool = False, exact: ExactNumerics | None = None):
        super().__init__()
        qkv = [hf_attn.q_proj, hf_attn.k_proj, hf_attn.v_proj]
        one_gemm = fuse and plan is None and exact is None and fusable(qkv)
        self.qkv = FusedLinear(qkv) if one_gemm else None
        if self.qkv is None:
            self.q_proj, self.k_proj, self.v_proj = (linear_for(plan, m, rows, exact) for m in qkv)
        self.o_proj = linear_for(plan, hf_attn.o_proj, rows, exact)
        self.attend = attend if exact is None else exact.attention
        self.q_norm = getattr(hf_attn, "q_norm", None)  # Qwen3: RMSNorm over head_dim
        self.k_norm = getattr(hf_attn, "k_norm", None)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = float(getattr(hf_attn, "scaling", head_dim**-0.5))

    def forward(self, x, cos, sin, cache: LayerKV, segments: "tuple[Segment, ...] | SlotBatch"):
        t = x.shape[1]
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(1, t, self.n_heads, self.head_dim)  # [1, T, H, D]
        k = k.view(1, t, self.n_kv_heads, self.head_dim)
        v = v.view(1, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, H, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend_pass(self.attend, segments, q, k, v, cache, self.scale)  # [1, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(1, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """The HF gated MLP, `down(act(gate(x)) * up(x))`, over its own projections: each run by the plan's
    kernel, or (`fuse`, plain weights) gate and up as one GEMM."""

    def __init__(self, hf_mlp: nn.Module, plan: KernelPlan | None, rows: int, fuse: bool = False,
                 exact: ExactNumerics | None = None):
        super().__init__()
        gate_up = [hf_mlp.gate_proj, hf_mlp.up_proj]
        self.gate_up = FusedLinear(gate_up) if fuse and plan is None and exact is None and fusable(gate_up) else None
        if self.gate_up is None:
            self.gate_proj, self.up_proj = (linear_for(plan, m, rows, exact) for m in gate_up)
        self.down_proj = linear_for(plan, hf_mlp.down_proj, rows, exact)
        self.act_fn = hf_mlp.act_fn

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.act_fn(gate) * up)


class Block(nn.Module):
    def __init__(self, hf_layer: nn.Module, n_heads: int, n_kv_heads: int, head_dim: int, plan: KernelPlan | None,
                 rows: int, fuse: bool = False, exact: ExactNumerics | None = None):
        super().__init__()
        self.input_layernorm = hf_layer.input_layernorm
        self.post_attention_layernorm = hf_layer.post_attention_layernorm
        self.self_attn = Attention(hf_layer.self_attn, n_heads, n_kv_heads, head_dim, plan, rows, fuse, exact)
        mlp = hf_layer.mlp
        gated = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        if exact is not None and not gated:
            raise GlanceError(f"numerics='exact' runs a gated MLP's projections in fixed row blocks; this model's MLP "
                              f"({type(mlp).__name__}) is not one: use numerics='fast'")
        ours = (plan is not None or fuse or exact is not None) and gated
        self.mlp = MLP(mlp, plan, rows, fuse, exact) if ours else mlp

    def forward(self, h, x, cos, sin, k_cache: Tensor, v_cache: Tensor, segments):
        """h [1, T, H] (the residual stream) and x = `input_layernorm(h)` -> the layer's output [1, T, H]; the
        layer's cache buffers k_cache, v_cache [slots, KVH, L, D] (`LayerKV`) are written in place."""
        h = h + self.self_attn(x, cos, sin, LayerKV(k_cache, v_cache), segments)
        return h + self.mlp(self.post_attention_layernorm(h))


def run_block(block: Block, next_norm: nn.Module | None, h, x, cos, sin, k_cache, v_cache, segments):
    """One layer, from its normed input x = `block.input_layernorm(h)` to its output h and the next layer's
    normed input `next_norm(h)` (the last layer: no next_norm, None; the final norm stays with the logit rows). One
    function for every layer, the layer and its cache buffers its arguments: what
    `torch.compiler.nested_compile_region` reuses (`TargetDecoder`'s `regions`). A region ends after the
    next layer's norm so that the residual add and that norm still fuse into one kernel, as they do with
    the layers inline."""
    h = block(h, x, cos, sin, k_cache, v_cache, segments)
    return h, (next_norm(h) if next_norm is not None else None)


@functools.cache
def block_region():
    """`run_block` as a nested compile region: torch.compile traces and compiles one layer per input shape and
    stamps it out for the others; in eager calls it is `run_block` itself."""
    return torch.compiler.nested_compile_region(run_block)


class TargetDecoder(nn.Module):
    """The target's text decoder with a static cache of `max_len` rows.

    `forward` runs T rows whose cache rows are `[start, start+T)`, seeing the committed prefix
    `[0, start)` and each other through `tree_mask`; attention reads cache rows `[0, kv_len)`
    (`start + T` in eager passes, `max_len` in static-shape ones). It returns logits for the rows
    asked for and the concatenated hidden states of `feature_layers`: the outputs of those decoder
    layers, indexed like HF's `hidden_states[i + 1]` (so the last layer's is taken after the final
    norm). `plan`: the kernel of each linear layer (`glance_rt.models.kernels.KernelPlan`; None: the
    HF modules as they are): `stacks[i]` and `heads[i]` run row class `row_classes[i]`, chosen by a
    call's row count (the head's: the logit rows). `fuse` (with no plan): each layer's q, k, v and
    its gate, up projections run as one GEMM each (`glance_rt.models.fused`: the HF parameters become
    views of one buffer per group, no second copy). `exact`: exact numerics
    (`glance_rt.models.exact`): every call but a prefill (`prefill=True`) runs `exact_stack` and
    `exact_head`, whose rows each get the bits a one-row call gives them; prefill keeps the plan's.
    `slots`: sequences the cache holds at once (`KVCache`); `forward` runs one (`slot`), `forward_batch`
    several in one pass. `regions`: each layer runs as one nested compile region (`block_region`), so
    torch.compile traces and compiles one layer per shape instead of every layer of every graph (the compile
    backend's choice; an exported graph keeps its layers inline: export would carry the region as a
    higher-order op that ONNX and engines do not take).
    """

    def __init__(self, parts, max_len: int, feature_layers: tuple[int, ...] = (), plan: KernelPlan | None = None,
                 fuse: bool = False, exact: ExactNumerics | None = None, slots: int = 1, regions: bool = False):
        super().__init__()
        self.run_block = block_region() if regions else run_block  # (made here: not inside a trace)
        cfg = parts.text_config
        tm = parts.text_model
        n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        self.embed_tokens = tm.embed_tokens
        self.row_classes = plan.row_classes() if plan is not None else (1,)
        self.stacks = nn.ModuleList(
            nn.ModuleList(Block(layer, n_heads, n_kv, head_dim, plan, rows, fuse) for layer in tm.layers)
            for rows in self.row_classes)
        self.heads = nn.ModuleList(with_plan(plan, parts.lm_head, rows) for rows in self.row_classes)
        self.exact_stack = self.exact_head = None
        if exact is not None:
            self.exact_stack = nn.ModuleList(Block(layer, n_heads, n_kv, head_dim, plan, exact.rows, False, exact)
                                             for layer in tm.layers)
            self.exact_head = linear_for(plan, parts.lm_head, exact.rows, exact)
        self.norm = tm.norm
        self.rotary_emb = tm.rotary_emb
        self.feature_layers = tuple(feature_layers)
        self.mrope = bool(parts.mrope)  # positions are [3, 1, T] (M-RoPE), else [1, T]
        w = self.embed_tokens.weight
        self.cache = KVCache(len(tm.layers), n_kv, max_len, head_dim, w.dtype, w.device, slots)

    def kernel_modules(self) -> dict[int, list[nn.Module]]:
        """{row class: the modules that run at it} (`glance_rt.models.kernels.kernel_summary`); with exact
        numerics, what the decode passes run (every GEMM at the exact block's rows)."""
        if self.exact_stack is not None:
            return {self.exact_head.block: [self.exact_stack, self.exact_head]}
        classes = zip(self.row_classes, self.stacks, self.heads, strict=True)
        return {rows: [stack, head] for rows, stack, head in classes}

    def forward(
        self,
        embeds: Tensor,  # [1, T, H]
        positions: Tensor,  # [1, T] or [3, 1, T] (M-RoPE)
        start: Tensor,  # [] int64
        tree_mask: Tensor,  # [T, T] bool
        kv_len: int,
        logit_rows: Tensor | None = None,  # [k] int64: rows to compute logits for (default all)
        prefill: bool = False,  # the prompt's pass (exact numerics: the fast kernels, shared by every decode)
        slot: int = 0,  # the cache slot of the sequence (`KVCache`)
    ) -> tuple[Tensor, Tensor]:
        t = embeds.shape[1]
        rows = start + torch.arange(t, device=embeds.device)  # [T]
        return self.run(embeds, positions, (Segment(slot, 0, t, rows, tree_mask, kv_len),), logit_rows, prefill)

    def forward_batch(self, embeds: Tensor, positions: Tensor, segments: tuple[Segment, ...]) -> tuple[Tensor, Tensor]:
        """Several sequences' rows in one pass (`glance_rt.round.batch`): embeds [1, T, H] and positions
        [1, T] / [3, 1, T] are the segments' rows concatenated in order; every linear layer runs once over
        all T rows, attention per segment over its own cache slot (block-diagonal: no row sees another
        sequence's): one call of the op over the batch where the segments are a `SlotBatch` (slots
        0..S-1, T rows each: the static passes), else a call per segment. -> logits [T, V], features [T, F]."""
        return self.run(embeds, positions, layout(segments))

    def run(self, embeds: Tensor, positions: Tensor, segments: "tuple[Segment, ...] | SlotBatch",
            logit_rows: Tensor | None = None,
            prefill: bool = False) -> tuple[Tensor, Tensor]:
        cos, sin = self.rotary_emb(embeds, positions)  # [1, T, D]
        h, feats = embeds, {}
        exact = self.exact_stack is not None and not prefill
        layers = self.exact_stack if exact else self.stacks[class_index(embeds.shape[1], self.row_classes)]  # (static)
        x = layers[0].input_layernorm(h)  # each layer's normed input comes from the layer before (`run_block`)
        for i, layer in enumerate(layers):
            kv = self.cache.layer(i)
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            h, x = self.run_block(layer, next_norm, h, x, cos, sin, kv.k, kv.v, segments)
            if i in self.feature_layers:
                feats[i] = h
        last = len(layers) - 1
        if last in feats:  # as HF's hidden_states[-1]: the last layer's output comes after the final norm
            feats[last] = self.norm(h)
        h = self.norm(h if logit_rows is None else h.index_select(1, logit_rows))
        head = self.exact_head if exact else self.heads[class_index(h.shape[1], self.row_classes)]
        logits = head(h)[0]  # [T', V]
        if feats:
            features = torch.cat([feats[i] for i in self.feature_layers], -1)[0]  # [T, F]
        else:
            features = embeds.new_zeros(embeds.shape[1], 0)
        return logits, features
