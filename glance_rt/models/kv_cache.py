"""Static KV cache: per-layer K and V module buffers written by index, never reallocated.

Separate buffers per layer (not one stacked tensor) so that compilers see each write as an in-place
scatter into its own input: a write into a view of one stacked buffer makes inductor copy the whole
cache on every pass.
"""

import os

import torch
from torch import Tensor, nn

from glance_rt.errors import GlanceError


def available_bytes(device) -> int | None:
    """Memory a new buffer on `device` can take now: a GPU's free memory, a CPU's MemAvailable (Linux;
    else the free pages); None where it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(nbytes: int, device, what: str) -> None:
    """GlanceError before allocating `nbytes` that `device` cannot hold now (an out-of-memory kill of a
    server is worse than a refusal naming the setting to lower); `what` says what it is and what sets it."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise GlanceError(f"{what} needs {nbytes / 2**30:.2f} GiB and {device} has {free / 2**30:.2f} GiB "
                          "available: lower max_batch (--max-batch) or max_length (--max-length)")


def slot_rows(rows: Tensor) -> tuple:
    """The index of slots 0..S-1's rows `rows` [S, n] in a slot-major cache [slots, KVH, L, D]: what it
    selects is [S, n, KVH, D]."""
    return torch.arange(rows.shape[0], device=rows.device)[:, None], slice(None), rows


class LayerKV:
    """One layer's k, v buffers [slots, KVH, L, D] (a `KVCache`'s) and what a pass does with them: write rows
    in place, read a slot's or slots 0..S-1's rows as views. Built from the two tensors, so a layer can take
    its cache as plain tensor arguments (what a compiled region reused over the layers needs:
    `glance_rt.models.target.TargetDecoder`)."""

    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v = k, v

    def write(self, rows: Tensor, k: Tensor, v: Tensor, slot: int = 0) -> None:
        """Write k, v [1, KVH, T, D] at cache rows `rows` [T] of `slot` in place (distinct, or a row repeated
        with the same k, v: a padded chunk)."""
        if slot == 0 and self.k.shape[0] == 1:
            self.k.index_copy_(2, rows, k)
            self.v.index_copy_(2, rows, v)
            return
        at = (torch.full((1,), slot, device=rows.device), slice(None), rows)  # filled on the device: no host copy
        self.k[at] = k[0].transpose(0, 1)  # [T, KVH, D]: the indexed dims (slot, rows) first
        self.v[at] = v[0].transpose(0, 1)

    def write_slots(self, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """Write k, v [1, KVH, S*T, D] of slots 0..S-1 (slot s's rows at s*T) at their cache rows `rows` [S, T]
        in place: one scatter for the batch."""
        at = slot_rows(rows)  # -> [S, T, KVH, D]
        self.k[at] = k[0].unflatten(1, rows.shape).permute(1, 2, 0, 3)
        self.v[at] = v[0].unflatten(1, rows.shape).permute(1, 2, 0, 3)

    def read_slots(self, slots: int, kv_len: int) -> tuple[Tensor, Tensor]:
        """k, v of slots 0..S-1 over rows [0, kv_len) each: [S, KVH, kv_len, D] views."""
        return self.k[:slots, :, :kv_len], self.v[:slots, :, :kv_len]

    def read(self, kv_len: int, slot: int = 0) -> tuple[Tensor, Tensor]:
        """k, v over rows [0, kv_len) of `slot`: [1, KVH, kv_len, D]. Eager passes read only the rows written
        so far; static passes read all L rows (a fixed shape)."""
        kc, vc = self.k, self.v
        if kc.shape[0] > 1:  # several slots: this one's (one slot, or slot 0's alone in an export trace: all of it)
            kc, vc = kc[slot : slot + 1], vc[slot : slot + 1]
        if kv_len == kc.shape[2]:
            return kc, vc
        return kc[:, :, :kv_len], vc[:, :, :kv_len]


class KVCache(nn.Module):
    """`k{i}`, `v{i}` [slots, kv_heads, max_len, head_dim] for every layer i: `slots` sequences a batch
    decodes at once (`glance_rt.round.batch`; 1 for one sequence at a time), slot s owning `k{i}[s]` (its
    rows contiguous: slot 0 alone is a dense [1, KVH, L, D], which an exported one-sequence graph reads;
    slots 0..S-1 a dense [S, KVH, L, D], the op's batched layout, a view). Rows are addressed by token
    index within a slot; rejected scratch rows are simply overwritten later. Every method takes the slot
    it works on (0 by default). Writes are in-place scatters into the whole buffer whatever the slot
    (what compilers want of a cache); reads of slots are slices of it. `layer(i)`: layer i's buffers and
    what a pass does with them (`LayerKV`)."""

    def __init__(self, layers: int, kv_heads: int, max_len: int, head_dim: int, dtype, device, slots: int = 1):
        super().__init__()
        self.layers, self.slots, self.rows = layers, slots, max_len
        nbytes = 2 * layers * slots * kv_heads * max_len * head_dim * dtype.itemsize
        check_fits(nbytes, device, f"a KV cache of {slots} slot(s) x {max_len} rows x {layers} layers")
        for i in range(layers):
            for kind in "kv":
                buf = torch.zeros(slots, kv_heads, max_len, head_dim, dtype=dtype, device=device)
                self.register_buffer(f"{kind}{i}", buf, persistent=False)

    @property
    def max_len(self) -> int:
        """Rows per slot."""
        return self.rows

    def layer(self, layer: int) -> LayerKV:
        """Layer `layer`'s whole k, v buffers [slots, KVH, max_len, D]."""
        return LayerKV(getattr(self, f"k{layer}"), getattr(self, f"v{layer}"))

    def move_rows(self, src: Tensor, dst_start: Tensor | int, slot: int = 0) -> None:
        """Copy rows `src` [k] (every layer, one slot) to `[dst_start, dst_start + k)`: the commit's
        compaction. Fixed-size callers pad `src` with `dst_start + i` (a row copied onto itself)."""
        dst = dst_start + torch.arange(src.shape[0], device=src.device)
        at = torch.full((1,), slot, device=src.device)  # made on the device: no host-to-device copy
        for buf in self.buffers():  # gather first, then write: overlapping ranges are safe
            if buf.shape[0] == 1:
                buf.index_copy_(2, dst, buf.index_select(2, src))
            else:
                buf[at, :, dst] = buf[at, :, src]
