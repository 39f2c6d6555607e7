"""`glance-rt bench`: methods side by side in ONE process, interleaved per prompt, after a warm-up,
every output checked against Hugging Face greedy decoding.

Methods: `ar` (same-engine autoregression), `chain` (DFlash-style width-1 tree), `tree-N` (GLANCE
trees of budget N; `tree-N+lookup` grafts a prompt-lookup chain into each tree), `adaptive` (per
round, the tree-N bucket the entropy law predicts is fastest, calibrated on the warm-up prompts'
tree-N rounds), `hf` (HF `generate` greedy), `hf-lookup` (HF prompt-lookup decoding). Ratios
are per prompt (same prompt, same tokens) and summarised by their median and quartiles.
"""

import os
import resource
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from glance_rt.errors import GlanceError, require
from glance_rt.export.manifest import read_manifest
from glance_rt.files import atomic_write, write_json
from glance_rt.method import DEFAULT_LOOKUP, Method, job_max_length
from glance_rt.models.kernels import cpu_model, machine
from glance_rt.round.adaptive import calibrate
from glance_rt.round.loop import Decoder
from glance_rt.round.sample import GREEDY, Sampling
from glance_rt.tools.suites import encode_rows

SCHEMA = "glance-rt/bench/1"
DEFAULT_METHODS = ("ar", "chain", "tree-8", "tree-16", "tree-32", "tree-64", "adaptive", "hf", "hf-lookup")


@dataclass(frozen=True)
class BenchConfig:
    methods: tuple[str, ...] = DEFAULT_METHODS
    max_new_tokens: int = 128
    warmup: int = 1  # prompts run once per method before timing
    lookup_tokens: int = 10  # HF prompt_lookup_num_tokens
    engine_lookup: bool = False  # also run each drafter engine with lookup (`tree-N+lookup@backend:NAME`)
    max_length: int | None = None  # static cache rows; None: the suite's longest prompt + max_new_tokens + scratch
    engines: tuple[str, ...] = ()  # engine folders (glance-rt build-engine), benched as method "engine:NAME"
    sampling: Sampling = GREEDY  # sampled: every glance-rt output is checked against "ar" with the same seed


@dataclass
class Record:
    prompt: str
    kind: str
    method: str
    seconds: float
    tokens: int
    ttft: float
    matches_hf: bool | None  # equals the reference's tokens (HF greedy; "ar" when sampling); None: not comparable
    accepted_lengths: list = field(default_factory=list)  # per drafted round (per round where none drafted)
    root_entropy: list = field(default_factory=list)  # of the same rounds
    timings: dict = field(default_factory=dict)
    draft_passes: int = 0
    lookup_rounds: int = 0  # tree rounds of a lookup chain alone (no draft pass)
    rounds: int = 0  # all rounds, the draft gate's autoregressive steps included
    peak_mem_mb: float | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Skip(Exception):
    """A method that cannot run on this target (the message says why)."""


class _FirstToken:
    """HF streamer that records when the first new token arrives."""

    def __init__(self, start: float):
        self.start, self.calls, self.first = start, 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter() - self.start

    def end(self):
        pass


def _hf_runner(target, cfg: BenchConfig, lookup: bool):
    if lookup and target.is_vlm:
        raise Skip("HF prompt-lookup decoding is run on text models only here (VLM inputs are not supported by it)")
    kw = {"prompt_lookup_num_tokens": cfg.lookup_tokens} if lookup else {}
    kw.update(hf_sampling_kwargs(cfg.sampling, target))

    def run(inputs):
        start = time.perf_counter()
        streamer = _FirstToken(start)
        with torch.inference_mode():
            out = target.hf_model.generate(**inputs, max_new_tokens=cfg.max_new_tokens,
                                           eos_token_id=sorted(target.eos_token_ids) or None, streamer=streamer, **kw)
        seconds = time.perf_counter() - start
        ids = out[0, inputs["input_ids"].shape[1]:].tolist()
        return ids, seconds, streamer.first or seconds, None

    return run


def hf_sampling_kwargs(sampling: Sampling, target) -> dict:
    """`sampling` as HF generate's keyword arguments (HF samples with its own RNG: same distribution,
    other tokens than glance-rt's keyed draws)."""
    kw = dict(do_sample=sampling.do_sample, repetition_penalty=sampling.repetition_penalty)
    if sampling.do_sample:
        kw.update(temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p,
                  min_p=sampling.min_p)
    if sampling.stop:
        kw.update(stop_strings=list(sampling.stop), tokenizer=target.tokenizer)
    return kw


