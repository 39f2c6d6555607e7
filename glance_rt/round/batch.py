"""Batched decoding: several sequences share each round's draft pass and verify pass.

A `Decoder(..., max_batch=B)` holds B cache slots (`KVCache`: the target's and the drafter's). A `Batch`
gives each sequence it admits a slot and runs every sequence's `Decoder.sequence` coroutine (the same
round loop one sequence runs alone: lookup, tree, gate, sampling, stop rules) up to the pass it needs:

    step():  each sequence runs on to its next draft or verify call (a new one to its prefill)
             -> the joining sequences' prefills: whole, or with `Decoder(prefill_chunk=C)` C prompt
                rows a step while others decode (the oldest first), so a long prompt joining does not
                stall the running sequences for its whole prefill
             -> ONE draft pass over the sequences that draft   (`DraftPass.forward_batch`)
             -> each builds its tree on the host
             -> ONE verify pass over every sequence's tree rows (`TargetDecoder.forward_batch`)
             -> each accepts and commits in its own slot

In the verify pass the sequences' tree rows are concatenated: every linear layer runs once over all of
them (the weights are read once per round, whatever the batch), and each row attends its own sequence's
cache slot, prefix and tree ancestors only (block-diagonal: a row never sees another sequence's). The
static passes (slots 0..S-1, trees padded to T rows: `SlotBatch`) make that ONE call of
`glance::tree_attention` per layer over the batch (q [S, H, T, D], each slot's cache rows, tree mask
and prefix length; on a GPU one launch of the Triton kernel, a grid axis per sequence); eager passes,
whose trees keep their own sizes, call it per sequence. Each sequence may have another prompt length,
tree budget, lookup chain, sampling setting, or take a one-row autoregressive step while others draft.
Sequences join (`add`) and leave (finished or `cancel`) at round boundaries; a slot is given back when
its sequence leaves.

Each sequence's tokens are the ones it gets decoded alone: greedy tokens are the target's argmax
given the exact prefix, and sampled ones come from its own seeded generator; only the floating-point
rounding of a row may differ with its neighbours in a GEMM (so in fast numerics, near ties as between
any two engines; with `numerics="exact"` every row gets a one-row step's bits, so not even those).
Batched passes run eagerly or compiled (`StaticGraphs.verify_batch` / `draft_batch`: a graph per
(slots, rows) bucket, each tree padded to the step's longest, free slots padded; CUDA graphs on a GPU;
`Decoder.warmup` compiles every bucket, so sequences joining and leaving never recompile); AOTInductor
engines built with `--max-batch` carry those graphs (the others run one sequence). A
sequence's `Stats` count its own rounds, tokens and draft passes; its phase timings and round seconds
are wall time, so they include the batch's other sequences' work in the same step. The draft gate
weighs a sequence's rounds by what they cost it in the batch instead: its own host work and its share
of each batched pass (a verify pass by its tree rows, over a fixed part shared evenly), so where a
batch makes the passes compute-bound (a CPU) a sequence whose trees commit little takes one-row
steps; the sequences' gates learn one shared model (`GateModel`).
"""

import time
from collections import deque
from dataclasses import dataclass

import torch

from glance_rt.errors import GlanceError
from glance_rt.round.gate import DraftGate, GateModel
from glance_rt.round.loop import Call, Decoder, GenerateResult, Stats
from glance_rt.round.sample import GREEDY, Sampling

BATCHED = ("draft", "verify")  # the passes a step runs once for all sequences


@dataclass(frozen=True)
class Event:
    """What one sequence did in a step: the tokens it committed (after stop rules; maybe none), whether it
    is done (then its `stats`), and the error that ended it, if one did (its slot is free again; the others
    go on)."""

    handle: int
    tokens: list[int]
    done: bool = False
    stats: Stats | None = None
    error: Exception | None = None


@dataclass
class _Sequence:
    handle: int
    slot: int
    coroutine: object = None  # Decoder.sequence's (set once the sequence's cost clock exists)
    stats: Stats | None = None
    pending: Call | None = None  # the batched pass it waits for
    spent: float = 0.0  # seconds it has cost: its own work, and its share of each batched pass
    since: float | None = None  # when its coroutine last resumed (while it runs)

    def cost(self) -> float:
        """`Decoder.sequence`'s cost clock."""
        return self.spent + (time.perf_counter() - self.since if self.since is not None else 0.0)

    def resume(self) -> None:
        self.since = time.perf_counter()

    def pause(self) -> None:
        self.spent, self.since = self.cost(), None


