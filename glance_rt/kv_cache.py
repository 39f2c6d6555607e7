"""Static KV cache: one module buffer written by index, never reallocated."""

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    """K and V for every layer: `kv` is [layers, 2, kv_heads, max_len, head_dim].

    Rows are addressed by token index. Rejected scratch rows are simply overwritten later.
    """

    def __init__(self, layers: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (layers, 2, kv_heads, max_len, head_dim)
        self.register_buffer("kv", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_len(self) -> int:
        return self.kv.shape[3]

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [1, KVH, T, D] at rows [start, start+T); return this layer's k, v views
        [1, KVH, start+T, D] (eager slices: attention never reads past the written rows)."""
        end = start + k.shape[2]
        self.kv[layer, 0, :, start:end] = k[0]
        self.kv[layer, 1, :, start:end] = v[0]
        return self.kv[layer, 0, :, :end][None], self.kv[layer, 1, :, :end][None]

    def move_rows(self, src: Tensor, dst_start: int) -> None:
        """Copy rows `src` [k] (all layers) to `[dst_start, dst_start + k)`: the commit's compaction."""
        rows = self.kv.index_select(3, src)  # gather first, so overlapping ranges are safe
        self.kv[:, :, :, dst_start : dst_start + src.shape[0]] = rows