def _glance_runner(target, drafter, cfg: BenchConfig, method: Method, policy=None):
    """A glance-rt method (`glance_rt.method.Method`: ar, chain, tree-N, tree-N+lookup, adaptive,
    each optionally @compile or @plain)."""
    if method.kind != "ar" and drafter is None:
        raise Skip("needs a drafter (pass --drafter, or use the default target's shipped one)")
    return DecoderRunner(Decoder.from_method(method, target, drafter, cfg.max_length, policy), cfg)


@dataclass(frozen=True)
class DecoderRunner:
    """Times one generation of a glance-rt Decoder (the report also reads its kernel choices). Made
    warm: every graph of every verify shape (the lookup rounds' too, which a warm-up prompt may never
    reach) is compiled or loaded before anything is timed."""

    dec: Decoder
    cfg: BenchConfig

    def __post_init__(self):
        self.dec.warmup()

    def __call__(self, inputs):
        start = time.perf_counter()
        res = self.dec.generate(max_new_tokens=self.cfg.max_new_tokens, sampling=self.cfg.sampling, **inputs)
        return res.token_ids, time.perf_counter() - start, res.stats.timings["prefill"], res.stats


def engine_method(dec, folder) -> str:
    """`tree-32@aoti:NAME`: the eager method it computes, the engine's backend and folder name."""
    return f"{dec.method_name}:{Path(folder).name}"


def make_runner(method: str, target, drafter, cfg: BenchConfig, eagle3=None):
    """`eagle3`: the EAGLE-3 head (`Eagle3Drafter`) that eagle3-N methods draft with; the others take
    `drafter`."""
    if method in ("hf", "hf-lookup"):
        return _hf_runner(target, cfg, lookup=method == "hf-lookup")
    parsed = Method.parse(method)
    if parsed.kind == "eagle3" and eagle3 is None:
        raise Skip("needs an EAGLE-3 head (pass --eagle3 PATH)")
    return _glance_runner(target, eagle3 if parsed.kind == "eagle3" else drafter, cfg, parsed)


REFERENCE_NAMES = {"hf": "HF greedy", "ar": "the same engine's autoregression (same seed)",
                   "ar+exact": "the same engine's autoregression in exact numerics (same seed)"}


def reference_method(cfg: BenchConfig, method: str = "ar", dtype: torch.dtype = torch.float32) -> str:
    """What `method`'s outputs are checked against: HF greedy (greedy in fp32), else (sampling, or bf16
    and fp16, where HF's kernels round otherwise) the same engine's AR in the method's numerics: `ar`,
    or `ar+exact` for a `+exact` method."""
    if not cfg.sampling.do_sample and dtype == torch.float32:
        return "hf"
    return "ar+exact" if "+exact" in method.partition("@")[0] else "ar"


def eager_base(method: str) -> str | None:
    """The eager method a compiled/engine method is compared with (`tree-16@compile` -> `tree-16`)."""
    if "@" in method:
        return method.partition("@")[0]
    return None


def suite_max_length(encoded: list[dict], cfg: BenchConfig) -> int:
    """Static cache rows for a suite (`glance_rt.method.job_max_length`): its longest prompt, the
    methods' largest tree."""
    longest = max(e["input_ids"].shape[1] for e in encoded)
    trees = [m.tree_budget for m in _methods(cfg) if m.kind == "tree"]
    return job_max_length(longest, cfg.max_new_tokens, trees)


def _methods(cfg: BenchConfig) -> list[Method]:
    return [Method.parse(m) for m in cfg.methods if m not in ("hf", "hf-lookup")]


def _peak_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process-wide on CPU (KB on Linux)


