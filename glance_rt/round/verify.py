"""The verify pass, and the passes a decoding round runs behind the one interface the loop calls.

`EagerPasses` is the reference: exact lengths (the prompt in one pass, attention over the rows
written so far). `StaticPasses` runs the same math at fixed shapes, so that compilers can take it:
the prompt in chunks of `chunk` rows, the drafter's context padded (to R rows per round, the longest
path a round accepts; to `chunk` rows for the prompt), attention over all `max_len` cache rows (on
a CPU the tree-attention op reads only the rows its queries can see). Its graphs are the methods of
`StaticGraphs`, plain functions of tensors; a backend swaps them for compiled (torch.compile) or
loaded (AOTInductor) versions. Padded rows only ever land on cache rows that are rewritten before
anything can see them.

A `Backend` is how a Decoder gets its passes: a factory `(verifier, draft) -> passes` (eager,
compiled, or an engine's loaded graphs, `glance_rt.engines.engine.engine_backend`), so the loop is
built from passes and nothing is replaced after construction. `round_modules` builds the modules the
passes run (and engine builders trace) without a Decoder.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glance_rt.errors import GlanceError
from glance_rt.models.drafter import GlanceDrafter, check_compatible
from glance_rt.models.eagle3 import Eagle3Drafter, check_target
from glance_rt.models.exact import ExactNumerics
from glance_rt.models.kernels import PREFILL_ROWS, KernelPlan
from glance_rt.models.target import Segment, SlotBatch, TargetDecoder
from glance_rt.round.commit import accept, accept_path, compact, entropies
from glance_rt.round.device_tree import build_tree_device, lookup_tensors
from glance_rt.round.draft import DraftPass
from glance_rt.round.eagle3 import Eagle3Pass
from glance_rt.round.graphs import GraphRunner
from glance_rt.round.passcheck import checked_plans
from glance_rt.round.tree import max_depth

GRAPHS = ("prefill", "verify", "draft", "context")
EAGLE3_GRAPHS = ("eagle3_context", "eagle3_depth")  # an EAGLE-3 head's fixed-shape passes


def drafts(name: str) -> bool:
    """Whether graph kind `name` (a manifest key's part before "-") is a drafter's pass, which reads and
    writes the drafter's cache and runs only where a Decoder has a drafter."""
    return name in ("draft", "context", "draft_batch") or name.startswith("eagle3_")


class EagerPasses:
    """Exact-length passes. `drafter`: a DraftPass, any drafter protocol object, or None."""

    def __init__(self, verifier: TargetDecoder, drafter):
        self.verifier, self.drafter = verifier, drafter

    def rows_needed(self, prompt_len: int, piece: int | None = None) -> int:
        return prompt_len

    batches = True  # verify_batch and draft_batch: several sequences' passes as one

    def warmup(self, budgets, chain: bool, rounds=(), lookups=()) -> None:
        """Nothing to compile: exact-length passes run as they come."""

    def prefill(self, embeds: Tensor, positions: Tensor, start: int = 0, slot: int = 0) -> tuple[Tensor, Tensor]:
        """embeds [1, P, H], positions [1, P] / [3, 1, P] of prompt rows [start, start + P) (a piece of a
        prompt prefilled in pieces sees the rows before it) -> last row's logits [V], features [P, F].
        `slot`: the sequence's cache slot (`glance_rt.round.batch`), as in every pass below."""
        p, dev = embeds.shape[1], embeds.device
        causal = torch.ones(p, p, dtype=torch.bool, device=dev).tril()
        last = torch.tensor([p - 1], device=dev)
        logits, feats = self.verifier(embeds, positions, torch.tensor(start, device=dev), causal, start + p, last,
                                      prefill=True, slot=slot)
        return logits[0], feats

    def verify(self, tree, tokens: Tensor, positions: Tensor, start: int, mask: Tensor, slot: int = 0):
        """tokens [T], positions [1, T] / [3, 1, T], tree mask [T, T] -> logits [T, V], features
        [T, F], the target's argmax at every row (numpy [T]) and the accepted path (row list)."""
        return self.verify_batch([(slot, (tree, tokens, positions, start, mask))])[0]

    def verify_batch(self, calls: list) -> list:
        """Several sequences' verify passes as one (`TargetDecoder.forward_batch`): calls [(slot, verify's
        arguments)] -> each one's `verify` result."""
        segments, offset = [], 0
        for slot, (_, tokens, _, start, mask) in calls:
            t = tokens.shape[0]
            rows = start + torch.arange(t, device=tokens.device)  # [T]
            segments.append(Segment(slot, offset, t, rows, mask, start + t))
            offset += t
        tokens = torch.cat([args[1] for _, args in calls])  # [sum T]
        positions = torch.cat([args[2] for _, args in calls], -1)  # [1, sum T] / [3, 1, sum T]
        embeds = self.verifier.embed_tokens(tokens)[None]  # [1, sum T, H]
        if len(calls) == 1:  # one sequence: the plain pass
            s = segments[0]
            logits, feats = self.verifier(embeds, positions, s.rows[0], s.tree_mask, s.kv_len, slot=s.slot)
        else:
            logits, feats = self.verifier.forward_batch(embeds, positions, tuple(segments))
        greedy = logits.argmax(-1).cpu().numpy()
        out = []
        for s, (_, (tree, *_)) in zip(segments, calls, strict=True):
            rows = slice(s.offset, s.offset + s.length)
            out.append((logits[rows], feats[rows], greedy[rows], accept(tree, greedy[rows])))
        return out

    def draft(self, ctx_feats: Tensor, ctx_start: int, bonus: int, block_start: int,
              ctx_tokens: Tensor | None = None) -> Tensor:
        """-> draft logits [B-1, V]; `ctx_tokens` [m]: the token after each context row, for a copy head."""
        if ctx_tokens is None:
            return self.drafter(ctx_feats, ctx_start, bonus, block_start)
        return self.drafter(ctx_feats, ctx_start, bonus, block_start, ctx_tokens=ctx_tokens)

    def draft_batch(self, calls: list) -> list:
        """Several sequences' draft passes as one (`DraftPass.forward_batch`): calls [(slot, draft's
        arguments)] -> each one's draft logits."""
        return self.drafter.forward_batch(tuple((slot, *args) for slot, args in calls))

    def draft_tree(self, ctx_feats: Tensor, ctx_tokens: Tensor, ctx_start: int, bonus: int, block_start: int,
                   budget: int, chain: bool):
        """A drafter that grows its own tree (EAGLE-3's `Eagle3Pass`): -> (Tree, draft passes run)."""
        return self.drafter.draft_tree(ctx_feats, ctx_tokens, ctx_start, bonus, block_start, budget, chain)

    def commit(self, path: list[int], start: int, slot: int = 0) -> None:
        compact(self.verifier.cache, path, start, slot)


class StaticGraphs(nn.Module):
    """The fixed-shape graphs of one target (+ drafter), sharing their weights and caches.

    prefill(embeds [1, C, H], positions, start [], last [1]) -> logits [1, V], features [C, F]
    verify(tokens [T], positions, start [], mask [T, T], parent [T]) -> logits [T, V], features [T, F],
        greedy [T] (the target's argmax per row), path [min(T, R)] (accepted rows, then -1; on the device;
        [R] when traced for any T)
    draft(ctx [R, F], ctx_start [], bonus [], block_start []) -> draft logits [B-1, V]
    context(ctx [C, F], ctx_start []) -> nothing (writes the drafter's context cache)
    round(ctx [R, F], args [5 + N], chain) -> report [2K+3] float64, accepted features [K, F]: a drafted round
        whole (`round`, K = min(N+1, R))
    lookup(args [3 + N]) -> report [2K+3] float64, accepted features [K, F]: a lookup round whole (K = N+1)
    step(args [3]) -> report [2] float64, features [1, F]: an autoregressive step whole (`step`)
    """

    def __init__(self, verifier: TargetDecoder, draft_pass=None):
        super().__init__()
        if getattr(draft_pass, "copies", False):
            draft_pass._no_copy("every fixed-shape graph")
        self.verifier, self.draft_pass = verifier, draft_pass
        self.max_len = verifier.cache.max_len
        self.block_size = draft_pass.block_size if draft_pass is not None else 1
        self.ctx_rows = max_depth(self.block_size) + 1 if draft_pass is not None else 1  # R: the longest path
        self.register_buffer("_zero", torch.zeros((), dtype=torch.long), persistent=False)

    def prefill(self, embeds: Tensor, positions: Tensor, start: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
        c = embeds.shape[1]
        causal = torch.ones(c, c, dtype=torch.bool, device=embeds.device).tril()
        return self.verifier(embeds, positions, start, causal, self.max_len, last, prefill=True)

    def verify(self, tokens: Tensor, positions: Tensor, start: Tensor, mask: Tensor, parent: Tensor,
               any_rows: bool = False):
        """`any_rows`: the graph is traced for any row count (an export's dynamic row dimension): its path
        is R long whatever T (a tree of T < R rows ends its path with -1s), not min(T, R)."""
        logits, feats = self.verifier(self.verifier.embed_tokens(tokens)[None], positions, start, mask, self.max_len)
        greedy = logits.argmax(-1)  # [T]
        depth = self.ctx_rows - 1 if any_rows else min(tokens.shape[0], self.ctx_rows) - 1  # T rows: <= T-1 deep
        return logits, feats, greedy, accept_path(parent, tokens, greedy, depth)

    def draft(self, ctx: Tensor, ctx_start: Tensor, bonus: Tensor, block_start: Tensor) -> Tensor:
        return self.draft_pass.step(ctx, ctx_start, bonus, block_start, self.max_len)

    def verify_batch(self, tokens: Tensor, positions: Tensor, starts: Tensor, masks: Tensor, parents: Tensor,
                     any_rows: bool = False):
        """The verify pass of the sequences in cache slots 0..S-1 at once, T rows each: tokens [S, T], positions
        [1, S, T] / [3, 1, S, T], starts [S], masks [S, T, T], parents [S, T] -> logits [S, T, V], features
        [S, T, F], greedy [S, T], paths [S, min(T, R)] (`verify`'s per slot; `any_rows`: R long). No loop over
        the slots: S (and T) can be symbolic (an export's dynamic batch)."""
        slots, t = tokens.shape
        seqs = SlotBatch(starts[:, None] + torch.arange(t, device=tokens.device), masks, self.max_len)  # rows [S, T]
        embeds = self.verifier.embed_tokens(tokens.reshape(1, -1))  # [1, S*T, H]
        logits, feats = self.verifier.run(embeds, positions.flatten(-2), seqs)  # [S*T, V], [S*T, F]
        logits, feats = logits.unflatten(0, (slots, t)), feats.unflatten(0, (slots, t))
        greedy = logits.argmax(-1)  # [S, T]
        depth = self.ctx_rows - 1 if any_rows else min(t, self.ctx_rows) - 1
        return logits, feats, greedy, accept_path(parents, tokens, greedy, depth)

    def draft_batch(self, ctx: Tensor, ctx_start: Tensor, bonus: Tensor, block_start: Tensor) -> Tensor:
        """The draft pass of the sequences in cache slots 0..S-1 at once: ctx [S, R, F], ctx_start, bonus,
        block_start [S] -> draft logits [S, B-1, V] (no loop over the slots: S can be symbolic)."""
        self.draft_pass.slot_contexts(ctx, ctx_start)
        return self.draft_pass.slot_blocks(bonus, block_start, self.max_len)

    def context(self, ctx: Tensor, ctx_start: Tensor) -> Tensor:
        self.draft_pass.context(ctx, ctx_start)
        return self._zero + 0  # exporters want an output

    def eagle3_context(self, feats: Tensor, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """EAGLE-3's context pass over C rows (`Eagle3Pass.static_context`) -> state [H], log-probs [Vd]."""
        return self.draft_pass.static_context(feats, tokens, positions)

    def eagle3_depth(self, ids: Tensor, states: Tensor, positions: Tensor, rows: Tensor,
                     visible: Tensor) -> tuple[Tensor, Tensor]:
        """One EAGLE-3 depth pass of k rows, visible [k, cache rows] -> states [k, H], log-probs [k, Vd]."""
        return self.draft_pass.rows(ids, states, positions, rows, visible)

    def round(self, ctx: Tensor, args: Tensor, chain: bool = False) -> tuple[Tensor, Tensor]:
        """A drafted round on the device, with no host sync, so one graph (one CUDA graph) runs it: the
        draft pass, the tree of budget N (`build_tree_device`, `build_tree`'s arrays), verify, greedy
        acceptance and the commit's compaction of the accepted rows' KV. ctx [R, F]: the draft pass's
        context rows; args int64 [5 + N] (the round's one host-to-device copy beside ctx): the context's
        start, the bonus, the block's start, the M-RoPE shift, the prompt-lookup chain's length, then the
        chain padded to N rows (`lookup_tensors`).
        -> report [2K+3] float64, the round's one device-to-host copy: the accepted rows (then -1),
        the tokens of rows path[i] (K), the bonus (the target's argmax after the last accepted row),
        the entropies of the root's and that row's distributions; and the accepted rows' features
        [K, F] (rows past the path: copies of the root's), the next draft pass's context."""
        ctx_start, bonus, block_start, rope_delta, lookup_len = args[:5].unbind()  # []
        lookup_chain = args[5:]  # [N]
        draft_logits = self.draft(ctx, ctx_start, bonus, block_start)  # [B-1, V]
        vocab = getattr(self.draft_pass, "draft_vocab", None)
        tree = build_tree_device(draft_logits, bonus, lookup_chain.shape[0], chain, vocab, lookup_chain, lookup_len)
        positions = text_positions(tree.depth + block_start, rope_delta, self.verifier.mrope)
        logits, feats, greedy, path = self.verify(tree.tokens, positions, block_start, tree.mask, tree.parent)
        src = torch.where(path >= 0, block_start + path, block_start + torch.arange(path.shape[0], device=path.device))
        self.verifier.cache.move_rows(src, block_start)  # the accepted rows' KV to [start, start + K)
        return accepted_report(tree.tokens, logits, feats, greedy, path)

    def lookup(self, args: Tensor) -> tuple[Tensor, Tensor]:
        """A lookup round on the device (a prompt-lookup chain that fills the round's budget: no draft pass),
        with no host sync: verify of the tree root -> chain[0] -> ... -> chain[N-1] (`lookup_tree`'s) and
        greedy acceptance. args int64 [3 + N] (the round's one host-to-device copy): the bonus, the block's
        start, the M-RoPE shift, then the chain. -> `round`'s report and accepted features (K = N + 1 <= R).
        Nothing to compact: a chain's accepted rows are its first ones, already in place."""
        block_start, rope_delta = args[1], args[2]  # []
        tokens = torch.cat([args[:1], args[3:]])  # [T]: the bonus (the root), then the chain
        depth = torch.arange(tokens.shape[0], device=args.device)  # [T]: row i is the chain's depth i
        positions = text_positions(depth + block_start, rope_delta, self.verifier.mrope)
        mask = depth[:, None] >= depth[None]  # [T, T]: a chain sees its rows up to itself
        logits, feats, greedy, path = self.verify(tokens, positions, block_start, mask, depth - 1)
        return accepted_report(tokens, logits, feats, greedy, path)

    def step(self, args: Tensor) -> tuple[Tensor, Tensor]:
        """An autoregressive step on the device, with no host sync: the one-row verify pass of the token
        args[0] at cache row (and text index) args[1], its M-RoPE shift args[2] (int64 [3]: the step's one
        host-to-device copy) -> report [2] float64 (the target's argmax, the entropy of its distribution:
        the step's one device-to-host copy), the row's features [1, F]. The same pass as `verify` of a
        one-row tree (the root alone is always accepted; its commit moves nothing)."""
        tokens, start = args[:1], args[1]  # [1], []
        positions = text_positions(args[1:2], args[2], self.verifier.mrope)  # [1, 1] / [3, 1, 1]
        mask = torch.ones(1, 1, dtype=torch.bool, device=args.device)
        logits, feats, greedy, _ = self.verify(tokens, positions, start, mask, torch.full_like(tokens, -1))
        return torch.cat([greedy.double(), entropies(logits).double()]), feats


def accepted_report(tokens: Tensor, logits: Tensor, feats: Tensor, greedy: Tensor, path: Tensor):
    """A device round's report [2K+3] float64 (its one device-to-host copy): the accepted rows `path` [K]
    (then -1), the tokens of rows path[i], the bonus (the target's argmax after the last accepted row), the
    entropies of the root's and that row's distributions; and the accepted rows' features [K, F] (rows past
    the path: copies of the root's), the next draft pass's context."""
    rows = path.clamp(min=0)  # [K]
    last = rows.gather(0, (path >= 0).sum().sub(1).view(1))  # [1]: the last accepted row
    ends = torch.cat([rows[:1], last])  # [2]: the root, the last accepted row
    report = torch.cat([path, tokens.index_select(0, rows), greedy.index_select(0, last)])
    return torch.cat([report.double(), entropies(logits.index_select(0, ends)).double()]), feats.index_select(0, rows)


def round_args(ctx_start: int, bonus: int, block_start: int, rope_delta: int, block_size: int, budget: int,
               chain: bool, lookup: tuple[int, list[int]], device=None) -> Tensor:
    """`StaticGraphs.round`'s args [5 + max(budget, 1)] int64, built on the host and copied once: the
    draft's context start, the bonus, the block's start, the M-RoPE shift, the lookup chain's length and
    the chain (`lookup`: the host's prompt-lookup match (n, chain), cut as `build_tree` cuts it)."""
    lookup_chain, lookup_len = lookup_tensors(lookup, block_size - 1, budget, chain)
    return torch.cat([torch.tensor([ctx_start, bonus, block_start, rope_delta, int(lookup_len)]),
                      lookup_chain]).to(device)


def text_positions(index: Tensor, rope_delta, mrope: bool) -> Tensor:
    """Token indices [T] -> the positions the text decoder takes: [1, T], or [3, 1, T] for M-RoPE (a
    text token's position is the same on all three axes, shifted by the image grid's `rope_delta`)."""
    pos = (index + rope_delta)[None]
    return pos[None].expand(3, 1, -1) if mrope else pos


@dataclass(frozen=True)
class DeviceRound:
    """What the host learns of a round run on the device (`StaticPasses.round`)."""

    path: list[int]  # accepted tree rows, root first
    run: list[int]  # the committed tokens: the accepted rows' tokens, then the bonus
    feats: Tensor  # [len(path), F] the accepted rows' features (on the device)
    root_entropy: float  # of the target's distribution at the root
    end_entropy: float  # ... at the last accepted row: the next round's prior

    @staticmethod
    def read(report: Tensor, feats: Tensor) -> "DeviceRound":
        """From a round graph's outputs (`accepted_report`): one device-to-host copy."""
        host = report.tolist()
        k = feats.shape[0]
        path = [int(i) for i in host[:k] if i >= 0]
        run = [int(t) for t in host[k + 1 : k + len(path)]] + [int(host[2 * k])]
        return DeviceRound(path, run, feats[: len(path)], host[2 * k + 1], host[2 * k + 2])


@dataclass(frozen=True)
class StaticShapes:
    chunk: int  # prompt rows per prefill pass (and drafter-context rows per context pass)
    block_size: int  # B (1 without a drafter)
    ctx_rows: int  # R: the draft pass's context rows, the longest accepted path (`max_depth` + 1; 1 without one)
    exact_prefill: bool = False  # the prefill graph takes any row count from MIN_PREFILL_ROWS: one pass
    batch_buckets: tuple[int, ...] = (1,)  # cache slots a batched graph covers (`batch_buckets`)


MIN_PREFILL_ROWS = 2  # exporters specialise a dimension of size 1: a one-token prompt is padded to 2


class StaticPasses:
    """Fixed-shape passes over `fns` (name -> callable with the StaticGraphs signatures)."""

    def __init__(self, graphs: StaticGraphs, fns: dict, shapes: StaticShapes):
        self.graphs, self.fns, self.shapes = graphs, fns, shapes
        self.cache = graphs.verifier.cache
        self.device = graphs.verifier.embed_tokens.weight.device

    def _t(self, x) -> Tensor:
        return torch.tensor(x, device=self.device)

    def rows_needed(self, prompt_len: int, piece: int | None = None) -> int:
        """Cache rows the prompt's padded chunks (and the drafter's context chunks) write; `piece`: the
        prompt prefilled in pieces of that many rows (`Decoder(prefill_chunk=)`), each padded from its start."""
        c = self.shapes.chunk
        piece = piece or max(prompt_len, 1)
        last = max(prompt_len - 1, 0) // piece * piece  # the last piece's start
        return max(-(-prompt_len // c) * c, last + -(-(prompt_len - last) // c) * c)

    @property
    def batches(self) -> bool:
        """Whether the graphs include the batched ones (compiled with slots, or an engine built with them)."""
        return "verify_batch" in self.fns

    @property
    def has_round(self) -> bool:
        """Whether a drafted round can run as one graph (`round`; engines have no such graph)."""
        return "round" in self.fns

    @property
    def has_lookup(self) -> bool:
        """Whether a lookup round can run as one graph (`lookup`; engines have no such graph)."""
        return "lookup" in self.fns

    @property
    def has_step(self) -> bool:
        """Whether an autoregressive step can run as one graph (`step`; engines run their one-row verify)."""
        return "step" in self.fns

    def warmup(self, budgets, chain: bool, rounds=(), lookups=()) -> None:
        """Run every graph once at its fixed shape (a verify graph per budget bucket, a round graph per
        drafted budget in `rounds`, the step graph where `rounds` holds 0, a lookup graph per chain length in
        `lookups`): compiles, captures or loads each now. The rows they write are scratch, rewritten before any
        is read."""
        with torch.inference_mode():
            for key, args in example_inputs(self.graphs, self.shapes, budgets, chain, rounds, lookups).items():
                fn = self.fns.get(key.split("-")[0])
                if fn is not None:  # prefill may run eagerly (compiled_fns)
                    fn(*args)

    @staticmethod
    def _pad_rows(x: Tensor, rows: int, dim: int) -> Tensor:
        """Pad dim `dim` of x to `rows` by repeating its last entry (values that are never seen)."""
        n = x.shape[dim]
        if n == rows:
            return x.clone(memory_format=torch.contiguous_format)  # graphs are specialised to standard strides
        last = x.narrow(dim, n - 1, 1)
        reps = [1] * x.dim()
        reps[dim] = rows - n
        return torch.cat([x, last.repeat(*reps)], dim)

    def prefill(self, embeds: Tensor, positions: Tensor, start: int = 0, slot: int = 0) -> tuple[Tensor, Tensor]:
        if "prefill" not in self.fns or self.cache.slots > 1:
            # the prompt in one exact-length eager pass (see compiled_fns; an engine's prefill graph attends
            # slot 0's rows, so a batched engine prefills every slot so, alike)
            return EagerPasses(self.graphs.verifier, None).prefill(embeds, positions, start, slot)
        p = embeds.shape[1]
        c = max(p, MIN_PREFILL_ROWS) if self.shapes.exact_prefill else self.shapes.chunk
        feats, logits = [], None
        for s in range(0, p, c):
            n = min(c, p - s)
            e = self._pad_rows(embeds[:, s : s + n], c, 1)  # [1, C, H] (C = P: the prompt in one exact pass)
            pos = self._pad_rows(positions[..., s : s + n], c, positions.dim() - 1)
            logits, f = self.fns["prefill"](e, pos, self._t(start + s), self._t([n - 1]))
            feats.append(f[:n].clone())  # a CUDA-graph replay of the next chunk reuses f's memory
        return logits[0], torch.cat(feats)

    def verify(self, tree, tokens: Tensor, positions: Tensor, start: int, mask: Tensor):
        """As EagerPasses.verify; acceptance runs inside the graph, the host reads greedy and path."""
        positions = positions.clone(memory_format=torch.contiguous_format)
        parent = torch.from_numpy(tree.parent).to(self.device)
        logits, feats, greedy, path = self.fns["verify"](tokens, positions, self._t(start), mask, parent)
        path = [int(i) for i in path.tolist() if i >= 0]
        return logits, feats, greedy.cpu().numpy(), path

    def draft(self, ctx_feats: Tensor, ctx_start: int, bonus: int, block_start: int) -> Tensor:
        return self.fns["draft"](*self._draft_args(ctx_feats, ctx_start, bonus, block_start))

    def draft_tree(self, ctx_feats: Tensor, ctx_tokens: Tensor, ctx_start: int, bonus: int, block_start: int,
                   budget: int, chain: bool):
        """EAGLE-3's tree (`Eagle3Pass.draft_tree`) over the fixed-shape context and depth graphs."""
        return self.graphs.draft_pass.draft_tree(ctx_feats, ctx_tokens, ctx_start, bonus, block_start, budget, chain,
                                                 self)

    def context(self, feats: Tensor, tokens: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """EAGLE-3's context rows [start, start + m) in chunks of C rows through the fixed-shape graph
        -> the last row's state [H] and log-probs [Vd]."""
        c, m = self.shapes.chunk, feats.shape[0]
        out = None
        for s in range(0, m, c):
            n = min(c, m - s)
            pos = start + s + torch.arange(n, device=self.device)
            out = self.fns["eagle3_context"](self._pad_rows(feats[s : s + n], c, 0),
                                             self._pad_rows(tokens[s : s + n], c, 0), self._pad_rows(pos, c, 0))
        return out

    def depth(self, ids: Tensor, states: Tensor, positions: Tensor, rows: Tensor, visible: Tensor):
        """One EAGLE-3 depth pass through the fixed-shape graph (one per row count k)."""
        return self.fns["eagle3_depth"](ids, states.contiguous(), positions, rows, visible)

    def _draft_args(self, ctx_feats: Tensor, ctx_start: int, bonus: int, block_start: int) -> tuple:
        """The draft graph's inputs (`_draft_context`)."""
        ctx, start = self._draft_context(ctx_feats, ctx_start)
        return ctx, self._t(start), self._t(bonus), self._t(block_start)

    def _draft_context(self, ctx_feats: Tensor, ctx_start: int) -> tuple[Tensor, int]:
        """Write all but the last 1..R pending context rows (a round's whole path) through the context
        graph, in chunks of C rows (the prompt's context); -> the rest padded to R rows [R, F], its start."""
        r, c = self.shapes.ctx_rows, self.shapes.chunk
        m = ctx_feats.shape[0]
        tail = (m - 1) % r + 1
        for s in range(0, m - tail, c):
            chunk = ctx_feats[s : min(s + c, m - tail)]
            self.fns["context"](self._pad_rows(chunk, c, 0), self._t(ctx_start + s))
        return self._pad_rows(ctx_feats[m - tail :], r, 0), ctx_start + m - tail

    def round(self, ctx_feats: Tensor, ctx_start: int, bonus: int, block_start: int, rope_delta: int, budget: int,
              chain: bool, lookup: tuple[int, list[int]]) -> "DeviceRound":
        """A drafted greedy round as one graph (`StaticGraphs.round`) and one device-to-host copy;
        `lookup` the host's prompt-lookup match (n, chain), cut as `build_tree` cuts it."""
        ctx, start = self._draft_context(ctx_feats, ctx_start)
        report, feats = self.fns["round"](ctx, round_args(start, bonus, block_start, rope_delta, self.shapes.block_size,
                                                          budget, chain, lookup, self.device), chain)
        return DeviceRound.read(report, feats)

    def lookup(self, bonus: int, block_start: int, rope_delta: int, chain: list[int]) -> "DeviceRound":
        """A lookup round (the tree root -> chain, `lookup_tree`) as one graph (`StaticGraphs.lookup`): one
        host-to-device copy (the bonus, the block's start, the M-RoPE shift, the chain), one back."""
        return DeviceRound.read(*self.fns["lookup"](self._t([bonus, block_start, rope_delta, *chain])))

    def step(self, bonus: int, block_start: int, rope_delta: int) -> "DeviceRound":
        """An autoregressive step as one graph (`StaticGraphs.step`): one host-to-device copy (the token, its
        row and M-RoPE shift), one device-to-host copy (the target's argmax and its entropy)."""
        report, feats = self.fns["step"](self._t([bonus, block_start, rope_delta]))
        token, ent = report.tolist()  # the step's one device-to-host copy
        return DeviceRound([0], [int(token)], feats, ent, ent)

    def commit(self, path: list[int], start: int, slot: int = 0) -> None:
        if path != list(range(len(path))):
            r = self.shapes.ctx_rows
            src = [start + i for i in path] + [start + i for i in range(len(path), r)]  # fixed R rows
            self.cache.move_rows(self._t(src), self._t(start), slot)

    def _slots(self, calls: list) -> int:
        """The batch bucket covering the calls' slots: graphs run slots 0..S-1 (free ones as padding)."""
        need = max(slot for slot, _ in calls) + 1
        bucket = next((b for b in self.shapes.batch_buckets if b >= need), None)
        if bucket is None:
            raise GlanceError(f"slot {need - 1} is past this decoder's batch buckets {self.shapes.batch_buckets}")
        return bucket

    def verify_batch(self, calls: list) -> list:
        """`EagerPasses.verify_batch` through the fixed-shape `verify_batch` graph of the batch bucket and the
        longest tree's rows T (one of the decoder's verify shapes): each tree padded to T rows (a padded row
        sees itself alone and writes a scratch row past its tree), free slots padded with rows of nothing."""
        if len(calls) == 1 and calls[0][0] == 0:
            return [self.verify(*calls[0][1])]
        slots, t, dev = self._slots(calls), max(args[1].shape[0] for _, args in calls), self.device
        tokens = torch.zeros(slots, t, dtype=torch.long, device=dev)
        lead = (3, 1) if self.graphs.verifier.mrope else (1,)
        positions = torch.zeros(*lead, slots, t, dtype=torch.long, device=dev)
        starts = torch.zeros(slots, dtype=torch.long, device=dev)
        masks = torch.eye(t, dtype=torch.bool, device=dev).repeat(slots, 1, 1)
        parents = torch.full((slots, t), -1, dtype=torch.long, device=dev)
        for slot, (tree, tok, pos, start, mask) in calls:
            n = tok.shape[0]
            tokens[slot, :n], starts[slot] = tok, start
            positions[..., slot, :] = self._pad_rows(pos, t, pos.dim() - 1)
            masks[slot, :n, :n] = mask
            parents[slot, :n] = torch.from_numpy(tree.parent).to(dev)
        logits, feats, greedy, paths = self.fns["verify_batch"](tokens, positions, starts, masks, parents)
        greedy, paths = greedy.cpu().numpy(), paths.tolist()
        out = []
        for slot, (_, tok, *_) in calls:
            n = tok.shape[0]
            out.append((logits[slot, :n], feats[slot, :n], greedy[slot, :n], [i for i in paths[slot] if i >= 0]))
        return out

    def draft_batch(self, calls: list) -> list:
        """`EagerPasses.draft_batch` through the fixed-shape `draft_batch` graph: each sequence's context
        rows but its last 1..R go through the drafter's context pass eagerly (after a prefill: the
        prompt's), the rest into the graph padded to R rows; free slots padded."""
        if len(calls) == 1 and calls[0][0] == 0:
            return [self.draft(*calls[0][1])]
        slots, r, dev = self._slots(calls), self.shapes.ctx_rows, self.device
        draft = self.graphs.draft_pass
        width = calls[0][1][0].shape[1]
        ctx = torch.zeros(slots, r, width, dtype=calls[0][1][0].dtype, device=dev)
        ctx_start, bonus = (torch.zeros(slots, dtype=torch.long, device=dev) for _ in range(2))
        block_start = torch.full((slots,), r, dtype=torch.long, device=dev)
        for slot, (feats, start, b, block) in calls:
            m = feats.shape[0]
            tail = (m - 1) % r + 1
            if m > tail:
                draft.context(feats[: m - tail], self._t(start), slot)
            ctx[slot] = self._pad_rows(feats[m - tail :], r, 0)
            ctx_start[slot], bonus[slot], block_start[slot] = start + m - tail, b, block
        logits = self.fns["draft_batch"](ctx, ctx_start, bonus, block_start)  # [S, B-1, V]
        return [logits[slot] for slot, _ in calls]


def compiled_fns(graphs: StaticGraphs, cuda_graphs: str = "trees") -> dict:
    """The round's graphs (verify, draft, context, and a drafted round or an autoregressive step whole: `round`,
    `step`) under torch.compile(fullgraph=True, dynamic=False): one compiled frame per graph and shape (a verify
    per tree-budget bucket; a round graph per drafted budget and the step graph, compiled only where a Decoder
    runs rounds on the device). On CUDA each replays as a CUDA graph: the caches are module buffers (static
    addresses), the small inputs are copied in. `cuda_graphs`: "trees" (torch.compile's "reduce-overhead":
    Dynamo's guards and the trees' bookkeeping run at every call) or "runner"
    (`glance_rt.round.graphs.GraphRunner`: guards run once, at capture; each call copies its inputs and launches
    one graph). The prompt's prefill runs once per prompt: it stays an eager exact-length pass (one GEMM over
    the whole prompt beats padded chunks that attend over every cache row; time to first token in
    docs/engines.md); engines, which have no eager model to fall back on, run it as chunks."""
    if cuda_graphs not in CUDA_GRAPHS:
        raise GlanceError(f"unknown cuda_graphs {cuda_graphs!r}: choose one of {', '.join(CUDA_GRAPHS)}")
    cuda = graphs.verifier.embed_tokens.weight.is_cuda
    mode = "reduce-overhead" if cuda and cuda_graphs == "trees" else None
    fns = {n: torch.compile(getattr(graphs, n), fullgraph=True, dynamic=False, mode=mode)
           for n in graph_names(graphs)}
    if cuda and cuda_graphs == "runner":
        fns = {n: GraphRunner(fn) for n, fn in fns.items()}
    return fns


def graph_names(graphs: StaticGraphs) -> tuple[str, ...]:
    """The StaticGraphs methods a decoder over `graphs` runs as fixed-shape graphs (the prompt's prefill
    aside: it runs eagerly, `compiled_fns`)."""
    names = (*GRAPHS[1:], "round", "lookup", "step") if graphs.draft_pass is not None else (*GRAPHS[1:2], "step")
    if isinstance(graphs.draft_pass, Eagle3Pass):  # EAGLE-3: its context and depth passes (the tree on the host)
        names = ("verify", *EAGLE3_GRAPHS)
    if graphs.verifier.cache.slots > 1:  # batched rounds: a graph per (slots, rows) bucket, compiled as they come
        names = (*names, "verify_batch", *(("draft_batch",) if graphs.draft_pass is not None else ()))
    return names


def static_shapes(graphs: StaticGraphs, chunk: int, exact_prefill: bool = False) -> StaticShapes:
    return StaticShapes(chunk, graphs.block_size, graphs.ctx_rows, exact_prefill,
                        batch_buckets(graphs.verifier.cache.slots))


def batch_buckets(slots: int) -> tuple[int, ...]:
    """The slot counts batched graphs are built for: powers of two below `slots`, and `slots`."""
    return tuple(sorted({*(2**i for i in range(slots.bit_length()) if 2**i < slots), slots}))


def verify_rows(budget: int, chain: bool, block_size: int) -> int:
    """Rows of the verify graph for a tree budget (the root included)."""
    return (min(budget, block_size - 1) if chain else budget) + 1


def example_inputs(graphs, shapes, budgets, chain: bool, rounds=(), lookups=()) -> dict:
    """name -> example args of every graph to build (what fixes its shapes); `rounds`: the budgets whose
    rounds run as one graph on the device (a drafted budget: its round graph; 0: the step graph); `lookups`:
    the chain lengths of lookup rounds run as one graph each."""
    v = graphs.verifier
    mrope = v.mrope
    dev, dtype = v.embed_tokens.weight.device, v.embed_tokens.weight.dtype
    hidden = v.embed_tokens.weight.shape[1]

    def zero():  # a fresh scalar per argument: an input passed twice would be exported as one
        return torch.tensor(0, device=dev)

    def pos(n: int):
        p = torch.arange(n, device=dev)[None]
        return p[None].expand(3, 1, n).contiguous() if mrope else p

    c, b, r = shapes.chunk, shapes.block_size, shapes.ctx_rows
    embeds = torch.zeros(1, c, hidden, dtype=dtype, device=dev)
    out = {"prefill": (embeds, pos(c), zero(), torch.tensor([c - 1], device=dev))}
    for budget in budgets:
        t = verify_rows(budget, chain, b)
        mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        parent = torch.arange(-1, t - 1, device=dev)
        out[f"verify-{t}"] = (torch.zeros(t, dtype=torch.long, device=dev), pos(t), zero(), mask, parent)
    if isinstance(graphs.draft_pass, Eagle3Pass):
        p = graphs.draft_pass
        feats = len(graphs.verifier.feature_layers) * hidden
        out["eagle3_context"] = (torch.zeros(c, feats, dtype=dtype, device=dev),
                                 torch.zeros(c, dtype=torch.long, device=dev), torch.arange(c, device=dev))
        for k in sorted({p.depth_rows(budget, chain) for budget in budgets if budget}):
            visible = torch.zeros(k, p.cache_rows, dtype=torch.bool, device=dev)
            visible[:, 0] = True
            out[f"eagle3_depth-{k}"] = (torch.zeros(k, dtype=torch.long, device=dev),
                                        torch.zeros(k, p.head.config.hidden_size, dtype=dtype, device=dev),
                                        torch.zeros(k, dtype=torch.long, device=dev), torch.arange(k, device=dev),
                                        visible)
    elif graphs.draft_pass is not None:
        feats = len(graphs.verifier.feature_layers) * hidden
        ctx = torch.zeros(r, feats, dtype=dtype, device=dev)
        out["draft"] = (ctx, zero(), zero(), torch.tensor(r, device=dev))
        out["context"] = (torch.zeros(c, feats, dtype=dtype, device=dev), zero())
        for budget in (b for b in rounds if b):
            out[f"round-{budget}"] = (ctx, round_args(0, 0, r, 0, b, budget, chain, (0, []), dev), chain)
        for n in lookups:
            out[f"lookup-{n}"] = (torch.tensor([0, r, 0, *range(n)], device=dev),)
    if 0 in rounds:  # autoregressive steps on the device
        out["step"] = (torch.zeros(3, dtype=torch.long, device=dev),)
    for slots in shapes.batch_buckets[1:]:  # batched rounds: a verify graph per (slots, rows), a draft per slots
        for budget in budgets:
            t = verify_rows(budget, chain, b)
            lead = (3, 1) if mrope else (1,)
            out[f"verify_batch-{slots}x{t}"] = (
                torch.zeros(slots, t, dtype=torch.long, device=dev),
                torch.zeros(*lead, slots, t, dtype=torch.long, device=dev),
                torch.zeros(slots, dtype=torch.long, device=dev),
                torch.eye(t, dtype=torch.bool, device=dev).repeat(slots, 1, 1),
                torch.full((slots, t), -1, dtype=torch.long, device=dev))
        if graphs.draft_pass is not None and not isinstance(graphs.draft_pass, Eagle3Pass):
            width = len(graphs.verifier.feature_layers) * hidden
            out[f"draft_batch-{slots}"] = (torch.zeros(slots, r, width, dtype=dtype, device=dev),
                                           torch.zeros(slots, dtype=torch.long, device=dev),
                                           torch.zeros(slots, dtype=torch.long, device=dev),
                                           torch.full((slots,), r, dtype=torch.long, device=dev))
    return out


# ----------------------------------------------------------------------------- building the passes


def round_modules(target, drafter, max_len: int, verify_rows: tuple[int, ...], kernels, fuse: bool | None = None,
                  exact: ExactNumerics | None = None, slots: int = 1, regions: bool = False):
    """The modules a round runs, over `target`'s weights: (TargetDecoder with a `max_len`-row cache,
    the draft pass or None). A `GlanceDrafter` becomes a `DraftPass` (shared embeddings and lm_head);
    other drafter objects (the eager protocol) are used as they are. `kernels`: None (the plain
    weights: engines trace these), True (oneDNN-prepacked everywhere) or a `KernelTuner` (each
    linear's kernel measured at the verify rows `verify_rows`, the draft block and prefill, then each
    pass checked whole against the plain one: `glance_rt.round.passcheck`). `fuse`: the plain
    weights' q, k, v and gate, up as one GEMM each (`TargetDecoder`); None: on a GPU, where a small
    GEMM costs a launch (the CPU's kernels are chosen by timing instead). `exact`: exact numerics
    in the verifier's decode passes (`glance_rt.models.exact`). `slots`: sequences the caches hold at once
    (`glance_rt.round.batch`). `regions`: the verifier's layers as compile regions (`TargetDecoder`)."""
    if isinstance(drafter, GlanceDrafter):
        check_compatible(drafter.config, target)
    if isinstance(drafter, Eagle3Drafter):
        check_target(drafter.head.config, target)
    layers = tuple(drafter.target_layer_ids) if drafter is not None else ()
    block = drafter.config.block_size if isinstance(drafter, GlanceDrafter) else getattr(drafter, "top_k", 1)
    # exact numerics: the verifier's kernels timed at the block's rows (and prefill's), laid out for the block,
    # not pass-checked: nothing a decoder's budgets or drafter change, so a GLANCE decoder and its AR run the
    # same kernels, prefill included (the same engine), and commit the same tokens
    rows = verify_rows if exact is None else (exact.rows,)
    plans = kernel_plans(kernels, rows, block, target.layouts)  # (an EAGLE-3 depth pass runs top_k rows)
    verify_plan, draft_plan = checked_plans(target, drafter, plans, layers, check_verify=exact is None)
    if isinstance(drafter, GlanceDrafter):
        drafter = DraftPass(drafter, target.parts.text_model.embed_tokens, target.parts.lm_head, max_len,
                            plan=draft_plan, slots=slots)
    elif isinstance(drafter, Eagle3Drafter):
        drafter = Eagle3Pass(drafter, target.parts.text_model.embed_tokens, max_len, plan=draft_plan)
    if fuse is None:
        fuse = target.parts.lm_head.weight.is_cuda
    verifier = TargetDecoder(target.parts, max_len, layers, plan=verify_plan, fuse=fuse and verify_plan is None,
                             exact=exact, slots=slots, regions=regions)
    return verifier, drafter


def kernel_plans(kernels, verify_rows: tuple[int, ...], block: int, layouts: dict | None = None) -> tuple:
    """(verifier's KernelPlan, draft pass's) for `round_modules`' `kernels`; (None, None): plain.
    `layouts`: the prepared weights to share (`Target.layouts`)."""
    if kernels is None:
        return None, None
    tuner = None if kernels is True else kernels
    layouts = {} if layouts is None else layouts
    verify = KernelPlan(max(verify_rows), (*verify_rows, PREFILL_ROWS), tuner, layouts=layouts)
    return verify, KernelPlan(block, (block, PREFILL_ROWS), tuner, layouts=layouts)


def static_graphs(target, drafter, max_len: int, exact: ExactNumerics | None = None, slots: int = 1) -> StaticGraphs:
    """The fixed-shape graphs of `target` (+ a GlanceDrafter or an EAGLE-3 head) over the plain weights:
    what engine builders trace (`exact`: the decode passes in exact numerics, static form; `slots`: the
    sequences the caches hold, with the batched graphs)."""
    return StaticGraphs(*round_modules(target, drafter, max_len, (1,), None, exact=exact, slots=slots))


@dataclass(frozen=True)
class Backend:
    """How a Decoder's passes run. `passes(verifier, draft)` builds them; `prefill_inputs(target)`
    (None: the target's own) turns a request's inputs into the prompt's embeddings (an engine may
    bring vision graphs); `prepack` False: the passes run the plain weights (engines); `fuse`: the
    plain weights' q, k, v and gate, up run as one GEMM each (None: on a GPU; `round_modules`); `regions`: the
    verifier's layers as nested compile regions (torch.compile's backend: `TargetDecoder`)."""

    name: str
    passes: Callable
    prefill_inputs: Callable | None = None
    prepack: bool = True
    fuse: bool | None = None
    regions: bool = False


def static_passes(make_fns: Callable, chunk: int, exact_prefill: bool = False) -> Callable:
    """A passes factory: fixed-shape passes whose graphs `make_fns(graphs)` runs (compiled, or loaded
    from an engine). `exact_prefill`: the prefill graph takes the whole prompt at its length."""
    if chunk < 1:
        raise GlanceError(f"chunk must be at least 1, got {chunk}")

    def build(verifier: TargetDecoder, draft) -> StaticPasses:
        if draft is not None and not isinstance(draft, (DraftPass, Eagle3Pass)):
            raise GlanceError("compiled and engine backends run a GlanceDrafter (glance_rt.load_drafter); "
                              "use backend='eager' for other drafter objects")
        graphs = StaticGraphs(verifier, draft)
        return StaticPasses(graphs, make_fns(graphs), static_shapes(graphs, chunk, exact_prefill))

    return build


def by_rows(graphs: dict, kind: str = "verify", dims: int = 1):
    """One callable over per-bucket graphs (bucket -> graph): picks the graph for its first input's rows
    (verify's tokens [T], an EAGLE-3 depth pass's ids [k]; `dims` 2: a batched verify's tokens [S, T], its
    bucket (S, T))."""

    def run(tokens, *rest):
        bucket = tokens.shape[0] if dims == 1 else tuple(tokens.shape[:dims])
        graph = graphs.get(bucket)
        if graph is None:
            raise GlanceError(f"this engine has {kind} graphs for {sorted(graphs)}, not {bucket}: use one of its "
                              "tree budgets (and batch buckets) or rebuild with --tree-budget (--max-batch)")
        return graph(tokens, *rest)

    run.buckets = graphs  # bucket -> graph, for a reader (tests: which sessions an engine's buckets share)
    return run


BACKENDS = ("eager", "compile")
CUDA_GRAPHS = ("trees", "runner")  # how compiled passes replay on CUDA (compiled_fns)


def named_backend(name: str, chunk: int = 64, cuda_graphs: str = "trees") -> Backend:
    """The built-in backends: "eager" (the reference) and "compile" (torch.compile; `cuda_graphs`: how
    its passes replay on CUDA, `compiled_fns`)."""
    if name == "eager":
        return Backend("eager", EagerPasses)
    if name == "compile":
        return Backend("compile", static_passes(functools.partial(compiled_fns, cuda_graphs=cuda_graphs), chunk),
                       regions=True)
    raise GlanceError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)} "
                      "(built engines load with Decoder.from_engine)")
