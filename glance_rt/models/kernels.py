"""Which kernel runs each linear layer, chosen by measuring this machine.

A round's linear layers are GEMMs of a few rows (a tree of budget+1 rows, a draft block, one row in
autoregression) plus the prompt's prefill. Which kernel is fastest at those shapes depends on the
CPU: MKL's fp32 GEMM (torch's own `linear`) was ~2x slower than oneDNN's prepacked kernel
(`glance::packed_linear`) at a round's shapes on an AMD EPYC, and ~30% faster on an Intel Xeon,
where MKL in turn ran the 49,152-row head at one row ~1.7x faster over a transposed copy of the
weight than over the weight as it lies. So no rule is fixed here: `KernelTuner` times the kernels
(`KERNELS`) for each (weight shape, row class, dtype) the decoder will run, keeps the fastest (any
other than torch's own only when it beats it by `margin`: never slower than the plain kernel), and
caches the timings in a JSON file keyed by the machine (CPU model, cores, torch threads, torch /
MKL / oneDNN versions), so the cost (a few seconds for a model's handful of shapes) is paid once
per machine.

`KernelPlan` is the result for one pass: a pass keeps one module set per row class, and
`plan.linear(nn.Linear, rows)` gives the class's module: the nn.Linear itself (MKL), a
`PackedLinear` (oneDNN) or a `TransposedLinear` (MKL over the transposed weight). Every kernel
computes the same product (other summation order, fp32 rounding): the tokens are those of HF
greedy whichever is chosen (tested with forced and mixed plans).
"""

import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glance_rt.errors import GlanceWarning
from glance_rt.files import atomic_write, cache_root
from glance_rt.models.linear import PackedLinear, TransposedLinear, can_pack

# mkl: torch's own linear (MKL's GEMM over the weight [out, in] as it lies); mkl_t: MKL's GEMM over a
# transposed copy [in, out] (`TransposedLinear`); onednn: glance::packed_linear (oneDNN-prepacked weight)
KERNELS = ("mkl", "mkl_t", "onednn")
PREFILL_ROWS = 64  # the row class of prefill and long context passes
# 2: weights timed cold (time_linear); 3: + mkl_t; 4: every kernel timed through its module
# (`kernel_module`), torch's own too. A file of another format is re-timed. A machine's entry holds
# "timings" (one linear layer) and "passes" (a whole pass, `KernelTuner.pass_times`)
CACHE_FORMAT = 4


def kernel_module(kernel: str, linear: nn.Linear, layout_rows: int) -> nn.Module:
    """The module that computes `linear` with `kernel` (one of `KERNELS`): the nn.Linear itself
    ("mkl"), a `TransposedLinear` ("mkl_t") or a `PackedLinear` laid out for `layout_rows` rows
    ("onednn"). The one place a kernel's name becomes a module (timing, plans)."""
    if kernel == "mkl":
        return linear
    if kernel == "mkl_t":
        return TransposedLinear(linear.weight, linear.bias)
    if kernel == "onednn":
        return PackedLinear(linear.weight, linear.bias, layout_rows)
    raise ValueError(f"unknown kernel {kernel!r}: one of {KERNELS}")


# ----------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    """The CPU's model name with its family/model/stepping numbers (`/proc/cpuinfo` on Linux; a
    virtual machine often names every CPU alike, "Intel(R) Xeon(R) Processor"), else
    `platform.processor()`."""
    try:
        info = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first CPU is enough
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
        if "model name" in info:
            ids = ", ".join(f"{name} {info[key]}" for key, name in
                            (("cpu family", "family"), ("model", "model"), ("stepping", "stepping")) if key in info)
            return f"{info['model name']} ({ids})" if ids else info["model name"]
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _library_versions() -> dict:
    cfg = torch.__config__.show()
    keys = ("Math Kernel Library", "MKL-DNN", "oneDNN", "OneDNN", "CPU capability")  # not the build flags
    libs = [line.strip(" -") for line in cfg.splitlines()
            if any(k in line for k in keys) and not line.strip(" -").startswith("Build settings")]
    return {"torch": torch.__version__, "libraries": libs}


def machine() -> dict:
    """What kernel timings depend on: CPU model, cores, torch threads, torch / MKL / oneDNN versions."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), **_library_versions()}


def machine_key(m: dict) -> str:
    return hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_path() -> Path:
    """`kernels.json` in `glance_rt.files.cache_root()`."""
    return cache_root() / "kernels.json"