def _resident_mb(device) -> float | None:
    """Memory in use now: the CUDA allocator's on a GPU, the process's resident set on Linux, else None."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def _footprint(runner, before: float | None, after: float | None) -> dict:
    """What making (and warming) a method's runner added, in MB, and its Decoder's static caches: the first
    Decoder on a target also makes the prepared weight copies every later one shares (`Target.layouts`)."""
    import gc

    gc.collect()
    caches = runner.dec.cache_bytes / 2**20 if isinstance(runner, DecoderRunner) else None
    added = None if before is None or after is None else after - before
    return {"added": added, "caches": caches}


def run_bench(target, drafter, rows: list[dict], cfg: BenchConfig, images_dir=None, progress: bool = True,
              log=print, eagle3=None) -> dict:
    """Run every method on every prompt, interleaved; returns the report (partial if interrupted).
    `eagle3`: the EAGLE-3 head the eagle3-N methods draft with (the baseline beside GLANCE's tree-N)."""
    from tqdm.auto import tqdm


    if "hf" not in cfg.methods:
        raise GlanceError("bench needs the 'hf' method: every output is checked against HF greedy decoding "
                          "(and HF is the baseline speed)")
    refs = {m: reference_method(cfg, m, target.dtype) for m in cfg.methods}
    missing = sorted({r for r in refs.values() if r not in cfg.methods})
    if missing:
        raise GlanceError(f"this bench checks its outputs against {', '.join(missing)} (sampled, or bf16/fp16: the "
                          f"same engine's autoregression in each method's numerics): add {', '.join(missing)} to "
                          "--methods")
    encoded = encode_rows(target, rows, images_dir)
    if cfg.max_length is None:
        cfg = replace(cfg, max_length=suite_max_length(encoded, cfg))
    runners, skipped, footprint = {}, {}, {}
    for m in cfg.methods:
        try:
            if m.partition("@")[0] != "adaptive":
                before = _resident_mb(target.device)
                runners[m] = make_runner(m, target, drafter, cfg, eagle3)
                footprint[m] = _footprint(runners[m], before, _resident_mb(target.device))
        except Skip as e:
            skipped[m] = str(e)
            log(f"[bench] skipping {m}: {e}")
    engines = {}
    for folder in cfg.engines:
        manifest = read_manifest(Path(folder))
        autoregressive = manifest["source"]["drafter_weights"] is None  # an AR engine
        built_on = (manifest.get("kernels") or {}).get("machine", {}).get("cpu")
        graph_flavors = {g: info["flavor"] for g, info in manifest["graphs"].items() if "flavor" in info}
        engines[Path(folder).name] = {"flavor": manifest.get("flavor"), "graphs": graph_flavors, "built_on": built_on,
                                      "same_cpu": built_on == cpu_model() if built_on else None,
                                      "chosen_by": (manifest.get("kernels") or {}).get("chosen_by")}
        own = eagle3 if manifest.get("eagle3") else drafter  # an EAGLE-3 head's engine: --eagle3 (or its source)
        dec = Decoder.from_engine(folder, target, None if autoregressive else own, lookup=0)
        runners[engine_method(dec, folder)] = DecoderRunner(dec, cfg)
        if cfg.engine_lookup and not autoregressive and not dec.chain and not manifest.get("eagle3"):
            dec = Decoder.from_engine(folder, target, drafter, lookup=DEFAULT_LOOKUP)
            runners[engine_method(dec, folder)] = DecoderRunner(dec, cfg)
    calibration: dict[str, dict[int, list]] = {}  # backend -> budget -> rounds
    policy = None
    for inputs in encoded[: cfg.warmup]:
        for m, run in runners.items():
            stats = run(inputs)[3]
            method = Method.parse(m) if m not in ("hf", "hf-lookup") and ":" not in m else None
            if method is not None and method.kind == "tree" and not method.lookup:  # plain trees calibrate adaptive
                calibration.setdefault(method.backend, {}).setdefault(method.tree_budget, []).extend(
                    (stats.prior_entropy[i], stats.accepted_lengths[i], stats.round_seconds[i]) for i in stats.drafted)
    for adaptive in [m for m in cfg.methods if m.partition("@")[0] == "adaptive"]:
        try:

            if drafter is None:
                raise Skip("needs a drafter")
            method = Method.parse(adaptive)
            if not calibration.get(method.backend):
                raise Skip("needs tree-N methods on the same backend and --warmup >= 1 to calibrate its buckets")
            policy = calibrate(calibration[method.backend])
            runners[adaptive] = _glance_runner(target, drafter, cfg, method, policy)
            log("[bench] adaptive buckets: " + ", ".join(
                f"N={b.budget}: tau={b.intercept:.2f}{b.slope:+.2f}*H, {b.seconds_per_round * 1e3:.1f} ms/round"
                for b in policy.buckets))
        except (Skip, GlanceError) as e:
            skipped[adaptive] = str(e)
            log(f"[bench] skipping {adaptive}: {e}")
    first = list(dict.fromkeys(r for r in refs.values() if r in runners))
    for m in runners:
        if (r := reference_method(cfg, m, target.dtype)) not in runners and not m.startswith("hf"):
            log(f"[bench] {m}: not checked (its reference {r} is not among --methods)")
    order = first + [m for m in runners if m not in first]
    records, mismatches, partial = [], [], False
    bar = tqdm(total=len(rows) * len(order), desc="bench", disable=not progress, dynamic_ncols=True)
    try:
        for i, (row, inputs) in enumerate(zip(rows, encoded, strict=True)):
            reference = {}
            rest = order[len(first):]
            rest = rest[i % len(rest):] + rest[: i % len(rest)] if rest else rest  # rotate: no fixed order bias
            for m in [*first, *rest]:
                if target.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(target.device)
                ids, seconds, ttft, stats = runners[m](inputs)
                if m in first:
                    reference[m] = ids
                ref = reference_method(cfg, m, target.dtype)  # (an --engine method's too: by its name)
                comparable = ref in reference and not (m.startswith("hf") and ref != "hf")
                ok = ids == reference[ref] if comparable else None
                if ok is False:
                    mismatches.append({"prompt": row["id"], "method": m})
                    log(f"[bench] !!! MISMATCH: {m} differs from {REFERENCE_NAMES[ref]} on prompt {row['id']} !!!")
                rec = Record(row["id"], row["kind"], m, seconds, len(ids), ttft, ok,
                             peak_mem_mb=_peak_mb(target.device))
                if stats is not None:
                    rec.accepted_lengths = [stats.accepted_lengths[i] for i in stats.drafted]
                    rec.root_entropy = [stats.root_entropy[i] for i in stats.drafted]
                    rec.timings, rec.draft_passes, rec.rounds = dict(stats.timings), stats.draft_passes, stats.rounds
                    rec.lookup_rounds = stats.lookup_rounds
                records.append(rec)
                bar.update(1)
    except KeyboardInterrupt:
        partial = True
        log("[bench] interrupted: the report covers the prompts finished so far")
    bar.close()
    report = build_report(records, skipped, mismatches, partial, target, cfg)
    report["engines"] = engines
    report["kernels"] = {m: r.dec.kernel_choices for m, r in runners.items() if isinstance(r, DecoderRunner)}
    report["footprint_mb"] = footprint
    report["adaptive_buckets"] = [asdict(b) for b in policy.buckets] if policy is not None else None
    return report


# ----------------------------------------------------------------------------- summaries


def _quartiles(xs: list[float]) -> dict:
    if not xs:
        return {"median": None, "p25": None, "p75": None, "n": 0}
    a = np.asarray(xs, dtype=float)
    return {"median": float(np.median(a)), "p25": float(np.percentile(a, 25)), "p75": float(np.percentile(a, 75)),
            "n": len(xs)}


def _ratios(records: list[Record], method: str, base: str, kind: str | None = None) -> list[float]:
    """Per-prompt speed ratios (tokens/s of `method` over tokens/s of `base`)."""
    by = {(r.prompt, r.method): r for r in records if kind is None or r.kind == kind}
    return [by[(p, method)].tok_s / by[(p, base)].tok_s for (p, m) in by
            if m == method and (p, base) in by and by[(p, base)].tok_s > 0]


def fit_law(entropy: list[float], accepted: list[int]) -> dict:
    """Least-squares accepted length = intercept + slope * entropy, with R^2 and n."""
    n = len(entropy)
    if n < 3 or float(np.var(entropy)) == 0.0 or float(np.var(accepted)) == 0.0:
        return {"slope": None, "intercept": None, "r2": None, "n": n}
    x, y = np.asarray(entropy, float), np.asarray(accepted, float)
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (intercept + slope * x)
    r2 = 1 - float((resid**2).sum()) / max(float(((y - y.mean()) ** 2).sum()), 1e-12)
    return {"slope": float(slope), "intercept": float(intercept), "r2": r2, "n": n}


def ar_base(method: str, methods) -> str:
    """The autoregression `method` is compared with: its own backend's (`ar@compile`, an AR engine of
    the same backend) when the run has one, else eager `ar`."""
    _, at, backend = method.partition("@")
    if at:
        same = [m for m in methods if m.startswith("ar@") and m[3:].partition(":")[0] == backend.partition(":")[0]]
        if same:
            return sorted(same)[0]
    return "ar"


def method_summary(records: list[Record], method: str, kind: str | None = None) -> dict:
    rs = [r for r in records if r.method == method and (kind is None or r.kind == kind)]
    ar = ar_base(method, {r.method for r in records})
    lens = [n for r in rs for n in r.accepted_lengths]  # drafted rounds'
    all_rounds = sum(r.rounds for r in rs)
    timings = {}
    for r in rs:
        for k, v in r.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    hist = np.bincount(lens).tolist() if lens else []
    return {
        "prompts": len(rs),
        "tok_s": _quartiles([r.tok_s for r in rs]),
        "speedup_vs_ar": _quartiles(_ratios(records, method, ar, kind)),
        "ar_method": ar,
        "speedup_vs_hf": _quartiles(_ratios(records, method, "hf", kind)),
        "speedup_vs_eager": _quartiles(_ratios(records, method, base, kind)) if (base := eager_base(method)) else None,
        "tau": float(np.mean(lens)) if lens else None,
        "tau_hist": hist,
        "draft_passes_per_round": (sum(r.draft_passes for r in rs) / all_rounds) if all_rounds else None,
        "lookup_rounds_per_round": (sum(r.lookup_rounds for r in rs) / all_rounds) if all_rounds else None,
        "phase_seconds": timings,
        "ttft": _quartiles([r.ttft for r in rs]),
        "peak_mem_mb": max((r.peak_mem_mb or 0.0) for r in rs) if rs else None,
        "mismatches": sum(r.matches_hf is False for r in rs),
        "entropy_law": fit_law([e for r in rs for e in r.root_entropy], lens),
    }


def build_report(records, skipped, mismatches, partial, target, cfg: BenchConfig) -> dict:
    methods = list(dict.fromkeys(r.method for r in records))
    kinds = list(dict.fromkeys(r.kind for r in records))
    return {
        "schema": SCHEMA,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "target": target.name,
        "dtype": str(target.dtype).removeprefix("torch."),
        "device": str(target.device),
        "torch_threads": torch.get_num_threads(),
        "machine": machine(),
        "config": asdict(cfg),
        "reference": " / ".join(dict.fromkeys(REFERENCE_NAMES[reference_method(cfg, m, target.dtype)]
                                              for m in methods if not m.startswith("hf"))) or REFERENCE_NAMES["hf"],
        "partial": partial,
        "skipped": skipped,
        "mismatches": mismatches,
        "overall": {m: method_summary(records, m) for m in methods},
        "kinds": {k: {m: method_summary(records, m, k) for m in methods} for k in kinds},
        "chain_beats_tree": _chain_vs_tree(records),
        "glance_vs_eagle3": _glance_vs_eagle3(records),
        "records": [asdict(r) | {"tok_s": r.tok_s} for r in records],
    }


def _draft_ms(summary: dict) -> float | None:
    """Milliseconds of drafting per round counted in tau: draft passes and the tree built from them (GLANCE
    builds its tree on the host after one pass, EAGLE-3 grows it between its passes: both phases)."""
    rounds = sum(summary["tau_hist"])
    t = summary["phase_seconds"]
    return 1000 * (t.get("draft", 0.0) + t.get("tree", 0.0)) / rounds if rounds else None


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def glance_partner(eagle3_method: str, methods) -> str | None:
    """The GLANCE method among `methods` that `eagle3_method` is set against: the same budget, gate and
    backend (`eagle3-8+always@compile` -> `tree-8+always@compile`); for an engine (`@aoti:FOLDER`), the
    GLANCE engine of the same backend, whatever its folder. None where the run has none."""
    base, at, backend = eagle3_method.partition("@")
    glance = f"tree-{base.removeprefix('eagle3-')}" + (f"@{backend}" if at else "")
    if ":" in backend:
        engine = glance.partition(":")[0] + ":"
        return next((m for m in sorted(methods) if m.startswith(engine)), None)
    return glance if glance in methods else None


def _glance_vs_eagle3(records: list[Record]) -> dict:
    """At each budget run both ways on the same backend (tree-N, the drafter alone, against eagle3-N):
    GLANCE's accepted length per drafted round over EAGLE-3's, draft passes and drafting milliseconds per
    round of each, their tokens/s (median) and GLANCE's speed over EAGLE-3's (median of per-prompt
    ratios), overall and per kind (the paper's comparison)."""
    out = {}
    methods = {r.method for r in records}
    for e in sorted(m for m in methods if m.startswith("eagle3-")):
        glance = glance_partner(e, methods)
        if glance is None:
            continue
        entry = {}
        for kind in [None, *dict.fromkeys(r.kind for r in records)]:
            g, b = method_summary(records, glance, kind), method_summary(records, e, kind)
            if g["tau"] and b["tau"]:
                entry[kind or "overall"] = {"tau_ratio": g["tau"] / b["tau"], "glance_tau": g["tau"],
                                            "eagle3_tau": b["tau"], "glance_passes": g["draft_passes_per_round"],
                                            "eagle3_passes": b["draft_passes_per_round"],
                                            "glance_draft_ms": _draft_ms(g), "eagle3_draft_ms": _draft_ms(b),
                                            "glance_tok_s": g["tok_s"]["median"], "eagle3_tok_s": b["tok_s"]["median"],
                                            "speed_ratio": _quartiles(_ratios(records, glance, e, kind))["median"]}
        out[f"{glance} vs {e}"] = entry
    return out


def _chain_vs_tree(records: list[Record]) -> dict:
    """Per kind: is the chain faster than the best tree (median per-prompt ratio)? The law's boundary."""
    out = {}
    trees = sorted({r.method for r in records if r.method.startswith("tree-")})
    for kind in dict.fromkeys(r.kind for r in records):
        best = None
        for t in trees:
            q = _quartiles(_ratios(records, "chain", t, kind))["median"]
            if q is not None and (best is None or q < best[1]):
                best = (t, q)
        if best is not None:
            out[kind] = {"best_tree": best[0], "chain_over_best_tree": best[1], "chain_wins": best[1] > 1.0}
    return out


# ----------------------------------------------------------------------------- outputs


def _fmt(q: dict) -> str:
    if q["median"] is None:
        return "–"
    return f"{q['median']:.2f} ({q['p25']:.2f}–{q['p75']:.2f})"


def markdown(report: dict) -> str:
    lines = [f"# glance-rt bench — {report['target']} ({report['dtype']}, {report['device']}, "
             f"{report['torch_threads']} threads) — {report['date']}", ""]
    mach = report.get("machine")
    if mach:
        lines += [f"Machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']}.", ""]
    sampling = report["config"].get("sampling") or {}
    if sampling.get("do_sample"):
        knobs = ", ".join(f"{k} {sampling[k]}" for k in ("temperature", "top_k", "top_p", "min_p",
                                                        "repetition_penalty", "seed") if sampling[k] is not None)
        lines += [f"Sampling ({knobs}); every output checked against {report['reference']} "
                  "(HF samples with its own RNG: timed, not compared).", ""]
    if report["partial"]:
        lines += ["**Partial report (interrupted).**", ""]
    if report["mismatches"]:
        lines += [f"**{len(report['mismatches'])} OUTPUT MISMATCH(ES) vs {report['reference']}:** "
                  f"{report['mismatches']}", ""]
    lines += ["| method | tok/s | × same-engine AR | × HF generate | × its eager method | τ | "
              "draft passes / lookup rounds per round | "
              "TTFT s | mismatches |", "|---|---|---|---|---|---|---|---|---|"]
    for m, s in report["overall"].items():
        tau = f"{s['tau']:.2f}" if s["tau"] is not None else "–"
        dpr = "–" if s["draft_passes_per_round"] is None else (
            f"{s['draft_passes_per_round']:.2f} / {s.get('lookup_rounds_per_round') or 0.0:.2f}")
        eager = _fmt(s["speedup_vs_eager"]) if s.get("speedup_vs_eager") else "–"
        lines.append(f"| {m} | {_fmt(s['tok_s'])} | {_fmt(s['speedup_vs_ar'])} | {_fmt(s['speedup_vs_hf'])} | "
                     f"{eager} | {tau} | {dpr} | {_fmt(s['ttft'])} | {s['mismatches']} |")
    own = [f"{m} vs {s['ar_method']}" for m, s in report["overall"].items()
           if s.get("ar_method", "ar") not in ("ar", m)]
    lines += ["", "Same-engine AR is eager `ar`, except: " + "; ".join(own) + "."] if own else []
    for pair, kinds in (report.get("glance_vs_eagle3") or {}).items():
        if kinds:
            lines += ["", f"GLANCE against EAGLE-3 at equal budget ({pair}): accepted length per drafted round, "
                      "draft passes and drafting ms per round, tokens/s (median) and GLANCE's speed over "
                      "EAGLE-3's (median per-prompt ratio):", "",
                      "| kind | GLANCE τ | EAGLE-3 τ | τ ratio | passes GLANCE / EAGLE-3 | draft ms GLANCE / EAGLE-3 "
                      "| tok/s GLANCE / EAGLE-3 | speed ratio |", "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {k} | {e['glance_tau']:.2f} | {e['eagle3_tau']:.2f} | {e['tau_ratio']:.2f} | "
                      f"{e['glance_passes']:.2f} / {e['eagle3_passes']:.2f} | {_num(e.get('glance_draft_ms'))} / "
                      f"{_num(e.get('eagle3_draft_ms'))} | {_num(e.get('glance_tok_s'))} / "
                      f"{_num(e.get('eagle3_tok_s'))} | {_num(e.get('speed_ratio'))} |" for k, e in kinds.items()]
    lines += ["", "Per kind, median speedup over same-engine AR (per-prompt ratios):", "",
              "| kind | " + " | ".join(report["overall"]) + " |", "|---" * (len(report["overall"]) + 1) + "|"]
    for kind, ms in report["kinds"].items():
        lines.append(f"| {kind} | " + " | ".join(_fmt(s["speedup_vs_ar"]) for s in ms.values()) + " |")
    kernels = {m: kernel_line(k) for m, k in (report.get("kernels") or {}).items() if k}
    if kernels:
        lines += ["", "Linear-layer kernels (torch's own, oneDNN-prepacked or MKL over a transposed copy, chosen "
                  "per shape and row class; `glance_rt.models.kernels`):", ""]
        lines += [f"- {m}: {line}" for m, line in kernels.items()]
    for name, e in (report.get("engines") or {}).items():
        where = "an unrecorded CPU" if e["built_on"] is None else e["built_on"]
        per_graph = (" (" + ", ".join(f"{g} {f}" for g, f in e["graphs"].items()) + ")"
                     if e["flavor"] == "mixed" and e.get("graphs") else "")
        lines += ["", f"Engine {name}: flavor {e['flavor']}{per_graph} ({e['chosen_by'] or 'not recorded'}), "
                  f"built on {where}"
                  + (" — **not this CPU: its kernel choice was made for another**" if e["same_cpu"] is False else "")]
    foot = {m: f for m, f in (report.get("footprint_mb") or {}).items() if f.get("added") is not None}
    if foot:
        lines += ["", "Memory each method's runner added when made, in the order made (MB; the first Decoder on the "
                  "target also makes the prepared weight copies later ones share), and its static caches: "
                  + "; ".join(f"{m} +{f['added']:.0f}" + (f" (caches {f['caches']:.0f})" if f["caches"] else "")
                              for m, f in foot.items())]
    if report["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{m}: {why}" for m, why in report["skipped"].items())]
    return "\n".join(lines) + "\n"


