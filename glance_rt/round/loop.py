"""The round loop: prefill, then per round draft -> tree -> verify -> accept/commit.

`Decoder(target, drafter=None)` is plain autoregression through the same verify pass (a tree of
one row). Output tokens are exactly the target's greedy tokens; with `sampling=Sampling(do_sample=True,
...)` exactly the tokens the same engine's autoregressive sampling gives with the same seed
(`glance_rt.round.sample`).
"""

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from glance_rt.engines.engine import load_engine
from glance_rt.errors import GlanceError
from glance_rt.method import (
    DEFAULT_LOOKUP,
    DEFAULT_MAX_LENGTH,
    DEFAULT_TREE_BUDGET,
    Method,
    check_numerics,
    default_backend,
)
from glance_rt.models.eagle3 import Eagle3Drafter
from glance_rt.models.exact import ExactNumerics
from glance_rt.models.kernels import KernelTuner, kernel_summary
from glance_rt.models.linear import can_pack
from glance_rt.round.adaptive import AdaptiveBudget
from glance_rt.round.commit import apply_stops, committed_tokens, entropies
from glance_rt.round.draft import DraftPass
from glance_rt.round.eagle3 import Eagle3Pass
from glance_rt.round.gate import DraftGate, GateConfig
from glance_rt.round.sample import GREEDY, Chooser, Sampling, stop_criteria, walk
from glance_rt.round.tree import (
    MAX_TREE_BUDGET,
    build_tree,
    check_budget,
    check_lookup_budget,
    default_lookup_budget,
    fills_budget,
    grafts_lookup,
    lookup_match,
    lookup_tree,
    max_depth,
    with_lookup_bucket,
)
from glance_rt.round.verify import Backend, named_backend, round_modules, text_positions

PHASES = ("prefill", "draft", "tree", "verify", "round", "commit")  # round: a drafted round on the device


@dataclass
class Stats:
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed per round (incl. bonus)
    root_entropy: list[float] = field(default_factory=list)  # target's next-token entropy at each round's root
    prior_entropy: list[float] = field(default_factory=list)  # entropy known before each round (row that made the root)
    budgets: list[int] = field(default_factory=list)  # tree budget used in each round (0: an autoregressive step)
    round_seconds: list[float] = field(default_factory=list)  # wall time of each round
    draft_passes: int = 0
    lookup_rounds: int = 0  # tree rounds whose prompt-lookup chain filled the budget (no draft pass)
    rounds: int = 0
    prompt_tokens: int = 0
    timings: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per round, autoregressive steps included."""
        return sum(self.accepted_lengths) / max(len(self.accepted_lengths), 1)

    @property
    def drafted(self) -> list[int]:
        """The indices of the tree rounds, drafted or looked up (of every round where none had a tree:
        autoregression)."""
        return [i for i, b in enumerate(self.budgets) if b > 0 or not (self.draft_passes or self.lookup_rounds)]

    @property
    def tau(self) -> float:
        """Tokens committed per tree round (per round where none had a tree): what drafter and lookup achieve."""
        lengths = [self.accepted_lengths[i] for i in self.drafted]
        return sum(lengths) / max(len(lengths), 1)


@dataclass(frozen=True)
class Call:
    """A pass a sequence asks for (`Decoder.sequence`): the passes' method `name` with `args`."""

    name: str  # prefill, draft, verify, commit, draft_tree or round
    args: tuple


@dataclass
class GenerateResult:
    token_ids: list[int]
    text: str | None
    stats: Stats


def entropy(logits: Tensor) -> float:
    """Entropy (nats) of softmax(logits) [V]."""
    return float(entropies(logits[None])[0])