# ----------------------------------------------------------------------------- timing


COLD_BYTES = 256 << 20  # weight copies cycled through while timing: more than any CPU cache


def time_calls(calls: dict[str, Callable[[], object]], budget_s: float, max_reps: int, warmup: int = 3,
               min_reps: int = 5) -> dict[str, float]:
    """Median seconds of each of `calls` ({name: fn()}). They take turns (interleaved, so a load change
    hits all): `warmup` calls each, then until each has run `budget_s` or `max_reps` calls (at least
    `min_reps`)."""
    with torch.inference_mode():
        for fn in calls.values():
            for _ in range(warmup):
                fn()
        times: dict[str, list[float]] = {k: [] for k in calls}
        spent = dict.fromkeys(calls, 0.0)
        reps = 0
        while reps < max_reps and (reps < min_reps or min(spent.values()) < budget_s):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                times[name].append(dt)
                spent[name] += dt
            reps += 1
    return {k: statistics.median(v) for k, v in times.items()}


def time_linear(out_features: int, in_features: int, rows: int, dtype: torch.dtype,
                budget_s: float = 0.03, max_reps: int = 41, cold_bytes: int = COLD_BYTES) -> dict:
    """Median seconds per call of each kernel (`KERNELS`) for x [rows, in] @ W[out, in].T on this CPU,
    with the weight cold as it is in a decoder pass (each layer's weight is read once per pass, and a
    model's weights outgrow the caches): every call takes the next of enough copies of the weight to
    fill `cold_bytes`, the oldest first (`time_calls`: interleaved, 3 warm-up calls each)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g, dtype=torch.float32).to(dtype)
    x = torch.randn(1, rows, in_features, generator=g, dtype=torch.float32).to(dtype)
    copies = max(1, min(max_reps + 3, -(-cold_bytes // (w.numel() * w.element_size()))))
    plain = [nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False, dtype=dtype) for _ in range(copies)]
    with torch.no_grad():
        for lin in plain:
            lin.weight.copy_(w)
    modules = {k: [kernel_module(k, lin, rows) for lin in plain] for k in KERNELS}
    calls = dict.fromkeys(KERNELS, 0)

    def run(kernel: str):
        i = calls[kernel] % copies
        calls[kernel] += 1
        return modules[kernel][i](x)

    return time_calls({k: (lambda k=k: run(k)) for k in KERNELS}, budget_s, max_reps)


def time_pass(key: str, runs: dict[str, Callable[[], object]], budget_s: float = 0.4, max_reps: int = 41) -> dict:
    """Median seconds of each way (`runs`: {"plan": fn, "plain": fn}) of running the pass `key` names:
    `time_calls` with 2 warm-up calls and at least 7 timed calls each."""
    return time_calls(runs, budget_s, max_reps, warmup=2, min_reps=7)


def linear_invariance(linear, x: Tensor, w: Tensor, rows=(2, 3, 8, 9, 16, 17, 33)) -> dict[int, int]:
    """{T: elements of `linear(x[:T], w)` that differ from the same rows computed one row per call}
    for each T in `rows` (0 everywhere: row-invariant for these shapes)."""
    out = {}
    with torch.no_grad():
        alone = torch.cat([linear(x[i : i + 1], w) for i in range(max(rows))])  # [max T, out]
        for t in rows:
            out[t] = int((linear(x[:t], w) != alone[:t]).sum())
    return out


def row_invariance(kernel: str, out_features: int, in_features: int, layout_rows: int, rows: int,
                   dtype: torch.dtype, bias: bool) -> dict:
    """{"differs_at": T}: the least row count T <= `rows` at which a call of `kernel` ("onednn": oneDNN's
    prepacked kernel laid out for `layout_rows` rows; "mkl": torch's own linear) gives some row other bits
    than a one-row call gives it, on this machine, for a random weight [out, in] (and bias) of `dtype`; 0
    where none does (`linear_invariance`): the kernel's order of summation per output element is then the
    same whatever a call's rows, and exact numerics run whole calls of up to `rows` rows instead of padded
    blocks. Random data suffice: the order does not depend on the data, and a different order shows in
    some of a row's elements."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(out_features, in_features, generator=g, dtype=torch.float32).to(dtype)
    b = torch.randn(out_features, generator=g, dtype=torch.float32).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=g, dtype=torch.float32).to(dtype)
    run = PackedLinear(w, b, layout_rows) if kernel == "onednn" else (lambda x: F.linear(x, w, b))
    return {"differs_at": first_difference(lambda x, _w: run(x), x, w)}


