"""What to run, described once: a `Method` (tree budget, prompt lookup, chain, backend or engine)
with the Python API's defaults, parsed from the names `glance-rt bench --methods` takes and built
from the options `generate` and `audit` share; and the one rule that sizes the static caches to a job.

The defaults are the fastest lossless configuration measured on the default target without a
built engine (docs/benchmarks.md): GLANCE trees of 8 draft nodes with a prompt-lookup chain of
n-grams up to 8 grafted in, the device's default backend (`default_backend`: compiled CUDA-graph
passes on a CUDA device, eager passes on a CPU), and the draft gate (a round drafts only where the
entropy law and the round costs measured on the machine at hand predict drafting pays).
"""

from dataclasses import dataclass
from pathlib import Path

from glance_rt.errors import GlanceError

DEFAULT_TREE_BUDGET = 8  # draft nodes verified per round
DEFAULT_LOOKUP = 8  # largest n-gram a prompt-lookup chain matches (on a drafter's trees)
DEFAULT_LOOKUP_BUDGET = 15  # rows a round of a long lookup match verifies, no draft pass (at most max_depth)
DEFAULT_MAX_LENGTH = 2048  # a Decoder's static cache rows when nothing sizes it to a job
MAX_SCRATCH_BLOCK = 64  # a round's scratch holds the drafter's block: at most MAX_BLOCK_SIZE rows
KINDS = ("ar", "chain", "tree", "adaptive", "eagle3")
BACKENDS = ("eager", "compile", "plain")  # plain: eager with the HF modules' own linear layers (no prepacking)
NUMERICS = ("fast", "exact")  # exact: verify rows with the AR step's bits (glance_rt.models.exact)


def check_numerics(numerics: str) -> str:
    """`numerics` if it is one of `NUMERICS`, else the error saying which are."""
    if numerics not in NUMERICS:
        raise GlanceError(f"unknown numerics {numerics!r}: choose {' or '.join(NUMERICS)}")
    return numerics


def default_backend(device) -> str:
    """The backend that runs when none is named: "compile" (fixed-shape passes, CUDA graphs) on a CUDA
    device, where eager launches cost 8x (an H200 at a 3B's shapes: AR step 42.2 ms eager, 5.25 ms
    compiled; docs/engines.md), and "eager" on a CPU, where the kernels are chosen by timing and nothing
    waits for a compile (docs/benchmarks.md)."""
    return "compile" if str(device).startswith("cuda") else "eager"


