"""Ablations of drafter training: one `glance-rt train` run per value of one option, the rest fixed,
then a table and a plot of held-out tau against that value.

    python scripts/ablate.py --out runs/ablate-data --vary per-kind=100,200,425,1000,2550 -- \
        --prompts data/prompts/corpus-3000.jsonl.gz --store data/responses/smollm2-135m-instruct \
        --response-tokens 96 --num-layers 2 --target-layer-ids 2,15,27 --steps 600 --features online

Everything after `--` is passed to every run. Values are separated by commas (by semicolons for
`target-layer-ids` and `init-layers`, whose values hold commas); a flag's values are `on` and `off`.
Each run is `OUT/<option>-<value>/`, a normal training folder: a rerun resumes the unfinished ones
(`train --resume`) and skips the finished ones, so an ablation can span several sessions.
`OUT/summary.json`, `OUT/summary.md` and `OUT/summary.png` (matplotlib) collect each run's eval.json
(tau at train's eval configuration, the default method and the drafter alone), its best held-out loss
and chain tau (history.json), and for `per-kind` the number of training responses it used. With
`--eval-every N` among the common options, `OUT/curve.png` plots tau against training steps per variant
(`--vary head=glance,eagle3`: the two heads from the same data and compute). `--runs FOLDER...` (no `--`)
summarises finished training folders made by other commands the same way, each labelled by its name.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LIST_OPTIONS = ("target-layer-ids", "init-layers")  # options whose values hold commas: values split by ";"


def run_dir(out: Path, option: str, value: str) -> Path:
    return out / f"{option}-{value.replace(',', '_')}"


def train_one(out: Path, option: str, value: str, common: list[str]) -> float:
    """Run (or resume) one variant -> minutes it took now (0 when it was finished)."""
    folder = run_dir(out, option, value)
    if (folder / "eval.json").exists():
        return 0.0
    flag = {"on": [f"--{option}"], "off": []}.get(value, [f"--{option}", value])  # a flag: on / off
    cmd = [sys.executable, "-m", "glance_rt.cli", "train", *common, *flag, "--out", str(folder)]
    if (folder / "run.json").exists():
        cmd.append("--resume")
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return (time.perf_counter() - start) / 60


def responses_used(folder: Path) -> int:
    return sum(1 for p in (folder / "responses").glob("part-*.jsonl") for line in p.read_text().splitlines() if line)


def summarise(out: Path, option: str, values: list[str]) -> list[dict]:
    return summarise_runs([(value, run_dir(out, option, value)) for value in values])


def summarise_runs(runs: list[tuple[str, Path]]) -> list[dict]:
    """A row per finished run folder of runs [(label, folder)] (unfinished ones are left out)."""
    rows = []
    for value, folder in runs:
        if not (folder / "eval.json").exists():
            continue
        ev = json.loads((folder / "eval.json").read_text())
        hist = json.loads((folder / "history.json").read_text())
        best = next(e for e in hist["steps"] if e["step"] == hist["best_step"])
        alone = ev.get("drafter_alone") or (ev if not ev.get("lookup") else None)  # no lookup: it is alone
        tau_alone = alone["overall"]["tau"] if alone else None
        rows.append({"value": value, "responses": responses_used(folder), "tau": ev["overall"]["tau"],
                     "tau_alone": tau_alone,
                     "tau_alone_kinds": {k: v["tau"] for k, v in alone["kinds"].items()} if alone else {},
                     "tau_kinds": {k: v["tau"] for k, v in ev["kinds"].items()}, "best_step": hist["best_step"],
                     "heldout_loss": best.get("heldout_loss"), "heldout_tau_chain": best.get("heldout_tau_chain"),
                     "eval": {k: ev[k] for k in ("tree_budget", "lookup", "max_new_tokens")},
                     "curve": curve(hist["steps"], ev["overall"]["tau"], tau_alone)})
    return rows


def curve(history: list[dict], tau: float, tau_alone: float | None) -> list[list]:
    """[step, tau, tau of the drafter alone] at each --eval-every point and at the end (eval.json's tau and
    tau_alone, the same prompts); [] for a run without --eval-every."""
    points = [[e["step"], e["heldout_tau"], e["heldout_tau_alone"]] for e in history if "heldout_tau" in e]
    return [*points, [history[-1]["step"], tau, tau_alone]] if points else []


def write_summary(out: Path, option: str, rows: list[dict]) -> None:
    (out / "summary.json").write_text(json.dumps({"option": option, "runs": rows}, indent=1))
    kinds = sorted({k for r in rows for k in r["tau_kinds"]})
    lines = [f"| --{option} | training responses | tau | " + " | ".join(kinds) + " | drafter alone | "
             + " | ".join(f"alone: {k}" for k in kinds) + " | best step | held-out loss | held-out chain tau |",
             "|---" * (7 + 2 * len(kinds)) + "|"]  # value, responses, tau, kinds, alone, its kinds, 3 more
    nan = float("nan")
    for r in rows:
        lines.append(f"| {r['value']} | {r['responses']} | {r['tau']:.2f} | "
                     + " | ".join(f"{r['tau_kinds'].get(k, nan):.2f}" for k in kinds)
                     + f" | {r['tau_alone'] if r['tau_alone'] is not None else nan:.2f} | "
                     + " | ".join(f"{r['tau_alone_kinds'].get(k, nan):.2f}" for k in kinds)
                     + f" | {r['best_step']} | {r['heldout_loss']:.3f} | {r['heldout_tau_chain']:.2f} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = option == "per-kind"
    xs = [r["responses"] for r in rows] if numeric else list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["tau"] for r in rows], "o-", lw=2, label="overall")
    for k in kinds:
        ax.plot(xs, [r["tau_kinds"].get(k) for r in rows], ".--", label=k)
    if numeric:
        ax.set_xscale("log")
        ax.set_xlabel("training responses")
    else:
        ax.set_xticks(xs, [r["value"] for r in rows])
        ax.set_xlabel(f"--{option}")
    save_plot(plt, fig, ax, rows, f"{out.name}: held-out tau against --{option}", out / "summary.png")
    if any(r["curve"] for r in rows):
        plot_curves(out, option, rows, plt)


def plot_curves(out: Path, option: str, rows: list[dict], plt) -> None:
    """curve.png: held-out tau against training steps, each variant's default method (solid) and drafter
    alone (dashed), from --eval-every's points."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(r for r in rows if r["curve"]):
        steps, tau, alone = zip(*r["curve"], strict=True)
        ax.plot(steps, tau, "o-", color=f"C{i}", label=f"--{option} {r['value']}")
        ax.plot(steps, alone, "s--", color=f"C{i}", label=f"--{option} {r['value']}, drafter alone")
    ax.set_xlabel("training step")
    save_plot(plt, fig, ax, rows, f"{out.name}: held-out tau against training steps", out / "curve.png")