def kernel_line(choices: dict) -> str:
    """`verify: oneDNN for 1536x576, 49152x576 at 9 rows; MKL over the transposed weight for 49152x576 at 1 rows
    (3 of 5 shapes; the rest torch's own); draft: ...` from `Decoder.kernel_choices` (shape -> kernel, or
    -> {rows: kernel} where the row classes differ)."""
    names = {"onednn": "oneDNN", "mkl_t": "MKL over the transposed weight"}
    parts = []
    for pass_name, shapes in choices.items():
        picked: dict[str, list[str]] = {k: [] for k in names}
        others = set()
        for shape, k in shapes.items():
            if isinstance(k, dict):
                for kernel in names:
                    rows = sorted((r for r, kk in k.items() if kk == kernel), key=_rows_order)
                    if rows:
                        picked[kernel].append(f"{shape} at {', '.join(map(str, rows))} rows")
                        others.add(shape)
            elif k in names:
                picked[k].append(shape)
                others.add(shape)
        said = "; ".join(f"{names[k]} for {', '.join(v)}" for k, v in picked.items() if v) or "none"
        parts.append(f"{pass_name}: {said} ({len(others)} of {len(shapes)} shapes; the rest torch's own)")
    return "; ".join(parts)


def _rows_order(rows) -> int:
    rows = str(rows)  # an int, or its JSON string
    return int(rows) if rows.isdigit() else 1 << 30