class Batch:
    """Continuous batching over `decoder` (built with `max_batch` slots): `add` a request, `step` every
    sequence one round, read each step's `Event`s; `run` decodes a list of requests start to finish."""

    def __init__(self, decoder: Decoder):
        self.decoder, self.passes = decoder, decoder.passes
        # the draft gates of its sequences learn together, from what a round costs in the batch
        self.gate_model = None if decoder.gate is None else GateModel(decoder.gate.config)
        self._passes: deque = deque(maxlen=64)  # (tree rows, seconds) of the recent verify passes
        self.free = list(range(decoder.max_batch))
        self.sequences: dict[int, _Sequence] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def full(self) -> bool:
        return not self.free

    def add(self, max_new_tokens: int = 128, sampling: Sampling = GREEDY, **inputs) -> int:
        """Admit one request (the processor's inputs, as `Decoder.generate` takes them) -> its handle. It
        prefills in the next `step`. Raises GlanceError when every slot is taken (wait for a sequence to
        finish) or the request is bad."""
        if not self.free:
            raise GlanceError(f"the batch is full ({self.decoder.max_batch} sequences): step until one finishes, "
                              "or build the Decoder with a larger max_batch")
        gate = None if self.gate_model is None else DraftGate(self.gate_model.config, self.gate_model, self._regime)
        handle, self._next = self._next, self._next + 1
        slot = min(self.free)  # the lowest: compiled passes run slots 0..S-1, the fewer the better
        self.free.remove(slot)
        seq = self.sequences[handle] = _Sequence(handle, slot, stats=Stats())
        seq.coroutine = self.decoder.sequence(max_new_tokens, seq.stats, sampling, inputs, gate, seq.cost)
        return handle

    def cancel(self, handle: int) -> None:
        """Drop a sequence now (its client left): its slot is free for the next `add`."""
        seq = self.sequences.pop(handle, None)
        if seq is not None:
            seq.coroutine.close()
            self.free.append(seq.slot)

    def stats(self, handle: int) -> Stats:
        return self.sequences[handle].stats

    def step(self):
        """One round of every sequence (a new one's prefill and first round): yields Events as they come,
        a new sequence's first token as soon as its prefill is done (its time to first token), then one
        per sequence after the batched passes. Consume it whole before the next `add` or `step`."""
        with torch.inference_mode():
            for seq in list(self.sequences.values()):
                if seq.pending is None:
                    yield from self._advance(seq, None)
            yield from self._prefills()
            for name in BATCHED:
                waiting = [s for s in self.sequences.values() if s.pending is not None and s.pending.name == name]
                if not waiting:
                    continue
                try:
                    start = time.perf_counter()
                    results = self._batched(name, waiting)
                    self._share(name, waiting, time.perf_counter() - start)
                except Exception as e:  # a pass that fails fails every sequence in it
                    for seq in waiting:
                        yield self._end(seq, [], e)
                    continue
                for seq, result in zip(waiting, results, strict=True):
                    seq.pending = None
                    yield from self._advance(seq, result)

    def run(self, requests: list[dict]) -> list[GenerateResult]:
        """Decode every request (inputs, and optionally `max_new_tokens` and `sampling`), admitting each as
        a slot frees -> their results in order. Raises the first sequence's error, if one failed."""
        pending, handles, tokens, results = list(enumerate(requests)), {}, {}, [None] * len(requests)
        while pending or self.sequences:
            while pending and not self.full:
                i, req = pending.pop(0)
                req = dict(req)
                handle = self.add(req.pop("max_new_tokens", 128), req.pop("sampling", GREEDY), **req)
                handles[handle], tokens[handle] = i, []
            for ev in self.step():
                if ev.error is not None:
                    for handle in list(self.sequences):
                        self.cancel(handle)
                    raise ev.error
                tokens[ev.handle] += ev.tokens
                if ev.done:
                    ids = tokens[ev.handle]
                    results[handles[ev.handle]] = GenerateResult(ids, self.decoder.target.decode(ids), ev.stats)
        return results

    # ------------------------------------------------------------------ internals

    def _advance(self, seq: _Sequence, value):
        """Send `value` into the sequence and run it on to its next batched call (prefill and commit run at
        once, in its slot): yields an Event of the tokens it commits on the way (after a prefill at once),
        or of its end when it finishes or fails. Its time counts to its cost, not the consumer's."""
        tokens = []
        seq.resume()
        try:
            while True:
                item = seq.coroutine.send(value)
                value = None
                if type(item) is not Call:
                    tokens += item
                elif item.name in BATCHED or item.name == "prefill":  # run by the step (`_prefills`, `_batched`)
                    seq.pending = item
                    break
                else:
                    if item.name == "commit" or not tokens:
                        value = self._single(item, seq.slot)
                        continue
                    seq.pause()
                    yield Event(seq.handle, tokens)  # the prefill's token goes out before the round
                    seq.resume()
                    tokens, value = [], self._single(item, seq.slot)
        except StopIteration:
            seq.pause()
            yield self._end(seq, tokens)
            return
        except Exception as e:
            seq.pause()
            yield self._end(seq, tokens, e)
            return
        seq.pause()
        if tokens or seq.pending.name != "prefill":  # a prompt still prefilling has nothing to say yet
            yield Event(seq.handle, tokens)

    def _prefills(self):
        """Run the waiting prefill pieces, the oldest sequence's first. Where sequences were decoding when
        the step began (waiting for its draft or verify pass), stop once `prefill_chunk` prompt rows ran
        (at least one piece), so they wait for at most that much prefill a step; else (or with
        prefill_chunk None: each prompt is one piece) run them all: a burst of requests arriving together
        is prefilled at once, as without pieces. A sequence whose last piece ran goes on to its first
        token and its first round's pass."""
        budget, ran = self.decoder.prefill_chunk, 0
        decoding = any(s.pending is not None and s.pending.name in BATCHED for s in self.sequences.values())
        for seq in sorted(self.sequences.values(), key=lambda s: s.handle):
            while seq.pending is not None and seq.pending.name == "prefill":
                if budget is not None and decoding and ran >= budget:
                    return
                call, seq.pending = seq.pending, None
                ran += call.args[0].shape[1]
                seq.resume()
                try:
                    result = self._single(call, seq.slot)
                except Exception as e:
                    seq.pause()
                    yield self._end(seq, [], e)
                    break
                seq.pause()
                yield from self._advance(seq, result)

    def _regime(self) -> int:
        """The gate's cost regime: how many sequences share the passes, in powers of two (1, 2, 4, ...)."""
        return 1 << (max(len(self.sequences), 1) - 1).bit_length()

    def _share(self, name: str, waiting: list[_Sequence], seconds: float) -> None:
        """Charge a batched pass to its sequences. A draft pass evenly (each drafts one block); a verify
        pass as its cost grows: seconds ≈ a + b·rows, fitted on the recent verify passes (`_line`), each
        sequence paying an even share of a and b for each of its tree rows (by rows alone until the fit
        has points of several sizes)."""
        if name == "draft":
            for seq in waiting:
                seq.spent += seconds / len(waiting)
            return
        rows = [s.pending.args[1].shape[0] for s in waiting]
        self._passes.append((sum(rows), seconds))
        fixed, per_row = self._line(seconds, sum(rows))
        scale = seconds / (fixed + per_row * sum(rows))  # this pass's own seconds, split by the fit's shape
        for seq, r in zip(waiting, rows, strict=True):
            seq.spent += scale * (fixed / len(waiting) + per_row * r)

    def _line(self, seconds: float, rows: int) -> tuple[float, float]:
        """(a, b) of seconds ≈ a + b·rows over the recent verify passes; (0, seconds / rows) until they
        span several sizes (or where the fit is not a cost: a or b negative)."""
        import numpy as np

        points = np.asarray(self._passes, float)  # [n, 2]
        if len(points) >= 4 and np.ptp(points[:, 0]) > 0:
            b, a = np.polyfit(points[:, 0], points[:, 1], 1)
            if a >= 0 and b > 0:
                return float(a), float(b)
        return 0.0, seconds / rows

    def _single(self, call: Call, slot: int):
        if self.decoder.max_batch == 1:  # one sequence: any backend's passes
            return getattr(self.passes, call.name)(*call.args)
        return getattr(self.passes, call.name)(*call.args, slot=slot)

    def _batched(self, name: str, waiting: list[_Sequence]) -> list:
        if self.decoder.max_batch == 1:
            return [getattr(self.passes, name)(*waiting[0].pending.args)]
        return getattr(self.passes, f"{name}_batch")([(s.slot, s.pending.args) for s in waiting])

    def _end(self, seq: _Sequence, tokens: list[int], error: Exception | None = None) -> Event:
        self.sequences.pop(seq.handle, None)
        self.free.append(seq.slot)
        seq.pending = None
        return Event(seq.handle, tokens, True, seq.stats, error)