def first_difference(linear, x: Tensor, w: Tensor) -> int:
    """The least row count T <= len(x) whose call `linear(x[:T], w)` gives some row other bits than a
    one-row call of it (`linear_invariance`), 0 if none."""
    diff = linear_invariance(linear, x, w, range(2, x.shape[0] + 1))
    return min((t for t, n in diff.items() if n), default=0)


# ----------------------------------------------------------------------------- the tuner


SECTION_NAMES = {"timings": "kernels", "passes": "passes both ways", "invariance": "kernels' row invariance"}


def progress_bar(items: list, desc: str):
    """items, with a progress bar (rate, ETA) on stderr while there are several: timing a new target's
    kernels can take a minute on a small CPU, and nothing else would show."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, disable=len(items) < 2, leave=False, dynamic_ncols=True)


@dataclass(frozen=True)
class KernelTuner:
    """Chooses a kernel per (weight shape, rows, dtype) by timing (`timer(out, in, rows, dtype)` ->
    {kernel: s} over `KERNELS`, "mkl" always among them), then checks each pass as a whole
    (`pass_timer(key, {"plan": fn, "plain": fn})` -> {"plan": s, "plain": s}: the pass with the
    chosen kernels against torch's own linear everywhere, `glance_rt.round.passcheck`). Timings are
    cached in `cache` (None: `default_cache_path()`; False: no file) under the key of `machine()`, so
    a change of CPU, threads or library version re-times. `margin`: a kernel other than torch's own
    ("mkl") is chosen only when it is at least this fraction faster; `pass_margin`: a pass keeps its
    chosen kernels only when it is at least this fraction faster than the plain pass. `prober(kernel, out,
    in, layout rows, rows, dtype, bias)` -> {"differs_at": M}: whether a kernel is row-invariant on this
    machine (`row_invariance`; exact numerics, `glance_rt.models.target.invariant_kernel`), cached likewise."""

    timer: Callable = time_linear
    cache: Path | bool | None = None
    margin: float = 0.03
    pass_timer: Callable = time_pass
    pass_margin: float = 0.01
    prober: Callable = row_invariance
    _memo: dict = field(default_factory=dict, compare=False, repr=False)  # {section: {entry key: timing}}

    def _path(self) -> Path | None:
        if self.cache is False:
            return None
        return default_cache_path() if self.cache in (None, True) else Path(self.cache)

    def _read(self, path: Path | None) -> dict:
        """The cache file's contents ({} when absent, unreadable or of another format: re-time)."""
        if path is None or not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}  # unreadable cache: re-time (and rewrite it)
        return data if data.get("format") == CACHE_FORMAT else {}

    def timings(self, requests: list[tuple[int, int, int, torch.dtype]]) -> dict:
        """{(out, in, rows, dtype): {kernel: s}} for every request, timing only what
        neither this tuner nor the cache file holds; new timings are written back (atomically). The
        file is read only when this tuner lacks a request, and then all of its valid timings for this
        machine are kept, so building a decoder's layers reads it about once."""
        requests = list(dict.fromkeys(requests))
        got = self._cached("timings", {_entry(*req): (lambda req=req: self.timer(*req)) for req in requests},
                           lambda t: _valid(t, KERNELS))
        return {req: got[_entry(*req)] for req in requests}

    def pass_times(self, key: str, runs: dict[str, Callable[[], object]]) -> dict[str, float]:
        """{"plan": s, "plain": s}: the pass `key` names run both ways (`runs`), timed once per machine."""
        return self._cached("passes", {key: lambda: self.pass_timer(key, runs)}, lambda t: _valid(t, PASS_WAYS))[key]

    def invariance(self, request: tuple) -> bool:
        """Whether a kernel gives every row of a call of up to `rows` rows a one-row call's bits, for
        `request` = (kernel, out, in, layout rows, rows, dtype, bias) (`row_invariance`), probed once per
        machine."""
        kernel, out_f, in_f, layout, rows, dtype, bias = request
        how = f"layout{layout}" if kernel == "onednn" else kernel
        key = f"{_entry(out_f, in_f, rows, dtype)}/{how}{'+bias' if bias else ''}"
        got = self._cached("invariance", {key: lambda: self.prober(*request)},
                           lambda t: isinstance(t, dict) and isinstance(t.get("differs_at"), int))
        return got[key]["differs_at"] == 0

    def _cached(self, section: str, wanted: dict[str, Callable[[], dict]], valid: Callable) -> dict[str, dict]:
        """{name: timing} for `wanted` ({name: fn timing it}), from this tuner's memo, else the cache
        file's `section` for this machine, else timed now and written back."""
        memo = self._memo.setdefault(section, {})
        missing = [name for name in wanted if name not in memo]
        if missing:
            m = machine()
            path = self._path()
            data = self._read(path)
            entries = data.setdefault("machines", {}).setdefault(machine_key(m), {"machine": m})
            entries = entries.setdefault(section, {})
            memo.update({name: t for name, t in entries.items() if valid(t) and name not in memo})
            new = [name for name in missing if name not in memo]
            for name in progress_bar(new, f"timing {SECTION_NAMES.get(section, section)} (once per machine)"):
                entries[name] = memo[name] = wanted[name]()
            if new and path is not None:
                data["format"] = CACHE_FORMAT
                try:
                    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1, sort_keys=True)))
                except OSError as e:  # an unwritable cache costs a re-timing next time, nothing else
                    warnings.warn(f"could not write the kernel timing cache {path} ({e}); set GLANCE_RT_CACHE to a "
                                  "writable folder to keep them", GlanceWarning, stacklevel=4)
        return {name: memo[name] for name in wanted}

    def choose(self, timing: dict) -> str:
        """The fastest kernel of `timing` ({kernel: s}, "mkl" among them); "mkl" unless another beats
        it by the margin (a tie goes to the kernel listed first in `KERNELS`)."""
        best = min(sorted(timing, key=KERNELS.index), key=timing.__getitem__)
        return best if timing[best] < (1 - self.margin) * timing["mkl"] else "mkl"

    def keeps_plan(self, times: dict) -> bool:
        """Whether a pass keeps its chosen kernels: faster than the plain pass by `pass_margin`."""
        return times["plan"] < (1 - self.pass_margin) * times["plain"]