class _Clock:
    """Per-phase wall time. On a GPU each lap first waits for the device, so a pass's time is charged to
    its phase, not to the next one that reads a result back."""

    def __init__(self, timings: dict, device: torch.device):
        self.timings, self.t = timings, time.perf_counter()
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None

    def lap(self, phase: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.timings[phase] += now - self.t
        self.t = now


class Decoder:
    """Lossless speculative decoding of `target` with `drafter` (a GlanceDrafter, None for
    autoregression, or any object with `block_size`, `target_layer_ids` and a
    `__call__(ctx_feats [m, F], ctx_start, bonus, block_start) -> draft logits [B-1, V]`).

    The defaults are `glance-rt generate`'s (`glance_rt.method.Method()`): a tree of
    `tree_budget` draft nodes per round with a prompt-lookup chain grafted in, eager passes.

    `tree_budget` is the number of draft nodes verified per round (N; None: `DEFAULT_TREE_BUDGET`
    for trees), or an `AdaptiveBudget` that picks one of a few fixed buckets per round from the
    entropy law; `chain=True` verifies the width-1 tree (the top-1 draft at every depth,
    DFlash-style) of min(N, B-1) nodes, where None drafts what the drafter's own runtime draws: the
    whole block, B-1. `max_length` sizes the static
    caches: prompt + max_new_tokens + one round's scratch must fit (`glance_rt.method.job_max_length`
    sizes it to a job).

    `lookup` > 0 grafts a prompt-lookup chain into every tree: the tokens that followed the latest
    earlier occurrence of the context's last n-gram (n <= lookup), in the prompt or the output so far
    (at most `max_depth` = 2B-1 tokens, and a share of the budget that grows with the match's length:
    `glance_rt.round.tree`'s `lookup_rows` and `prompt_lookup`). A round whose chain fills the whole
    budget (a match of 5 or more tokens) runs no draft pass: its tree is the chain, whatever the
    drafter would say (`Stats.lookup_rounds`), and it verifies `lookup_budget` rows of it where that
    is more than the tree's (one more verify shape; None: `DEFAULT_LOOKUP_BUDGET` within `max_depth`).
    0: the drafter alone; None (default): `DEFAULT_LOOKUP` on a drafter's trees, 0 for chains and
    autoregression.

    `backend` says how the passes run (None: `default_backend` of the target's device, compile on
    CUDA and eager on a CPU): "eager" (exact lengths, the reference), "compile" (the round's
    fixed-shape passes, `glance_rt.round.verify.StaticGraphs`, under `torch.compile(fullgraph=True)`,
    with CUDA graphs on a GPU; the prompt's prefill eagerly; `chunk` rows per drafter-context pass),
    or a `Backend` (an engine's: `Decoder.from_engine(DIR)`). Static passes attend over all
    `max_length` cache rows, so size it to the job. `warmup()` compiles every graph up front.

    `gate` decides per round whether to draft at all or take one autoregressive step (a one-row
    verify pass, no draft pass), whichever the entropy law and the round costs measured on this
    machine predict is faster (`glance_rt.round.gate`; the output is the same either way): None
    (default) on wherever the passes can run one row (engines: built with `--tree-budget 0`), True
    or a `GateConfig` on (an error where it cannot run), False: draft every round.

    `prepack` chooses the kernel of each linear layer (fp32 weights on a CPU with oneDNN, eager and
    compiled alike; engines run the weights they were built from): "auto" (default) times torch's
    own linear against oneDNN's prepacked copy for each weight shape at the round's row counts and
    keeps the faster (`glance_rt.models.kernels`: timings cached per machine, paid once); True:
    oneDNN everywhere; False: torch's own everywhere; or a `KernelTuner` (its timer and cache).
    `kernel_choices` says what was chosen.

    `device_round` runs each greedy round as one graph with one device-to-host copy, the committed
    tokens: a drafted round (`StaticGraphs.round`: the draft pass, the tree built on the device with
    static shapes (`glance_rt.round.device_tree`, `build_tree`'s arrays bit for bit), verify, acceptance
    and the compaction) and an autoregressive step (`StaticGraphs.step`: the one-row verify, its argmax
    and entropy; one copy in), the gate's and a decoder's without a drafter. On a GPU the host tree, its
    uploads and the syncs between the passes cost 0.7 ms a round at a 3B's shapes (the first H200 run:
    round 7.10 ms against draft 0.68 + verify 5.72). None (default): on for the compile backend on a
    CUDA device; True: also on a CPU (the tests); False: from the host. Prompt lookup still matches on
    the host, and lookup rounds and sampled rounds run from the host as before.

    `numerics`: "fast" (default) or "exact": every decode pass (autoregressive steps and verify passes)
    computes each row bit for bit as a one-row step does (`glance_rt.models.exact`: linear layers as
    GEMMs of a fixed row count, attention row by row over each row's own visible cache rows), so the
    tokens equal this engine's own autoregressive tokens in every dtype (bf16 and fp16 included), not
    only up to near ties. Eager and compiled passes (a built engine's graphs are refused).

    `max_batch`: sequences the caches hold at once (one slot each, `max_length` rows a slot), decoded
    together by a `glance_rt.round.batch.Batch` (one draft pass and one verify pass a round for all of
    them; eager or compile backend, a GLANCE drafter or none; compiled: a graph per (slots, rows) bucket,
    `warmup` compiles them all). `generate`, `rounds` and `stream` use slot 0.

    `prefill_chunk`: prefill the prompt in pieces of that many rows (None: one pass), each attending the
    pieces before it. Alone the pieces run back to back; in a `Batch` a joining sequence's pieces are
    spread over the steps (`prefill_chunk` prompt rows a step while others decode), so a long prompt
    joining does not stall the running sequences for its whole prefill. A sequence's tokens are the same
    alone and batched at the same setting (the same pieces).
    """

    def __init__(self, target, drafter=None, tree_budget: "int | AdaptiveBudget | None" = None, chain: bool = False,
                 max_length: int = DEFAULT_MAX_LENGTH, backend: "str | Backend | None" = None, chunk: int = 64,
                 lookup: int | None = None, prepack: "bool | str | KernelTuner" = "auto",
                 gate: "bool | GateConfig | None" = None, lookup_budget: int | None = None,
                 device_round: bool | None = None, numerics: str = "fast", max_batch: int = 1,
                 prefill_chunk: int | None = None):
        self.numerics = check_numerics(numerics)
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise GlanceError(f"prefill_chunk must be an int >= 1 (prompt rows per prefill piece) or None, "
                              f"got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        if not isinstance(max_batch, int) or max_batch < 1:
            raise GlanceError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.max_batch = max_batch
        self.policy = tree_budget if isinstance(tree_budget, AdaptiveBudget) else None
        if self.policy is not None:
            if chain:
                raise GlanceError("an adaptive budget chooses among trees: it cannot be combined with chain=True")
            for b in self.policy.buckets:
                check_budget(b.budget)
            tree_budget = self.policy.max_budget
        if tree_budget is None:  # a chain: the drafter's whole block (below)
            tree_budget = MAX_TREE_BUDGET if chain else DEFAULT_TREE_BUDGET
        check_budget(tree_budget)
        if max_length < 2:
            raise GlanceError(f"max_length must be at least 2, got {max_length}")
        if backend is None:
            backend = default_backend(target.device)
        self.backend = backend if isinstance(backend, Backend) else named_backend(backend, chunk)
        if numerics == "exact" and not isinstance(backend, Backend) and self.backend.name not in ("eager", "compile"):
            raise GlanceError(f"numerics='exact' runs eager or compiled passes, or an engine built with --exact; "
                              f"backend {self.backend.name!r} asked")
        if lookup is None:
            lookup = DEFAULT_LOOKUP if grafts_lookup(drafter, chain) else 0
        if lookup < 0 or (lookup and not grafts_lookup(drafter, chain)):
            raise GlanceError(f"lookup={lookup}: prompt lookup takes an n-gram size >= 1 and grafts onto a "
                              "GLANCE drafter's tree (not a chain, autoregression or an EAGLE-3 head's own tree); "
                              "use lookup=0 there")
        self.lookup = lookup
        # one tuner times the kernels and probes exact numerics' row invariance (bf16, fp16 weights too, which
        # are not prepacked); prepack=True or False: none (exact numerics then keep padded blocks)
        tuner = prepack if isinstance(prepack, KernelTuner) else KernelTuner() if prepack == "auto" else None
        kernels = self._kernels(prepack, self.backend.prepack and can_pack(target.parts.lm_head.weight), tuner)
        self.prepack = kernels is not None  # the kernels are chosen per layer (False: the plain weights)
        self.plain = prepack is False  # asked for the plain weights (`@plain`), not just left with them
        self.target, self.chain, self.max_length = target, chain, max_length
        if drafter is None:
            self.policy = None
        block = drafter.block_size if drafter is not None else 1
        self.tree_budget = 0 if drafter is None else min(tree_budget, block - 1) if chain else tree_budget
        self.gate = None
        if drafter is not None and gate is not False:
            self.gate = DraftGate(gate if isinstance(gate, GateConfig) else GateConfig())
        self.block = block
        self.lookup_budget = self._lookup_budget(lookup_budget)
        self.pending_rows = max_depth(block) + 1  # drafter-context rows a skipped draft may leave pending
        verify_rows = tuple(b + 1 for b in self.budgets)
        exact = ExactNumerics(static=self.backend.name != "eager", tuner=tuner) if numerics == "exact" else None
        self.verifier, self.drafter = round_modules(target, drafter, max_length, verify_rows, kernels,
                                                    self.backend.fuse, exact, max_batch, self.backend.regions)
        self.grows_tree = isinstance(self.drafter, Eagle3Pass)  # its own tree (EAGLE-3), else build_tree's
        self.copies = getattr(self.drafter, "copies", False)  # a copy head: draft calls carry the context's tokens
        vocab = getattr(self.drafter, "draft_vocab", None)  # draft-logit column -> token id, or None
        self.draft_vocab = None if vocab is None else vocab.cpu().numpy()
        self.mrope = self.verifier.mrope
        self.eos_ids = frozenset(target.eos_token_ids)
        self.passes = self.backend.passes(self.verifier, self.drafter)
        if max_batch > 1 and not (isinstance(self.drafter, (DraftPass, type(None))) and self.passes.batches):
            raise GlanceError(f"max_batch={max_batch}: batched rounds run the eager or compile backend, or an "
                              "engine built with --max-batch, over a GLANCE drafter or none (other engines, EAGLE-3 "
                              "heads and other drafter objects decode one sequence at a time: use max_batch=1)")
        self.device_round = self._device_round(device_round)
        make_inputs = self.backend.prefill_inputs
        self.prefill_inputs = target.prefill_inputs if make_inputs is None else make_inputs(target)

    @classmethod
    def from_engine(cls, path, target=None, drafter=None, tree_budget=None, lookup: int | None = None,
                    gate: "bool | GateConfig | None" = None, lookup_budget: int | None = None,
                    numerics: str | None = None, max_batch: int | None = None,
                    prefill_chunk: int | None = None) -> "Decoder":
        """A Decoder that runs the engine built in `path` (`glance-rt build-engine`). `target` and
        `drafter` default to the ones the engine was built from (any other must match its manifest);
        `tree_budget` defaults to its largest budget bucket, or pass an int or AdaptiveBudget over its
        buckets; `lookup` as in `Decoder` (a host-side choice of tree rows: any engine runs it);
        `gate` as in `Decoder` (it needs the one-row verify graph of `--tree-budget 0`); `lookup_budget`
        as in `Decoder` where the engine has that budget bucket (None: the default where it has it, else
        the tree's budget). The engine's manifest says its numerics (`build-engine --exact`) and its
        batch (`--max-batch`); `numerics` and `max_batch`, if given, must be them."""
        return load_engine(cls, path, target, drafter, tree_budget, lookup, gate, lookup_budget, numerics, max_batch,
                           prefill_chunk)

    @classmethod
    def from_method(cls, method: Method, target, drafter=None, max_length: int | None = None,
                    policy=None, max_batch: int | None = None, prefill_chunk: int | None = None) -> "Decoder":
        """The Decoder that runs `method` (`glance_rt.method.Method`) for `target` (+ `drafter`;
        None decodes autoregressively). `max_length`: static cache rows (None: `DEFAULT_MAX_LENGTH`;
        an engine has its own). `policy`: the calibrated AdaptiveBudget of an "adaptive" method.
        `max_batch`: as in `Decoder` (None: 1; an engine's own); `prefill_chunk` as in `Decoder`."""
        drafter = None if method.kind == "ar" else drafter
        eagle3 = isinstance(drafter, Eagle3Drafter)
        if method.kind == "eagle3" and drafter is not None and not eagle3:
            raise GlanceError(f"method {method.name} needs an EAGLE-3 head (glance_rt.load_eagle3; bench: "
                              "--eagle3 PATH)")
        if method.kind in ("tree", "adaptive") and eagle3:  # (a chain is either drafter's)
            raise GlanceError(f"method {method.name} needs a GLANCE drafter, not an EAGLE-3 head (its trees: "
                              f"eagle3-{method.tree_budget})")
        if method.engine is not None:
            return cls.from_engine(method.engine, target, drafter, tree_budget=method.tree_budget, lookup=method.lookup,
                                   gate=None if method.gate else False, lookup_budget=method.lookup_budget,
                                   numerics=method.numerics, max_batch=max_batch, prefill_chunk=prefill_chunk)
        if method.kind == "adaptive" and policy is None:
            raise GlanceError("an adaptive method needs its calibrated AdaptiveBudget (glance_rt.round.adaptive)")
        plain = method.backend == "plain"  # eager with the HF modules' own linear layers
        return cls(target, drafter, tree_budget=policy if method.kind == "adaptive" else method.tree_budget,
                   chain=method.kind == "chain", lookup=method.lookup, max_length=max_length or DEFAULT_MAX_LENGTH,
                   backend="eager" if plain else method.backend, prepack=False if plain else "auto",
                   gate=None if method.gate else False, lookup_budget=method.lookup_budget, numerics=method.numerics,
                   max_batch=max_batch or 1, prefill_chunk=prefill_chunk)

    @staticmethod
    def _kernels(prepack, packable: bool, tuner):
        """`round_modules`' kernels argument for a `prepack` setting (None: the plain weights; `tuner`: the
        one "auto" or a given tuner means)."""
        if prepack is False:
            return None
        if prepack is True:
            if not packable:
                raise GlanceError("prepack=True needs fp32 weights on a CPU with oneDNN (mkldnn) and the eager or "
                                  "compile backend; use prepack='auto' to choose kernels wherever that applies")
            return True
        if prepack == "auto" or isinstance(prepack, KernelTuner):
            return tuner if packable else None
        raise GlanceError(f"prepack={prepack!r}: use 'auto' (measure the kernels), True (oneDNN) or False (plain)")

    @property
    def cache_bytes(self) -> int:
        """Bytes of this decoder's static caches (the target's and the drafter's KV, every slot): with the
        weights shared (`Target.layouts`), what a second Decoder on the same target costs."""
        from glance_rt.models.kv_cache import KVCache

        caches = [m for part in (self.verifier, self.drafter) if isinstance(part, torch.nn.Module)
                  for m in part.modules() if isinstance(m, KVCache)]
        return sum(b.numel() * b.element_size() for c in caches for b in c.buffers())

    @property
    def kernel_choices(self) -> dict:
        """{"verify": {"OUTxIN": {rows: kernel}}, "draft": {...}}: the kernel each linear layer's shape
        runs at each row class ("mkl": torch's own linear, "onednn": prepacked); {} on plain weights."""
        out = {}
        for name, module in (("verify", self.verifier), ("draft", self.drafter)):
            if self.prepack and hasattr(module, "kernel_modules"):  # a TargetDecoder or a DraftPass
                out[name] = kernel_summary(module.kernel_modules())
        return out

    @property
    def method_name(self) -> str:
        """What this decoder runs, in `Method.parse`'s words (`tree-8+lookup@compile`); an engine's
        backend is named after the `@` (`tree-8+lookup@aoti`), unless it is the device's default."""
        base = "ar" if self.drafter is None else "chain" if self.chain else f"tree-{self.tree_budget}"
        if self.grows_tree:  # EAGLE-3 (no method name parses to it yet)
            base = f"eagle3-{'chain' if self.chain else self.tree_budget}"
        if self.policy is not None:
            base = "adaptive"
        if self.lookup:
            default = self.lookup_budget == default_lookup_budget(self.block)
            base += "+lookup" if default else f"+lookup-{self.lookup_budget}"
        base += "+always" if self.drafter is not None and self.gate is None else ""
        base += "+exact" if self.numerics == "exact" else ""
        backend = "plain" if self.backend.name == "eager" and self.plain else self.backend.name
        return base if backend == default_backend(self.target.device) else f"{base}@{backend}"

    def _device_round(self, asked: bool | None) -> bool:
        """Whether greedy rounds run as one graph each on the device (drafted rounds: `StaticPasses.round`;
        lookup rounds: `StaticPasses.lookup`; autoregressive steps: `StaticPasses.step`): asked True, or None
        on a CUDA device whose passes have the graphs (compile)."""
        # a drafter's rounds (drafted, lookup) and the gate's steps; an AR decoder's steps
        graphs = ("has_round", "has_lookup", "has_step") if self.drafter is not None else ("has_step",)
        able = all(getattr(self.passes, g, False) for g in graphs) and self.max_batch == 1
        if asked and not able:
            raise GlanceError("device_round=True runs each round as one compiled graph: it needs the compile "
                              "backend, max_batch=1 and a GLANCE drafter or none (engines, eager passes, EAGLE-3 "
                              "heads and batched rounds run their rounds' steps from the host)")
        return able and (asked if asked is not None else self.target.device.type == "cuda")

    def _device_budgets(self) -> list[int]:
        """The budgets whose rounds run as one graph on the device: the drafted ones, and 0 (the autoregressive
        steps) where this decoder takes any; [] without device rounds."""
        if not self.device_round:
            return []
        return [b for b in self.budgets if b == 0 or b in self.drafted_budgets]

    def _device_lookups(self) -> list[int]:
        """The chain lengths of this decoder's lookup rounds, each one graph on the device ([] without device
        rounds or lookup): a drafted budget b where the chain is exactly b long, else max(b, lookup_budget)
        (`sequence`), for each b that a chain can fill (`fills_budget`: b <= max_depth)."""
        if not (self.device_round and self.lookup):
            return []
        fillable = [b for b in self.drafted_budgets if b <= max_depth(self.block)]
        return sorted({*fillable, *(max(b, self.lookup_budget) for b in fillable)})

    def _lookup_budget(self, rows: int | None) -> int:
        """The rows a lookup round verifies (0: no lookup rounds)."""
        if not self.lookup:
            if rows is not None:
                raise GlanceError("lookup_budget sizes prompt-lookup rounds: it needs lookup > 0")
            return 0
        return default_lookup_budget(self.block) if rows is None else check_lookup_budget(rows, self.block)

    @property
    def drafted_budgets(self) -> list[int]:
        """The tree budgets of this decoder's drafted rounds."""
        return [b.budget for b in self.policy.buckets] if self.policy is not None else [self.tree_budget]

    @property
    def budgets(self) -> list[int]:
        """The tree budgets this decoder's rounds may use (one verify shape each; 0: the gate's
        autoregressive steps; a lookup round's rows where they exceed the smallest tree's)."""
        drafted = with_lookup_bucket(self.drafted_budgets, self.lookup_budget)
        return [0, *drafted] if self.gate is not None else drafted

    def warmup(self, prompt: str = "Hello") -> "Decoder":
        """Pay the one-time costs now, not in the first request: compile (or load) every graph at
        every budget bucket, so an adaptive budget never compiles mid-request, then run one short
        generation (first-call kernel set-up on every path of the round)."""
        self.passes.warmup(self.budgets, self.chain, self._device_budgets(), self._device_lookups())
        block = self.drafter.block_size if self.drafter is not None else 1
        self.generate(max_new_tokens=2 * block + 1, **self.target.encode_chat(prompt))
        return self

    def _scratch_rows(self) -> int:
        """Rows past the committed ones a round may write: its tree, the draft block, and (static
        passes) a padded path of max_depth + 1 rows."""
        if self.drafter is None:
            return self.tree_budget + 1
        return max(self.tree_budget + 1, max_depth(self.drafter.block_size) + 1)

    # ------------------------------------------------------------------ the loop

    @torch.inference_mode()
    def rounds(self, max_new_tokens: int, stats: Stats, sampling: Sampling = GREEDY, **inputs):
        """Yield the committed tokens of each round (after stop rules)."""
        seq = self.sequence(max_new_tokens, stats, sampling, inputs, self.gate)
        try:
            out = None
            while True:
                try:
                    item = seq.send(out)
                except StopIteration:
                    return
                if type(item) is Call:  # a pass: run it now (a Batch runs several sequences' together)
                    out = getattr(self.passes, item.name)(*item.args)
                else:
                    out = None
                    yield item
        finally:
            seq.close()

    def sequence(self, max_new_tokens: int, stats: Stats, sampling: Sampling, inputs: dict, gate: DraftGate | None,
                 cost=time.perf_counter):
        """One sequence's decoding as a coroutine: it yields a `Call` for every pass it needs (and is sent
        the pass's result) and a list of the committed tokens after each round (after stop rules).
        `rounds` runs the calls one by one; `glance_rt.round.batch.Batch` runs several sequences' draft
        and verify calls as one pass each. `gate`: this sequence's DraftGate (None: draft every round);
        `cost()`: the seconds this sequence has cost so far, which the gate weighs its rounds by (wall
        time alone; a batch's share of each batched pass)."""
        if max_new_tokens < 1:
            raise GlanceError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if not isinstance(sampling, Sampling):
            raise GlanceError(f"sampling must be a glance_rt.Sampling, not {type(sampling).__name__}")
        clock = _Clock(stats.timings, self.target.device)
        chooser = None if sampling.greedy_only else Chooser(sampling)  # None: the raw argmax, decided in-graph
        stop_strings = stop_criteria(sampling, self.target.tokenizer)
        ids = inputs.get("input_ids")
        ids = torch.zeros(0, dtype=torch.long) if ids is None else ids.reshape(-1).cpu()  # prompt, then committed
        if chooser is not None and ids.numel() == 0:
            raise GlanceError("sampling and repetition_penalty need the prompt's input_ids: pass them to generate")
        pre = self.prefill_inputs(inputs)  # embeds [P, H], positions [P] or [3, P]
        p = pre.embeds.shape[0]
        stats.prompt_tokens = p
        need = max(p + max_new_tokens + self._scratch_rows(), self.passes.rows_needed(p, self.prefill_chunk))
        if need > self.max_length:
            raise GlanceError(
                f"prompt ({p} tokens) + max_new_tokens ({max_new_tokens}) + one round's scratch "
                f"({self._scratch_rows()}) = {need} rows exceeds the static cache (max_length={self.max_length}); "
                "pass a larger max_length to Decoder or shorten the prompt / max_new_tokens"
            )
        dev = self.target.device
        positions = pre.positions[:, None] if self.mrope else pre.positions[None]  # [3, 1, P] or [1, P]
        embeds, positions, feats = pre.embeds[None].to(self.target.dtype), positions.to(dev), []
        piece = self.prefill_chunk or max(p, 1)  # the prompt in one pass, or in pieces of prefill_chunk rows
        for s in range(0, p, piece):
            logits, f = yield Call("prefill", (embeds[:, s : s + piece], positions[..., s : s + piece], s))
            feats.append(f)  # [piece, F]
        feats = feats[0] if len(feats) == 1 else torch.cat(feats)  # [P, F]; logits [V]: the last row's
        first = int(logits.argmax()) if chooser is None else chooser.choose(logits, ids, ids.numel())
        prior = entropy(logits)
        clock.lap("prefill")
        kept, done = apply_stops([first], 0, max_new_tokens, self.eos_ids, stop_strings, ids)
        produced = len(kept)
        ids = torch.cat([ids, torch.tensor(kept, dtype=torch.long)])
        yield kept
        n, bonus, ctx_feats, ctx_start = p + 1, first, feats, 0
        if gate is not None:
            gate.start()
        while not done:
            round_start = cost()
            block_start = n - 1
            budget = self.tree_budget if self.policy is None else self.policy.choose(prior)
            # the lookup chain over prompt + committed tokens, and the size of the n-gram it matched
            rows = max(budget, self.lookup_budget)  # a lookup round's verify rows
            ngram, chain = lookup_match(ids.numpy(), self.lookup, rows) if self.lookup else (0, [])
            # the round's kind: a lookup chain that fills the budget needs no draft pass (the tree is
            # the chain whatever the drafter says); else draft, unless the gate takes one AR step.
            # (lookup > 0 only on a drafter's trees: chains and autoregression never match)
            looked_up = fills_budget(self.block, budget, (ngram, chain))
            drafted = self.drafter is not None and not looked_up
            if drafted and gate is not None:  # a round drafts once pending_rows context rows wait
                drafted = gate.draft(prior, ngram, must=ctx_feats.shape[0] >= self.pending_rows)
            if looked_up and len(chain) > budget:  # the whole chain: `rows` of it where it runs past the budget
                budget = rows
            on_device = self.device_round and chooser is None
            if on_device:  # one graph, one copy in and one back: a drafted round (draft, tree, verify,
                # acceptance and compaction), a lookup round (the chain's verify and acceptance) or an
                # autoregressive step (a one-row verify)
                if looked_up:
                    result = yield Call("lookup", (bonus, block_start, pre.rope_delta, chain[:budget]))
                    stats.lookup_rounds += 1
                elif drafted:
                    result = yield Call("round", (ctx_feats, ctx_start, bonus, block_start, pre.rope_delta, budget,
                                                  self.chain, (ngram, chain)))
                    stats.draft_passes += 1
                else:
                    budget = 0
                    result = yield Call("step", (bonus, block_start, pre.rope_delta))
                path, run, accepted = result.path, result.run, result.feats
                root_entropy, end_entropy = result.root_entropy, result.end_entropy
                clock.lap("round" if drafted else "verify")
            else:
                if looked_up:
                    tree = lookup_tree(bonus, budget, chain)
                    stats.lookup_rounds += 1
                elif drafted and self.grows_tree:  # EAGLE-3: a draft pass per depth grows the tree
                    ctx_tokens = ids[ctx_start + 1 : block_start + 1].to(dev)  # each context row's next token
                    tree, passes = yield Call("draft_tree", (ctx_feats, ctx_tokens, ctx_start, bonus, block_start,
                                                             budget, self.chain))
                    stats.draft_passes += passes
                    clock.lap("draft")
                else:
                    draft_logits = None
                    if drafted:
                        args = (ctx_feats, ctx_start, bonus, block_start)
                        if self.copies:  # a copy head points at context rows: it reads the token after each
                            args = (*args, ids[ctx_start + 1 : block_start + 1].to(dev))
                        draft_logits = yield Call("draft", args)  # [B-1, V]
                        stats.draft_passes += 1
                        clock.lap("draft")
                    else:
                        budget, chain = 0, []  # one autoregressive step: the root alone
                    tree = build_tree(draft_logits, bonus, budget, self.chain, self.draft_vocab, (ngram, chain))
                tokens = torch.from_numpy(tree.tokens).to(dev)
                mask = torch.from_numpy(tree.mask).to(dev)
                index = torch.from_numpy(tree.depth).to(dev) + block_start
                clock.lap("tree")
                positions = text_positions(index, pre.rope_delta, self.mrope)
                logits, feats, greedy, path = yield Call("verify", (tree, tokens, positions, block_start, mask))
                if chooser is None:
                    run = committed_tokens(tree, greedy, path)
                else:  # the target's own choice at each row decides the walk (lossless for sampling)
                    path, last = walk(tree, logits, ids, ids.numel(), chooser)
                    run = [int(tree.tokens[i]) for i in path[1:]] + [last]
                # the root's and the last accepted row's (one read-back; the same row in a step)
                root_entropy, end_entropy = entropies(torch.stack([logits[0], logits[path[-1]]])).tolist()
                clock.lap("verify")
            stats.root_entropy.append(root_entropy)
            stats.prior_entropy.append(prior)
            stats.budgets.append(budget)
            kept, done = apply_stops(run, produced, max_new_tokens, self.eos_ids, stop_strings, ids)
            produced += len(kept)
            ids = torch.cat([ids, torch.tensor(kept, dtype=torch.long)])
            stats.rounds += 1
            stats.accepted_lengths.append(len(kept))
            round_prior, prior = prior, end_entropy
            if not done:
                if not on_device:  # (a device round compacted its rows and gathered their features in its graph)
                    yield Call("commit", (path, block_start))
                    accepted = feats if self.drafter is None else feats[torch.tensor(path, device=dev)]
                if self.drafter is None:
                    ctx_feats = accepted
                else:  # the accepted rows' features: the next draft pass projects them (after any skipped rounds')
                    ctx_feats, ctx_start = (accepted, block_start) if drafted else (torch.cat([ctx_feats, accepted]),
                                                                                    ctx_start)
                n, bonus = n + len(path), run[-1]
            clock.lap("commit")
            seconds = cost() - round_start
            stats.round_seconds.append(seconds)
            if gate is not None and not looked_up:  # the gate weighs drafted rounds against AR steps
                gate.record(drafted, round_prior, ngram, len(run), seconds)
            yield kept

    def generate(self, max_new_tokens: int = 128, sampling: Sampling = GREEDY, **inputs) -> GenerateResult:
        """`inputs`: what the processor returns for one sequence (input_ids, attention_mask,
        pixel_values, ...). `sampling`: greedy (the default) or a `glance_rt.Sampling`. Returns the new
        tokens, stopping after EOS (or a stop string) exactly like HF generate."""
        stats = Stats()
        token_ids = [t for run in self.rounds(max_new_tokens, stats, sampling, **inputs) for t in run]
        return GenerateResult(token_ids, self.target.decode(token_ids), stats)

    def stream(self, max_new_tokens: int = 128, sampling: Sampling = GREEDY, **inputs) -> "Stream":
        """Iterate text pieces as rounds commit; `.result` holds the GenerateResult afterwards."""
        return Stream(self, max_new_tokens, inputs, sampling)


class Stream:
    def __init__(self, decoder: Decoder, max_new_tokens: int, inputs: dict, sampling: Sampling = GREEDY):
        self.decoder, self.max_new_tokens, self.inputs, self.sampling = decoder, max_new_tokens, inputs, sampling
        self.result: GenerateResult | None = None

    def __iter__(self):
        target = self.decoder.target
        stats, token_ids, shown = Stats(), [], ""
        for run in self.decoder.rounds(self.max_new_tokens, stats, self.sampling, **self.inputs):
            token_ids += run
            text = target.decode(token_ids) or ""
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next round
                continue
            if text.startswith(shown) and len(text) > len(shown):
                yield text[len(shown):]
                shown = text
        text = target.decode(token_ids)
        if text is not None and text.startswith(shown) and len(text) > len(shown):
            yield text[len(shown):]
        self.result = GenerateResult(token_ids, text, stats)
