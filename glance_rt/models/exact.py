"""Exact numerics: a decode pass computes each row bit for bit as an autoregressive step does.

A verify pass of T tree rows and an autoregressive step of one row take different paths through
torch's kernels, so the same position's logits differ in their last bits (measured on this CPU with
`scripts/row_invariance.py`: MKL's fp32 GEMM gives another result for most elements of a row computed
among T rows than alone; bf16 and fp16 now and then). Where two tokens are nearly tied, speculative
decoding then commits a token that the same engine's own autoregression would not. With
`numerics="exact"` every decode pass (AR steps and verify passes alike; prefill is shared by both and
keeps the fast kernels) runs:

- each linear layer (and the LM head) as GEMMs of exactly `EXACT_ROWS` rows, the rows padded with
  zeros to a multiple of it (`RowBlockLinear`): a GEMM of a fixed shape reduces every output element
  in one order whatever the row's neighbours and its place in the block, so a row gets the same bits
  in a one-row step and in any verify pass (checked across the tiny architectures and dtypes, and a
  planted variant whose reduction depends on the row count is caught: tests/test_exact.py). On a CPU
  where the linear's kernel proves row-invariant (every row of a call of 1 to `INVARIANT_ROWS` rows
  gets a one-row call's bits; probed per weight shape by the kernel tuner and cached per machine,
  `glance_rt.models.kernels.row_invariance`): oneDNN's prepacked kernel for fp32 weights, torch's own
  linear for bf16/fp16 ones in eager passes, that kernel in whole calls of up to that many rows
  instead: no padding, each weight read once per call (on a 2-core AMD EPYC, MKL's fp32 GEMM is not
  row-invariant, while oneDNN's fp32 kernel laid out for 8 rows and torch's bf16/fp16 linear are). On CUDA,
  the Triton matmul of `glance_rt.plugins.matmul_triton` instead (fixed tiles, no split-K; through
  Triton's interpreter here, not yet run on a GPU);
- attention one row at a time over the row's own visible cache rows in cache order: the committed
  prefix, its ancestors, itself. That is the sequence of keys an autoregressive step at the same
  position reads once its ancestors are committed (the commit moves accepted rows together), so both
  make the same call on the same data. The tree's gaps (rows of other branches between a row and its
  ancestors) never enter a reduction. On CUDA, the Triton kernel's path kernel
  (`tree_attention(..., exact=True)` in `glance_rt.plugins.tree_attention_triton`): one launch for
  every row and sequence of a pass, each program walking one row's path through the cache where it
  lies (no gathered copies; reads prefix_len on the device, so CUDA graphs capture it). On a CPU, torch
  SDPA over a slice holding the row's rows in order (`row_attention`, `static_row_attention`).

Norms, activations, rotary embeddings and the residual adds work row by row and are left as they are.
On a CPU, eager passes attend each row's rows at their exact count (`row_attention`: it reads the prefix
length on the host; an AR step attends the cache's own rows, a tree's rows a scratch copy of the prefix
with the row's path behind it); fixed-shape passes (backend="compile") gather them to the front of a sequence as
long as the cache and mask the rest (`static_row_attention`: no host read). Each backend's AR and GLANCE
agree bit for bit; there the two backends need not agree with each other (on CUDA both run the path
kernel).
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glance_rt.models.attention import per_sequence, visibility
from glance_rt.models.kernels import KernelTuner

EXACT_ROWS = 8  # rows of every GEMM of an exact decode pass
INVARIANT_ROWS = 32  # the most rows of one call of a kernel proved row-invariant (checked for 1..this many)


@dataclass(frozen=True)
class ExactNumerics:
    """How a decoder's decode passes run in exact numerics: every GEMM at `rows` rows (on CUDA the Triton
    matmul); attention row by row over each row's visible cache rows: on CUDA the Triton path kernel, on
    a CPU the rows at their exact count (`row_attention`, eager passes) or, `static`, gathered to the
    fixed length of the cache (`static_row_attention`: no host reads, so compiled graphs carry it).
    `invariant_rows`: a CPU linear whose kernel gives, on this machine, every row of a call of up to this
    many rows a one-row call's bits (probed by `tuner` and cached
    per machine: `glance_rt.models.target.invariant_kernel`) runs in whole calls of up to that many rows
    instead of padded blocks (0, or no tuner: blocks everywhere)."""

    rows: int = EXACT_ROWS
    static: bool = False
    invariant_rows: int = INVARIANT_ROWS
    tuner: KernelTuner | None = None  # its probe (`KernelTuner.invariance`)

    @property
    def attention(self):
        """The attention of these numerics, for one sequence or a batch (`exact_attention`)."""
        return partial(exact_attention, static=self.static)


def exact_attention(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, prefix_len: Tensor, scale: float,
                    static: bool) -> Tensor:
    """Attention in exact numerics, shapes as `glance::tree_attention` (one sequence or a batch): on CUDA
    the Triton path kernel, one launch (`glance::path_attention`); elsewhere sequence by sequence, each
    row over its gathered rows (`static`: at the cache's fixed length, `static_row_attention`)."""
    if q.is_cuda:
        return path_attention(q, k, v, tree_mask, prefix_len, scale, 0)
    return per_sequence(static_row_attention if static else row_attention, q, k, v, tree_mask, prefix_len, scale)


# The CUDA kernels of exact numerics are custom ops, as the fast attention is (`glance::tree_attention`):
# opaque to dynamo, so compiled passes and CUDA graphs call them as they are (CPU tensors run them through
# Triton's interpreter, as the tests do). They are not exported: an ONNX Runtime engine's graphs are the CPU
# static form (`static_row_attention`, blocks of `RowBlockLinear`); TensorRT builds refuse exact numerics.


@torch.library.custom_op("glance::path_attention", mutates_args=())
def path_attention(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, prefix_len: Tensor, scale: float,
                   split_rows: int) -> Tensor:
    """The Triton path kernel: every query row the bits of the autoregressive step at its position (shapes
    as `glance::tree_attention`). `split_rows`: the split-KV size (0: the kernel's own)."""
    from glance_rt.plugins import tree_attention_triton as kernel

    return kernel.tree_attention(q, k, v, tree_mask, prefix_len, scale, split_rows or kernel.SPLIT_ROWS, exact=True)


@path_attention.register_fake
def _(q, k, v, tree_mask, prefix_len, scale, split_rows):
    return q.new_empty(q.shape)  # contiguous, as the kernel returns


@torch.library.custom_op("glance::invariant_linear", mutates_args=())
def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., K] @ weight.T (+ bias) by the row-invariant Triton matmul (`glance_rt.plugins.matmul_triton`)."""
    from glance_rt.plugins.matmul_triton import invariant_linear as launch

    return launch(x, weight, bias)


@invariant_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class RowBlockLinear(nn.Module):
    """`linear` computed as GEMMs of exactly `block` rows: an nn.Linear (its weights shared) or any kernel
    module of one (`glance_rt.models.kernels.kernel_module`: a `PackedLinear`, a `TransposedLinear`).
    `pad` False (a kernel proved row-invariant for calls of 1..`block` rows): calls of `block` rows and one
    of the remainder, unpadded. On CUDA an nn.Linear runs the Triton matmul whose reduction order is fixed
    per output element whatever the rows (`glance_rt.plugins.matmul_triton`; no padding needed, and no
    library's choice of algorithm or split-K by shape)."""

    def __init__(self, linear: nn.Module, block: int = EXACT_ROWS, pad: bool = True):
        super().__init__()
        self.linear, self.block, self.pad = linear, block, pad

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda and isinstance(self.linear, nn.Linear):
            return invariant_linear(x, self.linear.weight, self.linear.bias)
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)  # [n, K]
        n = rows.shape[0]
        if not self.pad:  # [n, N] in calls of at most `block` rows (one call, no copy, when n fits)
            out = self.linear(rows) if n <= self.block else torch.cat([self.linear(b) for b in rows.split(self.block)])
            return out.reshape(*lead, -1)
        pad = -n % self.block
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, k)])  # [n + pad, K]
        out = torch.cat([self.linear(blk) for blk in rows.split(self.block)])  # [n + pad, N]
        return out[:n].reshape(*lead, -1)


