"""Batched decoding: several sequences share each round's draft pass and verify pass.

A `Decoder(..., max_batch=B)` holds B cache slots (`KVCache`: the target's and the drafter's). A `Batch`
gives each sequence it admits a slot and runs every sequence's `Decoder.sequence` coroutine (the same
round loop one sequence runs alone: lookup, tree, gate, sampling, stop rules) up to the pass it needs:

    step():  each sequence runs on to its next draft or verify call (a new one through its prefill)
             -> ONE draft pass over the sequences that draft   (`DraftPass.forward_batch`)
             -> each builds its tree on the host
             -> ONE verify pass over every sequence's tree rows (`TargetDecoder.forward_batch`)
             -> each accepts and commits in its own slot

In the verify pass the sequences' tree rows are concatenated: every linear layer runs once over all of
them (the weights are read once per round, whatever the batch), and attention runs per sequence over
its own cache slot, its prefix and its tree ancestors (`glance::tree_attention` per segment:
block-diagonal, a row never sees another sequence's). Each sequence may have another prompt length,
tree budget, lookup chain, sampling setting, or take a one-row autoregressive step while others draft.
Sequences join (`add`) and leave (finished or `cancel`) at round boundaries; a slot is given back when
its sequence leaves.

Each sequence's tokens are the ones it gets decoded alone: greedy tokens are the target's argmax
given the exact prefix, and sampled ones come from its own seeded generator; only the floating-point
rounding of a row may differ with its neighbours in a GEMM (so in fast numerics, near ties as between
any two engines; with `numerics="exact"` every row gets a one-row step's bits, so not even those).
Batched passes run eagerly or compiled (`StaticGraphs.verify_batch` / `draft_batch`: a graph per
(slots, rows) bucket, each tree padded to the step's longest, free slots padded; CUDA graphs on a GPU;
`Decoder.warmup` compiles every bucket, so sequences joining and leaving never recompile); engines run
one sequence (`max_batch=1`). A
sequence's `Stats` count its own rounds, tokens and draft passes; its phase timings and round seconds
are wall time, so they include the batch's other sequences' work in the same step (and each sequence's
draft gate, which weighs its drafted rounds against its one-row steps by those seconds, learns on its
own).
"""

from dataclasses import dataclass

import torch

from glance_rt.errors import GlanceError
from glance_rt.round.gate import DraftGate
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
    coroutine: object
    stats: Stats
    pending: Call | None = None  # the batched pass it waits for


class Batch:
    """Continuous batching over `decoder` (built with `max_batch` slots): `add` a request, `step` every
    sequence one round, read each step's `Event`s; `run` decodes a list of requests start to finish."""

    def __init__(self, decoder: Decoder):
        self.decoder, self.passes = decoder, decoder.passes
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
        gate = None if self.decoder.gate is None else DraftGate(self.decoder.gate.config)  # its own round history
        stats = Stats()
        coroutine = self.decoder.sequence(max_new_tokens, stats, sampling, inputs, gate)
        handle, self._next = self._next, self._next + 1
        self.sequences[handle] = _Sequence(handle, self.free.pop(0), coroutine, stats)
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
            for name in BATCHED:
                waiting = [s for s in self.sequences.values() if s.pending is not None and s.pending.name == name]
                if not waiting:
                    continue
                try:
                    results = self._batched(name, waiting)
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
        or of its end when it finishes or fails."""
        tokens = []
        try:
            while True:
                item = seq.coroutine.send(value)
                value = None
                if type(item) is not Call:
                    tokens += item
                elif item.name in BATCHED:
                    seq.pending = item
                    break
                else:
                    if item.name == "commit" or not tokens:
                        value = self._single(item, seq.slot)
                        continue
                    yield Event(seq.handle, tokens)  # the prefill's token goes out before the round
                    tokens, value = [], self._single(item, seq.slot)
        except StopIteration:
            yield self._end(seq, tokens)
            return
        except Exception as e:
            yield self._end(seq, tokens, e)
            return
        yield Event(seq.handle, tokens)

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
