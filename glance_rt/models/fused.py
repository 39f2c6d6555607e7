"""One GEMM for the projections that read the same input: a layer's q, k and v, and its MLP's gate and up.

At a decode step each projection is a GEMV of one row, and on a GPU a small GEMV costs about a kernel
launch whatever its size: the second H200 run (docs/engines.md) timed Qwen2.5-VL-3B's k and v
projections (1 MB of weights each) at 5.5 µs apiece, and a step's 7 GEMMs a layer at 2.5 ms of its 3.4
ms of kernels. One GEMM over the stacked weights reads the same bytes in fewer, larger launches.

The stacked weight is not a second copy. `stack_rows` lays the parameters back to back in one buffer
once and makes each HF parameter a view of its rows (the same Parameter objects and values: the HF
model computes what it did, bit for bit, and `save_pretrained` writes the same tensors); a later
decoder over the same model finds them laid out and takes the view without copying. Each output is
the same dot products as the separate layers' (a GEMM's summation order may differ: fp32 rounding).
"""

import torch
from torch import Tensor, nn
from torch.nn import functional as F


def fusable(linears: list[nn.Module]) -> bool:
    """Plain nn.Linear layers over one input size, dtype and device, all with biases or none."""
    first = linears[0]
    return all(
        type(m) is nn.Linear and m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
        for m in linears)


def _back_to_back(tensors: list[Tensor]) -> Tensor | None:
    """The tensors' concatenation along dim 0 as a view of their one storage, if they lie back to back
    in it (contiguous, in order); else None."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


@torch.no_grad()
def stack_rows(params: list[nn.Parameter]) -> Tensor:
    """One tensor [sum of rows, ...] whose row blocks ARE `params`: laid out back to back the first time
    (each parameter's data becomes a view of its rows), found so afterwards."""
    stacked = _back_to_back([p.detach() for p in params])
    if stacked is None:
        stacked = torch.cat([p.detach() for p in params])
        start = 0
        for p in params:
            p.data = stacked[start : start + p.shape[0]]
            start += p.shape[0]
    return stacked


class FusedLinear(nn.Module):
    """Several nn.Linear layers over the same input as one GEMM: x [..., in] -> their outputs
    ([..., out_i] each, views of one [..., sum out_i])."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        self.sizes = [m.out_features for m in linears]
        self.register_buffer("weight", stack_rows([m.weight for m in linears]), persistent=False)  # [sum out, in]
        bias = None if linears[0].bias is None else stack_rows([m.bias for m in linears])
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, -1)