PASS_WAYS = ("plan", "plain")


def _valid(timing, names: tuple[str, ...]) -> bool:
    return isinstance(timing, dict) and set(timing) == set(names) and all(
        isinstance(v, (int, float)) and v > 0 for v in timing.values())


def _entry(out_features: int, in_features: int, rows: int, dtype: torch.dtype) -> str:
    return f"{out_features}x{in_features}@{rows}:{str(dtype).removeprefix('torch.')}"


# ----------------------------------------------------------------------------- plans


def nearest_class(rows: int, classes: tuple[int, ...]) -> int:
    """The row class closest to `rows` in log scale (ties: the smaller class), exactly: `rows` is
    nearer the smaller of two neighbouring classes a < b when rows² <= a·b."""
    ordered = tuple(sorted(set(classes)))
    return ordered[class_index(rows, ordered)]


@dataclass(frozen=True)
class KernelPlan:
    """How one pass's linear layers run. `tuner` None: oneDNN-prepacked everywhere (`prepack=True`);
    else each weight shape gets, per row class in `classes`, the kernel `tuner` measured faster.
    `layout_rows`: the row count oneDNN's packed layout is laid out for.

    A pass runs several row counts (a round's rows, prefill), so it holds one module set per row
    class (`row_classes`) and picks the set once per call by its row count: each linear layer is
    then the chosen kernel's module itself, with no per-layer dispatch (that cost ≈ 1.7 µs a call,
    ≈ 0.8% of a one-row decode step, measured). `linear(module, rows)` makes each (weight, kernel)
    layout once, shared by the classes that choose it, and by every plan given the same `layouts` (a
    target's `Target.layouts`: Decoders on one target hold one copy of each prepared weight)."""

    layout_rows: int
    classes: tuple[int, ...] = ()
    tuner: KernelTuner | None = None
    plain: frozenset[int] = frozenset()  # row classes whose whole pass ran no faster than plain: torch's own
    # the weight layouts made: (id(weight), kernel, layout rows) -> (weight, module); pass a target's
    # `layouts` to share them with every plan on that target (every Decoder's passes)
    layouts: dict = field(default_factory=dict, compare=False, repr=False)

    def made_plain(self, classes) -> "KernelPlan":
        """This plan with torch's own linear everywhere at `classes` (and the layouts made so far)."""
        return replace(self, plain=frozenset(classes), layouts=self.layouts)

    def row_classes(self) -> tuple[int, ...]:
        """The row classes this plan makes module sets for, ascending."""
        return (self.layout_rows,) if self.tuner is None else tuple(sorted({*self.classes, self.layout_rows}))

    def kernels(self, weight: Tensor) -> dict[int, str]:
        """{rows class: kernel} for a weight [out, in]."""
        if self.tuner is None:
            return {self.layout_rows: "onednn"}
        out_f, in_f = weight.shape
        classes = self.row_classes()
        times = self.tuner.timings([(out_f, in_f, r, weight.dtype) for r in classes])
        return {r: "mkl" if r in self.plain else self.tuner.choose(times[(out_f, in_f, r, weight.dtype)])
                for r in classes}

    def linear(self, module: nn.Module, rows: int) -> nn.Module:
        """The module that runs `module` at `rows` rows (its nearest row class's kernel): itself (MKL,
        or not a packable nn.Linear), a `TransposedLinear` (MKL over the transposed weight) or a
        `PackedLinear` (oneDNN). The same weight and kernel give the same module, whatever the class."""
        if not (isinstance(module, nn.Linear) and can_pack(module.weight)):
            return module
        ks = self.kernels(module.weight)
        kernel = ks[nearest_class(rows, tuple(ks))]
        return module if kernel == "mkl" else self.kernel(module, kernel)

    def kernel(self, module: nn.Linear, kernel: str) -> nn.Module:
        """`module` run by `kernel` (oneDNN: laid out for `layout_rows`), made once per weight and layout."""
        # the value keeps the weight alive, so its id stays its own; only oneDNN's layout depends on the rows
        key = (id(module.weight), kernel, self.layout_rows if kernel == "onednn" else 0)
        if key not in self.layouts:
            self.layouts[key] = (module.weight, kernel_module(kernel, module, self.layout_rows))
        return self.layouts[key][1]