def plots(report: dict, folder) -> list[Path]:
    """speedup.png (per method and kind), tau_hist.png, tau_vs_entropy.png, and glance_vs_eagle3.png where
    the run sets tree-N against eagle3-N."""
    require("plot", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    methods = [m for m in report["overall"] if m != "ar"]
    kinds = list(report["kinds"])
    out = []

    fig, ax = plt.subplots(figsize=(min(max(6, 0.3 * len(methods) * max(len(kinds), 1)), 14), 5))
    width = 0.8 / max(len(kinds), 1)
    for j, kind in enumerate(kinds):
        vals = [report["kinds"][kind][m]["speedup_vs_ar"]["median"] or 0 for m in methods]
        ax.bar(np.arange(len(methods)) + j * width, vals, width, label=kind)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(methods)) + width * (len(kinds) - 1) / 2, methods, rotation=25, ha="right")
    ax.set_ylabel("median speedup over same-engine AR")
    _legend(ax)
    ax.set_title(f"{report['target']} — speedup per method and kind")
    out.append(_save(fig, folder / "speedup.png"))

    drafted = [m for m in methods if report["overall"][m]["tau_hist"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in drafted:
        h = np.asarray(report["overall"][m]["tau_hist"], float)
        ax.plot(np.arange(len(h)), h / max(h.sum(), 1), marker="o", label=f"{m} (τ={report['overall'][m]['tau']:.2f})")
    ax.set_xlabel("tokens committed per round")
    ax.set_ylabel("fraction of rounds")
    _legend(ax)
    ax.set_title("accepted length per round")
    out.append(_save(fig, folder / "tau_hist.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    main = max(drafted, key=lambda m: report["overall"][m]["tau"] or 0, default=None)
    for kind in kinds:
        pts = [(e, a) for r in report["records"] if r["method"] == main and r["kind"] == kind
               for e, a in zip(r["root_entropy"], r["accepted_lengths"], strict=True)]
        if not pts:
            continue
        x, y = np.asarray(pts).T
        dots = ax.scatter(x, y + np.random.default_rng(0).uniform(-0.15, 0.15, len(y)), s=6, alpha=0.4, label=kind)
        law = report["kinds"][kind][main]["entropy_law"]
        if law["slope"] is not None:
            xs = np.linspace(x.min(), x.max(), 20)
            ax.plot(xs, law["intercept"] + law["slope"] * xs, color=dots.get_facecolor()[0], lw=2)
    ax.set_xlabel("target next-token entropy at the root (nats)")
    ax.set_ylabel("tokens committed per round")
    ax.set_title(f"the entropy law ({main})")
    _legend(ax)
    out.append(_save(fig, folder / "tau_vs_entropy.png"))
    pairs = [pair.split(" vs ") for pair, kinds in (report.get("glance_vs_eagle3") or {}).items() if kinds]
    if pairs:  # the entropy law of GLANCE and of EAGLE-3 at each equal budget, every kind together
        fig, ax = plt.subplots(figsize=(6, 4))
        for pair in pairs:
            for m in pair:
                pts = [(e, a) for r in report["records"] if r["method"] == m
                       for e, a in zip(r["root_entropy"], r["accepted_lengths"], strict=True)]
                if not pts:
                    continue
                x, y = np.asarray(pts).T
                dots = ax.scatter(x, y + np.random.default_rng(1).uniform(-0.15, 0.15, len(y)), s=6, alpha=0.3)
                law = report["overall"][m]["entropy_law"]
                if law["slope"] is not None:
                    xs = np.linspace(x.min(), x.max(), 20)
                    ax.plot(xs, law["intercept"] + law["slope"] * xs, color=dots.get_facecolor()[0], lw=2,
                            label=f"{m} (τ={report['overall'][m]['tau']:.2f})")
        ax.set_xlabel("target next-token entropy at the root (nats)")
        ax.set_ylabel("tokens committed per round")
        ax.set_title("the entropy law: GLANCE against EAGLE-3")
        _legend(ax)
        out.append(_save(fig, folder / "glance_vs_eagle3.png"))
    return out


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _save(fig, path: Path) -> Path:
    atomic_write(path, lambda p: fig.savefig(p, dpi=110, bbox_inches="tight", format="png"))
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_outputs(report: dict, json_out=None, report_md=None, plot_dir=None) -> list[Path]:
    written = []
    if json_out:
        write_json(json_out, report)
        written.append(Path(json_out))
    if report_md:
        atomic_write(Path(report_md), lambda p: p.write_text(markdown(report)))
        written.append(Path(report_md))
    if plot_dir:
        written += plots(report, plot_dir)
    return written

