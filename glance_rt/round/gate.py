"""The draft gate: whether a round drafts at all, decided per round from what this machine measures.

A drafted round (a draft pass, then a verify pass over the tree) commits tau tokens for c_d seconds;
an autoregressive step (a one-row verify pass, no draft pass) commits one for c_a. Drafting pays
only where tau > c_d / c_a, and that ratio belongs to the machine and the engine: on a 2-core AMD
EPYC a round of tree-8 costs about 2.1 one-row steps, so chat (tau near 1.8) runs slower than
autoregression while extraction (tau near 4) runs 1.7x faster (docs/benchmarks.md).

Before each round the gate predicts tau from what is known then, with a linear model fitted by
least squares on the decoder's own recent drafted rounds: the target's next-token entropy at the row
that made the round's root (tau falls with it: the entropy law), the size of the n-gram prompt
lookup matched (0 to 3: copying), and the request's recent acceptance (an average of its drafted
rounds, halving the weight of each older one). The model is shared by every request, so what its
inputs miss about one request (a chat turn whose rounds commit less than its features say) shows in
that request's residuals: its predictions add their mean, shrunk towards 0 while they are few
(`shrink`). It drafts when the prediction reaches `margin` times the cost ratio, the ratio of the
median recent wall times of each kind of round. Both kinds of round commit exactly the target's
tokens (greedy, or the keyed sampling draws of `glance_rt.round.sample`), so the gate changes speed,
never output.

Rounds whose prompt-lookup chain fills the whole tree (`glance_rt.round.tree.fills_budget`) skip the
draft pass without asking the gate (they cost a verify pass alone) and are not recorded here.

It learns as it runs: the first `min_drafted` rounds draft and the next `min_steps` take
autoregressive steps, to measure (a decoder's `warmup` pays for part of it); after `explore`
autoregressive steps in a row one round drafts, so the model keeps seeing where drafting stands
(the run doubles, up to `max_explore`, each time such a round commits less than the cost ratio, and
returns to `explore` when one pays).
Replayed offline over the rounds of 30 held-out prompts at cost ratios 1.7-3.0 (`scripts/gate_replay.py`;
docs/benchmarks.md, "the draft gate"), it keeps the slowest prompt at 0.86-0.94x autoregression where
drafting every round falls to 0.49-0.87x, for a median over all prompts 3% lower to 7% higher.
The request residuals raised the slowest prompt of another 30 from 0.85 to 0.92x (same median).
"""

from collections import deque
from dataclasses import dataclass
from statistics import median

import numpy as np

from glance_rt.errors import GlanceError


@dataclass(frozen=True)
class GateConfig:
    """`window`: recent drafted rounds the model is fitted on (and rounds of each kind the costs use).
    `min_drafted` / `min_steps`: drafted rounds / autoregressive steps measured before the gate skips
    a draft. `explore`: at most this many autoregressive steps in a row, then one drafted round
    (doubling up to `max_explore` while those rounds do not pay).
    `margin`: draft when predicted tau >= margin * cost ratio (below 1 leans towards drafting, which
    a wrong prediction costs less). `shrink`: a request's residuals (tokens committed minus the
    shared model's prediction) add sum / (count + shrink) to its predictions."""

    window: int = 128
    min_drafted: int = 16
    min_steps: int = 4
    explore: int = 8
    max_explore: int = 16
    margin: float = 0.9
    shrink: float = 2.0

    def __post_init__(self):
        if (self.window < 2 or not 1 <= self.min_drafted <= self.window or not 1 <= self.min_steps <= self.window
                or not 1 <= self.explore <= self.max_explore or not self.margin > 0
                or not self.shrink > 0):
            raise GlanceError(f"{self}: need window >= 2, min_drafted and min_steps in [1, window], "
                              "1 <= explore <= max_explore, margin > 0 and shrink > 0")


def features(entropy: float, ngram: int, recent: float) -> list[float]:
    """The model's inputs for one round: bias, entropy, one-hot lookup n-gram size (1-3), recent tau."""
    return [1.0, entropy, ngram == 1, ngram == 2, ngram >= 3, recent]