def with_plan(plan: KernelPlan | None, module: nn.Module, rows: int) -> nn.Module:
    """`plan.linear(module, rows)`, or the module itself when there is no plan (the plain kernels)."""
    return module if plan is None else plan.linear(module, rows)


def class_index(rows: int, classes: tuple[int, ...]) -> int:
    """The index in `classes` (ascending) of `nearest_class(rows, classes)`: how a pass picks its module
    set. Integer compares only (rows <= the geometric mean of neighbouring classes), and none for one
    class, so a dynamic row count (an exported or compiled prefill) gets a range guard, not a constant."""
    for i in range(len(classes) - 1):
        if rows * rows <= classes[i] * classes[i + 1]:
            return i
    return len(classes) - 1


def kernel_of(module: nn.Module) -> str | None:
    """The kernel (`KERNELS`) a module runs its product with; None: not a linear layer."""
    return ("onednn" if isinstance(module, PackedLinear) else "mkl_t" if isinstance(module, TransposedLinear)
            else "mkl" if isinstance(module, nn.Linear) else None)


def kernel_summary(by_class: dict[int, list[nn.Module]]) -> dict:
    """{"OUTxIN": kernel or {rows class: kernel}} for the linear layers a pass runs at each row class
    ({rows class: [modules]}); a shape that runs one kernel at every class gets the kernel's name."""
    runs: dict[str, dict[int, str]] = {}
    for rows, modules in by_class.items():
        for m in (m for top in modules for m in top.modules()):
            kernel = kernel_of(m)
            if kernel is not None:
                runs.setdefault(_shape(m), {})[rows] = kernel
    return {shape: ks.popitem()[1] if len(set(ks.values())) == 1 else dict(sorted(ks.items()))
            for shape, ks in runs.items()}


def pass_key(name: str, modules: list[nn.Module]) -> str:
    """A pass's key in the timing cache: `name` (the pass and how it is timed) and a digest of the
    modules it runs (every submodule's type, each linear layer's shape and kernel, the dtype)."""
    layout = [[type(m).__name__, *((_shape(m), kernel_of(m)) if kernel_of(m) is not None else ())]
              for top in modules for m in top.modules()]
    dtypes = sorted({str(t.dtype) for top in modules for t in (*top.parameters(), *top.buffers())})
    return f"{name}:{hashlib.sha256(json.dumps([layout, dtypes]).encode()).hexdigest()[:16]}"


def _shape(linear: nn.Module) -> str:  # an nn.Linear, a PackedLinear or a TransposedLinear
    return f"{linear.out_features}x{linear.in_features}"