@dataclass(frozen=True)
class Method:
    """How to decode. `kind`: "tree" (GLANCE trees of `tree_budget` draft nodes), "chain" (the
    width-1 tree, DFlash-style), "ar" (autoregression through the same verify pass), "adaptive"
    (a budget bucket per round from the entropy law; needs a calibrated `AdaptiveBudget`) or
    "eagle3" (an EAGLE-3 head's dynamic trees of `tree_budget` nodes: the baseline; its drafter is an
    `Eagle3Drafter`, `glance_rt.load_eagle3`).
    `lookup`: prompt-lookup n-gram grafted into a drafter's trees (None: `DEFAULT_LOOKUP` where it
    applies, 0: none). `backend`: eager, compile or plain (None: `default_backend` of the target's
    device). `engine`: a built engine's folder (its manifest fixes the budget buckets, chain and
    shapes; the backend is the engine's; `tree_budget` None: its largest bucket). A chain's
    `tree_budget` None (its default from `parse` and the CLI) drafts what the drafter's own runtime
    draws, the whole block (B-1 tokens); a number caps it. `gate`: a drafter's
    rounds pass the draft gate (`glance_rt.round.gate`; False, `+always` in a name: draft every
    round). `lookup_budget`: rows a round whose lookup chain fills the tree verifies, the chain alone,
    no draft pass (None: `DEFAULT_LOOKUP_BUDGET` within the
    drafter's `max_depth`; `+lookup-L` in a name). `numerics`: "fast" or "exact" (`+exact` in a name:
    verify rows computed bit for bit as AR steps, `glance_rt.models.exact`; eager and compiled passes,
    and engines built with `build-engine --exact`)."""

    kind: str = "tree"
    tree_budget: int | None = DEFAULT_TREE_BUDGET
    lookup: int | None = None
    backend: str | None = None
    engine: str | None = None
    gate: bool = True
    lookup_budget: int | None = None
    numerics: str = "fast"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GlanceError(f"unknown method kind {self.kind!r}: choose one of {', '.join(KINDS)}")
        if self.tree_budget is None and self.engine is None and self.kind != "chain":
            raise GlanceError("tree_budget=None means an engine's largest budget (or a chain's whole block): give a "
                              "budget or an engine")
        if self.backend is not None and self.backend not in BACKENDS:
            raise GlanceError(f"unknown backend {self.backend!r}: choose one of {', '.join(BACKENDS)} "
                              "(built engines run with --engine DIR)")
        check_numerics(self.numerics)

    @classmethod
    def parse(cls, text: str) -> "Method":
        """`ar`, `chain`, `tree-N`, `tree-N+lookup`, `tree-N+lookup-L` (lookup rounds of L rows),
        `adaptive` or `eagle3-N`, each optionally `+always` (no draft gate), `+exact` (exact numerics)
        and `@compile` or `@plain`
        (`tree-8+lookup@compile`; none: the device's default backend, `@eager` names eager). A bare
        `tree-N` drafts with the drafter alone."""
        base, at, backend = text.strip().partition("@")
        backend = backend if at else None
        if at and backend not in BACKENDS:
            raise GlanceError(f"unknown backend in method {text!r}: use @{', @'.join(BACKENDS)} or none (the "
                              "device's default)")
        numerics = "exact" if base.endswith("+exact") else "fast"
        base = base.removesuffix("+exact")
        always = base.endswith("+always") and base != "ar+always"
        base = base.removesuffix("+always") if always else base
        if base in ("ar", "chain", "adaptive"):
            return cls(kind=base, tree_budget=None if base == "chain" else DEFAULT_TREE_BUDGET, lookup=0,
                       backend=backend, gate=not always, numerics=numerics)
        tree, plus, extra = base.partition("+")
        extra, dash, rows = extra.partition("-")
        lookup_budget = int(rows) if dash and extra == "lookup" and rows.isdigit() else None
        if tree.startswith("eagle3-") and tree[7:].isdigit() and not plus:
            return cls(kind="eagle3", tree_budget=int(tree[7:]), lookup=0, backend=backend, gate=not always,
                       numerics=numerics)
        if (tree.startswith("tree-") and tree[5:].isdigit() and (plus, extra) in (("", ""), ("+", "lookup"))
                and (not dash or lookup_budget is not None)):
            return cls(tree_budget=int(tree[5:]), lookup=DEFAULT_LOOKUP if extra else 0, backend=backend,
                       gate=not always, lookup_budget=lookup_budget, numerics=numerics)
        raise GlanceError(f"unknown method {text!r}: use ar, chain, tree-N, tree-N+lookup, tree-N+lookup-L, "
                          "adaptive or eagle3-N, each optionally +always (draft every round), +exact (exact numerics) "
                          "and @eager, @compile or @plain")

    @property
    def name(self) -> str:
        """The name `parse` reads back (engines: `…@engine:FOLDER`)."""
        base = f"tree-{self.tree_budget}" if self.kind == "tree" and self.tree_budget is not None else self.kind
        base = f"eagle3-{self.tree_budget}" if self.kind == "eagle3" else base
        if self.kind == "tree" and self.lookup != 0:
            base += "+lookup" if self.lookup_budget is None else f"+lookup-{self.lookup_budget}"
        if self.kind != "ar" and not self.gate:
            base += "+always"
        if self.numerics == "exact":
            base += "+exact"
        if self.engine is not None:
            return f"{base}@engine:{Path(self.engine).name}"
        return base if self.backend is None else f"{base}@{self.backend}"


def job_max_length(prompt_tokens: int, max_new_tokens: int, budgets=()) -> int:
    """The one rule for static cache rows, used wherever a job is known (generate, audit, bench):
    its longest prompt + max_new_tokens + one round's scratch (the largest tree verified, or a
    drafter block), rounded up to 64. Static backends attend over all of them: no more than needed."""
    scratch = max([b + 1 for b in budgets if b is not None] + [MAX_SCRATCH_BLOCK])  # None: a chain's block
    return -(-(prompt_tokens + max_new_tokens + scratch) // 64) * 64
