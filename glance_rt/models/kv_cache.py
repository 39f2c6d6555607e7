"""Static KV cache: per-layer K and V module buffers written by index, never reallocated.

Separate buffers per layer (not one stacked tensor) so that compilers see each write as an in-place
scatter into its own input: a write into a view of one stacked buffer makes inductor copy the whole
cache on every pass.
"""

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    """`k{i}`, `v{i}` [slots, kv_heads, max_len, head_dim] for every layer i: one slot per sequence a
    batch decodes at once (`glance_rt.round.batch`; 1 for one sequence at a time). Rows are addressed by
    token index within a slot; rejected scratch rows are simply overwritten later. Every method takes
    the slot it works on (0 by default); with one slot the buffers are used whole, as fixed-shape graphs
    want them."""

    def __init__(self, layers: int, kv_heads: int, max_len: int, head_dim: int, dtype, device, slots: int = 1):
        super().__init__()
        self.layers = layers
        for i in range(layers):
            for kind in "kv":
                buf = torch.zeros(slots, kv_heads, max_len, head_dim, dtype=dtype, device=device)
                self.register_buffer(f"{kind}{i}", buf, persistent=False)

    @property
    def max_len(self) -> int:
        return self.k0.shape[2]

    @property
    def slots(self) -> int:
        return self.k0.shape[0]

    def buffers_of(self, layer: int, slot: int = 0) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s k, v of one slot: [1, KVH, max_len, D] each."""
        kc, vc = getattr(self, f"k{layer}"), getattr(self, f"v{layer}")
        return (kc, vc) if kc.shape[0] == 1 else (kc[slot : slot + 1], vc[slot : slot + 1])

    def write(self, layer: int, rows: Tensor, k: Tensor, v: Tensor, slot: int = 0) -> None:
        """Write k, v [1, KVH, T, D] at cache rows `rows` [T] of `slot` in place (distinct, or a row repeated
        with the same k, v: a padded chunk)."""
        kc, vc = self.buffers_of(layer, slot)
        kc.index_copy_(2, rows, k)
        vc.index_copy_(2, rows, v)

    def read(self, layer: int, kv_len: int, slot: int = 0) -> tuple[Tensor, Tensor]:
        """This layer's k, v over rows [0, kv_len) of `slot`: [1, KVH, kv_len, D]. Eager passes read only
        the rows written so far; static passes read all `max_len` rows (a fixed shape)."""
        kc, vc = self.buffers_of(layer, slot)
        if kv_len == self.max_len:
            return kc, vc
        return kc[:, :, :kv_len], vc[:, :, :kv_len]

    def move_rows(self, src: Tensor, dst_start: Tensor | int, slot: int = 0) -> None:
        """Copy rows `src` [k] (every layer, one slot) to `[dst_start, dst_start + k)`: the commit's
        compaction. Fixed-size callers pad `src` with `dst_start + i` (a row copied onto itself)."""
        dst = dst_start + torch.arange(src.shape[0], device=src.device)
        for layer in range(self.layers):
            for buf in self.buffers_of(layer, slot):
                buf.index_copy_(2, dst, buf.index_select(2, src))  # gather first: overlapping ranges are safe
