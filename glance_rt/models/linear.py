"""Prepacked linear layers for the eager and compiled CPU passes.

On x86 CPUs the passes are GEMMs of a few rows (a tree of 17-33 rows, a draft block of 8) against
the weights. PyTorch's CPU `linear` calls MKL, whose fp32 GEMM for such shapes is slow on CPUs
other than Intel's (measurements in docs/engines.md). `PackedLinear` reorders the weight once into
oneDNN's blocked layout (`mkldnn._reorder_linear_weight`) and runs `mkldnn._linear_pointwise`:
the same product, other summation order (fp32 rounding, like any other kernel).

The product is one named op, `glance::packed_linear`, whose packed weight is an opaque object
(`PackedWeight`): torch.compile keeps it as one extern call and fuses everything around it, so the
compiled passes run the same oneDNN kernels as eager. (Inductor's own `_linear_pointwise` lowering
wants weights it froze itself, and its fp32 freezing path packs for MKL, the slow kernel here.)
Which layers get it is measured per machine (`kernels.py`). Engines are exported from the plain
weights. Training's response and feature stages swap the HF model's linears for the duration of the
stage (`swapped_linears`); the HF modules are never left changed.
"""

from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase


def can_pack(weight: Tensor) -> bool:
    """oneDNN prepacking applies to fp32 weights on a CPU with oneDNN (mkldnn) enabled."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.enabled
            and torch.backends.mkldnn.is_available())


class PackedWeight(OpaqueBase):
    """A weight [out, in] reordered once into oneDNN's blocked layout for about `rows` rows (any
    row count runs). Opaque to torch.compile: passed by reference to `glance::packed_linear`."""

    def __init__(self, weight: Tensor, rows: int):
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


register_opaque_type(PackedWeight, typ="reference")


@torch.library.custom_op("glance::packed_linear", mutates_args=())
def packed_linear(x: Tensor, weight: PackedWeight, bias: Tensor | None, out_features: int) -> Tensor:
    """x [..., in] @ weight.T (+ bias) -> [..., out_features] with oneDNN's prepacked kernel."""
    return torch.ops.mkldnn._linear_pointwise(x, weight.tensor, bias, "none", [], "")


@packed_linear.register_fake
def _(x: Tensor, weight, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(nn.Module):
    """`linear(x)` with the weight [out, in] reordered once for oneDNN; x [..., in] -> [..., out]."""

    def __init__(self, weight: Tensor, bias: Tensor | None, rows: int):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = PackedWeight(weight, rows)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.glance.packed_linear(x, self.packed, self.bias, self.out_features)


class TransposedLinear(nn.Module):
    """`linear(x)` as x @ W.T with W.T stored once as a contiguous [in, out] copy: MKL's GEMM over the
    weight in the other layout (its one-row case ran ~1.7x faster this way for a 49,152 x 576 head on
    an Intel Xeon; `kernels.py` times it). x [..., in] -> [..., out]."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_t", weight.detach().t().contiguous(), persistent=False)  # [in, out]
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)  # [N, in]
        y = torch.mm(x2, self.weight_t) if self.bias is None else torch.addmm(self.bias, x2, self.weight_t)
        return y.view(*x.shape[:-1], self.out_features)


def packed(linear: nn.Module, rows: int) -> nn.Module:
    """A PackedLinear of an `nn.Linear` laid out for `rows` rows when packable; the module itself
    when rows is 0 (packing off) or it cannot be packed."""
    if rows > 0 and isinstance(linear, nn.Linear) and can_pack(linear.weight):
        return PackedLinear(linear.weight, linear.bias, rows)
    return linear


def swap_linears(module: nn.Module, make) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace every nn.Linear inside `module` (in place) by `make(linear)` where that is another
    module; returns (parent, name, original) for each replacement."""
    swaps = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (new := make(child)) is not child:
                setattr(parent, name, new)
                swaps.append((parent, name, child))
    return swaps


def pack_module(module: nn.Module, rows: int) -> nn.Module:
    """Replace every nn.Linear inside `module` (in place) by its PackedLinear; returns `module`."""
    swap_linears(module, lambda lin: packed(lin, rows))
    return module


@contextmanager
def swapped_linears(module: nn.Module, make):
    """Run `module` with every nn.Linear replaced by `make(linear)` for the duration of the block; the
    original modules are put back on exit, even on error (training's response and feature stages run
    the HF model this way, with the kernels chosen for this CPU)."""
    swaps = swap_linears(module, make)
    try:
        yield module
    finally:
        for parent, name, child in reversed(swaps):
            setattr(parent, name, child)