def save_plot(plt, fig, ax, rows: list[dict], title: str, path: Path) -> None:
    """Label the tau axis with the runs' eval configuration, add the legend and title, write and close."""
    ev = rows[0]["eval"] if rows else {}
    ax.set_ylabel(f"held-out tau (budget {ev.get('tree_budget')}, lookup {ev.get('lookup')})")
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    common = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(prog="python scripts/ablate.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder of the runs and the summary")
    ap.add_argument("--vary", help="OPTION=V1,V2,... (a `glance-rt train` option without --)")
    ap.add_argument("--runs", nargs="+", type=Path,
                    help="instead of --vary: summarise these finished training folders, each labelled by its name "
                         "(runs that differ in several flags, e.g. a GLANCE drafter against an EAGLE-3 head)")
    ap.add_argument("--summary-only", action="store_true", help="only collect the finished runs")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.runs:
        write_summary(out, "run", summarise_runs([(folder.name, folder) for folder in args.runs]))
        return 0
    if not args.vary:
        ap.error("give --vary OPTION=V1,V2,... or --runs FOLDER...")
    option, _, values = args.vary.partition("=")
    values = [v for v in values.split(",") if v] if option not in LIST_OPTIONS else values.split(";")
    if not values:
        ap.error("--vary needs OPTION=V1,V2,...")
    if not args.summary_only:
        for i, value in enumerate(values):
            minutes = train_one(out, option, value, common)
            print(f"[ablate] {option}={value} done ({i + 1}/{len(values)}, {minutes:.1f} min)", flush=True)
    write_summary(out, option, summarise(out, option, values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
