"""Tree attention: the one named op (`glance::tree_attention`) every pass attends through.

Keys and values come from a static cache laid out as `[prefix | rows]`: cache rows `[0, prefix_len)`
are the committed prefix, visible to every query; rows `[prefix_len, prefix_len + T)` are the
queries' own rows, visible where `tree_mask[t, j]`; rows past that are invisible. One op covers
prefill (causal mask), autoregression (`[[True]]`), tree verify (ancestor mask) and the drafter's
block (all true). Prefix visibility is a length, not a mask.

A call carries one sequence (q [1, H, T, D], tree_mask [T, T], prefix_len []) or a batch of B
(`glance_rt.round.batch`: q [B, H, T, D], k, v [B, KVH, L, D] (views of the cache's slots),
tree_mask [B, T, T], prefix_len [B]): each sequence sees its own cache rows, prefix and tree only (a
block-diagonal mask over the batch's rows), and gets the result a call of its own gives it.

Implementations: `tree_attention_reference` (torch SDPA) on CPU and any device without its own;
on CUDA, the Triton kernel in `glance_rt/plugins/tree_attention_triton.py` (reads prefix_len on the
device, attends only the rows each query can see, CUDA-graph capturable), the same kernel the
TensorRT plugin bakes into its engines.

The passes call `attend`: the named op, except when plain CPU tensors run outside any tracer or
compiler, where it calls the op's CPU implementation directly (the same function, without the
dispatcher's per-call cost; docs/engines.md, "Eager attention without the dispatcher"). Every
graph (torch.compile, torch.export, ONNX, AOTInductor) still records `glance::tree_attention`.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def visibility(tree_mask: Tensor, prefix_len: Tensor, kv_len: int) -> Tensor:
    """Boolean attention mask [T, L] for queries `[prefix_len, prefix_len + T)` over L cache rows."""
    t = tree_mask.shape[0]
    j = torch.arange(kv_len, device=tree_mask.device)  # [L]
    rel = j - prefix_len  # [L]
    in_rows = (rel >= 0) & (rel < t)
    rows = tree_mask[:, rel.clamp(0, t - 1)]  # [T, L]
    return (j < prefix_len)[None, :] | (in_rows[None, :] & rows)


def per_sequence(fn, q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, prefix_len: Tensor, scale: float) -> Tensor:
    """`fn` (tree attention of one sequence) over a call's sequences: one call as it is (tree_mask [T, T]),
    a batch (tree_mask [B, T, T]) sequence by sequence -> [B, H, T, D]."""
    if tree_mask.dim() == 2:
        return fn(q, k, v, tree_mask, prefix_len, scale)
    return torch.cat([fn(q[b : b + 1], k[b : b + 1], v[b : b + 1], tree_mask[b], prefix_len[b], scale)
                      for b in range(q.shape[0])])


def tree_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, prefix_len: Tensor, scale: float
) -> Tensor:
    """q [1, H, T, D]; k, v [1, KVH, L, D]; tree_mask [T, T] bool; prefix_len [] int64 -> [1, H, T, D]
    (or a batch: [B, ...], tree_mask [B, T, T], prefix_len [B])."""
    return per_sequence(_one_sequence, q, k, v, tree_mask, prefix_len, scale)


def _one_sequence(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, prefix_len: Tensor, scale: float) -> Tensor:
    kv_heads, d = k.shape[1], q.shape[3]
    groups = q.shape[1] // kv_heads
    t, kv_len = q.shape[2], k.shape[2]
    if q.device.type == "cpu":  # reads prefix_len on the host: CPU-only (elsewhere a sync, and none inside a graph)
        seen = int(prefix_len) + t  # rows past the queries' own are invisible: read only the ones seen
        k, v = k[:, :, :seen], v[:, :, :seen]  # [1, KVH, P+T, D]
        if t == 1 and bool(tree_mask[0, 0]):
            # one query row that sees every cached row (autoregression): no mask at all
            qg = q.reshape(1, kv_heads, groups, d)  # [1, KVH, G, D]
            return F.scaled_dot_product_attention(qg, k, v, scale=scale).reshape(q.shape)
        mask = torch.cat([tree_mask.new_ones(t, seen - t), tree_mask], 1)  # [T, P+T]: the prefix, then the tree
    else:
        mask = visibility(tree_mask, prefix_len, kv_len)  # [T, L]
    # GQA by folding each KV head's G query heads into its rows, so K and V are read as they lie in
    # the cache (no [1, H, L, D] copies); every folded row carries its query's mask row.
    qg = q.reshape(1, kv_heads, groups * t, d)  # [1, KVH, G*T, D]
    if groups > 1:
        mask = mask.repeat(groups, 1)  # [G*T, L]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[None, None], scale=scale)
    return out.reshape(q.shape)  # [1, H, T, D]


@torch.library.custom_op("glance::tree_attention", mutates_args=())
def tree_attention(
    q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, prefix_len: Tensor, scale: float
) -> Tensor:
    """The named op. Shapes as in `tree_attention_reference`."""
    return tree_attention_reference(q, k, v, tree_mask, prefix_len, scale).contiguous()


@tree_attention.register_kernel("cuda")
def _(q, k, v, tree_mask, prefix_len, scale):
    try:
        from glance_rt.plugins.tree_attention_triton import tree_attention as triton_tree_attention
    except ImportError as e:
        from glance_rt.errors import GlanceError

        raise GlanceError("tree attention on CUDA runs a Triton kernel: install triton (CUDA builds of torch "
                          "bring it; otherwise pip install 'glance-rt[gpu]')") from e
    return triton_tree_attention(q, k, v, tree_mask, prefix_len, scale)


@tree_attention.register_fake
def _(q, k, v, tree_mask, prefix_len, scale):
    return q.new_empty(q.shape)  # contiguous, as the real kernel returns


def attend(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, prefix_len: Tensor, scale: float) -> Tensor:
    """What the passes call. Shapes as in `tree_attention_reference`. Plain CPU tensors outside a tracer
    (eager decoding) take the op's CPU implementation directly: a custom op's Python dispatch costs tens
    of microseconds a call, once per layer per pass, a few percent of an eager one-row step. Anything
    traced or compiled (fake, functional or proxy tensors; dynamo) goes through the named op."""
    if type(q) is Tensor and q.device.type == "cpu" and not torch.compiler.is_compiling():
        return tree_attention_reference(q, k, v, tree_mask, prefix_len, scale)
    return tree_attention(q, k, v, tree_mask, prefix_len, scale)
