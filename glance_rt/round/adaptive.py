"""Adaptive tree budget from the entropy law: per round, pick the budget bucket the law predicts
is fastest for the current entropy. Buckets are a small fixed set, so shapes stay static (each
bucket may have its own compiled graph / CUDA graph).

The entropy used is the one known before the round's verify pass: the target's entropy at the
row that produced the round's root (the previous round's last accepted row, or the prefill).
"""

from dataclasses import dataclass

import numpy as np

from glance_rt.errors import GlanceError


@dataclass(frozen=True)
class Bucket:
    budget: int
    intercept: float  # accepted length = intercept + slope * entropy
    slope: float
    seconds_per_round: float  # measured cost of one round (draft + tree + verify + commit)


@dataclass(frozen=True)
class AdaptiveBudget:
    buckets: tuple[Bucket, ...]

    def __post_init__(self):
        if not self.buckets:
            raise GlanceError("an adaptive budget needs at least one bucket")

    @property
    def max_budget(self) -> int:
        return max(b.budget for b in self.buckets)

    def expected_rate(self, b: Bucket, entropy: float) -> float:
        """Predicted tokens per second of bucket b at this entropy."""
        return max(b.intercept + b.slope * entropy, 1.0) / b.seconds_per_round

    def choose(self, entropy: float) -> int:
        return max(self.buckets, key=lambda b: self.expected_rate(b, entropy)).budget


def calibrate(samples: dict[int, list[tuple[float, int, float]]]) -> AdaptiveBudget:
    """samples[budget] = [(entropy before the round, tokens committed, round seconds), ...] from
    fixed-budget runs -> per-bucket law fits and median round costs."""
    buckets = []
    for budget, rows in sorted(samples.items()):
        if len(rows) < 3:
            continue
        h, acc, sec = (np.asarray(c, float) for c in zip(*rows, strict=True))
        if float(np.var(h)) > 0:
            slope, intercept = np.polyfit(h, acc, 1)
        else:
            slope, intercept = 0.0, float(acc.mean())
        buckets.append(Bucket(budget, float(intercept), float(slope), float(np.median(sec))))
    if not buckets:
        raise GlanceError("not enough calibration rounds for an adaptive budget: run tree-N methods first")
    return AdaptiveBudget(tuple(buckets))
