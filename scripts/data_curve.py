"""The drafter's held-out loss and chain tau against the number of training responses, one line per
training length: every `per-kind-N` run of the given ablation folders (`scripts/ablate.py --vary
per-kind=...`), each run's best checkpoint by held-out loss (its history.json).

    python scripts/data_curve.py docs/ablate-2026-12-03-data docs/ablate-2026-12-04-data1000 \
        --prompts data/prompts/corpus-5000.jsonl.gz --out docs/ablate-2026-12-04-data1000/curve.png

A run trains on N prompts of each kind of `--prompts`, so its responses are N times the kinds there.
"""

import argparse
import json
import sys
from pathlib import Path

from glance_rt.tools.suites import read_prompts


def curve_points(folders: list[Path], kinds: int) -> dict[int, list[tuple[int, float, float]]]:
    """steps -> sorted [(responses, best held-out loss, its held-out chain tau)]."""
    lines: dict[int, list] = {}
    for folder in folders:
        for run in sorted(folder.glob("per-kind-*")):
            hist = json.loads((run / "history.json").read_text())
            best = next(e for e in hist["steps"] if e["step"] == hist["best_step"])
            steps = hist["steps"][-1]["step"]
            responses = int(run.name.removeprefix("per-kind-")) * kinds
            lines.setdefault(steps, []).append((responses, best["heldout_loss"], best["heldout_tau_chain"]))
    return {s: sorted(p) for s, p in sorted(lines.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/data_curve.py", description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="ablation folders holding per-kind-N runs")
    ap.add_argument("--prompts", required=True, help="the runs' --prompts (for the number of kinds)")
    ap.add_argument("--out", required=True, type=Path, help="PNG to write")
    args = ap.parse_args(argv)
    kinds = len({r["kind"] for r in read_prompts(args.prompts)})
    lines = curve_points(args.folders, kinds)
    for steps, points in lines.items():
        print(f"{steps} steps: " + ", ".join(f"{n} responses: loss {loss:.2f}, chain tau {tau:.2f}"
                                             for n, loss, tau in points))
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(10, 4))
    for steps, points in lines.items():
        xs = [p[0] for p in points]
        ax_loss.plot(xs, [p[1] for p in points], "o-", label=f"{steps} steps")
        ax_tau.plot(xs, [p[2] for p in points], "o-", label=f"{steps} steps")
    ticks = sorted({p[0] for points in lines.values() for p in points})
    for ax, what in ((ax_loss, "held-out loss (best checkpoint)"), (ax_tau, "held-out chain tau (same checkpoint)")):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("training responses")
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
    fig.suptitle("drafter from scratch: held-out loss and chain tau against training responses")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