class GateModel:
    """What a gate learns across requests: the drafted rounds' features and tokens, the model fitted on
    them, and the seconds rounds of each kind cost, per regime (a batch's occupancy, where one round's
    cost to a sequence depends on how many share its passes; 0 alone). One per Decoder; a batch's
    sequences share one."""

    def __init__(self, config: GateConfig):
        self.config = config
        self.rows: deque = deque(maxlen=config.window)  # (features, tokens) of drafted rounds
        self.weights: np.ndarray | None = None  # the model fitted on `rows` ([6]); None: too few rows
        self.seconds: dict[tuple[bool, int], deque] = {}  # (drafted?, regime) -> round seconds

    def fit(self) -> None:
        """Refit the model on `rows` (only a drafted round changes them)."""
        if len(self.rows) >= self.config.min_drafted:
            x = np.asarray([f for f, _ in self.rows], float)  # [N, 6]
            y = np.asarray([t for _, t in self.rows], float)  # [N]
            self.weights = np.linalg.lstsq(x, y, rcond=None)[0]

    def times(self, drafted: bool, regime: int = 0) -> deque:
        return self.seconds.setdefault((drafted, regime), deque(maxlen=self.config.window))

    def cost_ratio(self, regime: int = 0) -> float | None:
        """c_d / c_a: median seconds of a drafted round over those of an autoregressive step (in `regime`)."""
        drafted, plain = self.times(True, regime), self.times(False, regime)
        if not drafted or len(plain) < self.config.min_steps:
            return None
        return median(drafted) / median(plain)


class DraftGate:
    """The gate of one request: its recent acceptance, residuals and run of steps (`start()` begins a
    request), over a `GateModel` that carries over between requests (its own, or `model`: shared)."""

    def __init__(self, config: GateConfig = GateConfig(), model: GateModel | None = None, regime=lambda: 0):
        self.config, self.regime = config, regime  # regime(): the model's cost regime now (a batch's occupancy)
        self.model = GateModel(config) if model is None else model
        self.start()

    def start(self) -> None:
        self.recent: float | None = None  # this request's drafted rounds' tau, older ones weighted down
        self.skipped = 0  # autoregressive steps since the last drafted round
        self.run = self.config.explore  # autoregressive steps allowed in a row now
        self.exploring = False  # the coming round drafts only to explore
        self.residual = (0.0, 0)  # this request's drafted rounds: sum of (tokens - shared prediction), count

    def _recent(self) -> float:
        if self.recent is not None:
            return self.recent
        return float(np.mean([t for _, t in self.model.rows])) if self.model.rows else 1.0

    def _shared(self, entropy: float, ngram: int) -> float:
        """The shared model's prediction (needs `weights`)."""
        return float(np.asarray(features(entropy, ngram, self._recent()), float) @ self.model.weights)

    def predict(self, entropy: float, ngram: int) -> float | None:
        """Predicted tokens a drafted round commits now (None: fewer than `min_drafted` seen): the
        shared model's, plus this request's shrunk mean residual."""
        if self.model.weights is None:
            return None
        total, count = self.residual
        return self._shared(entropy, ngram) + total / (count + self.config.shrink)

    def cost_ratio(self) -> float | None:
        return self.model.cost_ratio(self.regime())

    def draft(self, entropy: float, ngram: int, must: bool = False) -> bool:
        """Whether the coming round drafts (`must`: it will anyway; then it counts as exploring)."""
        c = self.config
        tau = self.predict(entropy, ngram)
        self.exploring = False
        if tau is None:
            return True  # learn the model
        ratio = self.cost_ratio()
        if ratio is None:
            return False  # measure autoregressive steps
        if tau >= c.margin * ratio:
            return True
        self.exploring = must or self.skipped >= self.run  # explore after a run of steps
        return self.exploring

    def record(self, drafted: bool, entropy: float, ngram: int, tokens: int, seconds: float) -> None:
        """One finished round: did it draft, its prior entropy and lookup n-gram size, the tokens it
        committed (before stop rules) and its wall time."""
        self.model.times(drafted, self.regime()).append(seconds)
        if drafted:
            ratio = self.cost_ratio()
            if self.exploring and ratio is not None and tokens < self.config.margin * ratio:
                self.run = min(2 * self.run, self.config.max_explore)
            else:
                self.run = self.config.explore
            if self.model.weights is not None:  # against the prediction the round was decided on
                total, count = self.residual
                self.residual = (total + tokens - self._shared(entropy, ngram), count + 1)
            self.model.rows.append((features(entropy, ngram, self._recent()), tokens))
            self.model.fit()
            self.recent = tokens if self.recent is None else (self.recent + tokens) / 2
            self.skipped = 0
        else:
            self.skipped += 1