def row_attention(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, prefix_len: Tensor, scale: float) -> Tensor:
    """`glance::tree_attention`'s result (shapes as `tree_attention_reference`) computed one query row at
    a time over its visible cache rows in cache order, as the slice [0, n) of a sequence holding them
    there: q [1, H, T, D]; k, v [1, KVH, L, D]. A one-row step (T = 1, seeing rows 0..p) attends the
    cache's own rows; a tree's rows attend a scratch copy of the prefix (one per call) behind which each
    row's path (its ancestors and itself) stands when its turn comes. Either way a row at cache position
    j attends the first j + 1 rows of a sequence laid out as the one an autoregressive step at j reads.
    The rows take turns in depth-first order, so a row's path differs from the one in place by the row
    alone (only what differs is written: any mask works, a tree costs one row copy a row)."""
    kv_heads, d = k.shape[1], q.shape[3]
    h, t = q.shape[1], q.shape[2]
    p = int(prefix_len)
    qg = q[0].transpose(0, 1).reshape(t, 1, kv_heads, h // kv_heads, d)  # [T, 1, KVH, G, D]
    if t == 1:
        out = F.scaled_dot_product_attention(qg[0], k[:, :, : p + 1], v[:, :, : p + 1], scale=scale)
        return out.reshape(1, h, 1, d)
    ks, vs = (x.new_empty(1, kv_heads, p + t, d) for x in (k, v))  # [1, KVH, p + T, D]: prefix, then a path
    ks[:, :, :p], vs[:, :, :p] = k[:, :, :p], v[:, :, :p]
    paths = [[] for _ in range(t)]  # each row's visible tree rows, in cache order
    for row, seen in tree_mask.nonzero().tolist():
        paths[row].append(seen)
    out, held = [None] * t, []  # held: the tree rows now behind the prefix in the scratch
    for i in sorted(range(t), key=paths.__getitem__):  # depth first
        path, same = paths[i], 0
        while same < min(len(held), len(path)) and held[same] == path[same]:
            same += 1
        for j in range(same, len(path)):
            ks[:, :, p + j], vs[:, :, p + j] = k[:, :, p + path[j]], v[:, :, p + path[j]]
        held, n = path, p + len(path)
        out[i] = F.scaled_dot_product_attention(qg[i], ks[:, :, :n], vs[:, :, :n], scale=scale)  # [1, KVH, G, D]
    return torch.cat(out).reshape(t, h, d).transpose(0, 1)[None]  # [1, H, T, D]


def visible_first(seen: Tensor) -> tuple[Tensor, Tensor]:
    """seen [T, L] bool -> (order [T, L]: each row's visible cache rows first, in cache order, then the
    others in cache order; keep [T, L]: where `order` holds a visible row). A stable sort of ~seen,
    written as a scatter of each row's destination (a running count), which ONNX exports."""
    length = seen.shape[1]
    j = torch.arange(length, device=seen.device).expand_as(seen)  # [T, L]
    count = seen.long().cumsum(1)  # [T, L]: visible rows up to and including j
    visible = count[:, -1:]  # [T, 1]
    dest = torch.where(seen, count - 1, visible + j - count)  # [T, L]: where row j goes
    order = torch.zeros_like(dest).scatter(1, dest, j)  # [T, L]
    return order, j < visible


def static_row_attention(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, prefix_len: Tensor,
                         scale: float) -> Tensor:
    """`row_attention` at fixed shapes: each query row's visible cache rows are gathered, in cache order,
    to the front of a sequence as long as the cache (L rows), the rest behind them masked out. An AR
    step and a verify row at the same position then attend the same keys at the same places of a
    sequence of the same length, with no host read of prefix_len. q [1, H, T, D]; k, v [1, KVH, L, D]."""
    kv_heads, length, d = k.shape[1], k.shape[2], q.shape[3]
    h, t = q.shape[1], q.shape[2]
    seen = visibility(tree_mask, prefix_len, length)  # [T, L]
    order, keep = visible_first(seen)  # [T, L] each
    kg = k[0][:, order].transpose(0, 1)  # [T, KVH, L, D]
    vg = v[0][:, order].transpose(0, 1)
    qg = q[0].transpose(0, 1).reshape(t, kv_heads, h // kv_heads, d)  # [T, KVH, G, D]
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=keep[:, None, None, :], scale=scale)  # [T, KVH, G, D]
    return out.reshape(t, h, d).transpose(0, 1)[None]  # [1, H, T, D]
