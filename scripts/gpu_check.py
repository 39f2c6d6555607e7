"""The GPU check: ONE script for a lent GPU machine (10 minutes at most), printing figures and writing
them as JSON. Run it through `scripts/gpu_check.sh` there (it installs what travels with the tree);
docs/gpu_check.md says how, and what the JSON holds.

    python scripts/gpu_check.py --out DIR       # on the GPU machine
    python scripts/gpu_check.py --cpu           # here: every section at toy sizes on CPU (checks the script)

Sections, in order, each under one deadline (a failure is recorded and the next section runs):
  kernel     the Triton tree-attention kernel == the torch reference; captured in a CUDA graph it follows
             prefix_len written on the device; its time against the reference op at real shapes
  lossless   tiny random models of every architecture in fp32: eager (all) and compiled (--compile-archs)
             GLANCE give Hugging Face greedy's tokens; the compiled decoder takes new prompts with no recompile
  timings    Qwen2.5-VL-3B's and -7B's text decoders (random weights: timing only) in bf16: AR step, draft,
             verify and round at --budgets, compiled (eager: the AR step); the 3B's top ops per pass
             (torch profiler); HF generate's static-cache step on the same model; the ratios
  gpu_tests  `pytest -m gpu` against the INSTALLED package (from a copy of tests/ outside the repository)
  real       --target/--drafter on held-out prompts: GLANCE vs the same engine's AR vs HF static greedy,
             bf16 and fp32: tokens/s, tau, exactness (counted)
  tensorrt   when tensorrt imports: a TensorRT engine of a tiny model gives HF greedy's tokens

Tools (no GPU): --plan (the wheels --prepare carries), --size, --split/--stage (weights in parts).
"""

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # tests/ (tiny models) travel with the tree; glance_rt comes installed

QWEN25_VL_3B_TEXT = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, max_position_embeddings=32768)
QWEN25_VL_7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, max_position_embeddings=32768)
MODELS = {"qwen2.5-vl-3b": QWEN25_VL_3B_TEXT, "qwen2.5-vl-7b": QWEN25_VL_7B_TEXT}
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=512, rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096)
H200_BANDWIDTH = 4.8e12  # bytes/s (HBM3e)


# ------------------------------------------------------------------------------- what travels (--prepare)

GPU_PYTHON = "3.12"  # the GPU image's python3
ROOT_EXTRAS = ("gguf",)  # glance-rt's extras the check imports (`real` loads GGUF targets)
# On the GPU image: never carried (docs/gpu_check.md). Known versions (KINDS.md's pip list, the 2026-12-04
# run): a package here is carried all the same when what the closure asks of it excludes this version.
IMAGE_VERSIONS = {"numpy": "2.5.2", "tokenizers": "0.23.2", "safetensors": "0.8.0", "accelerate": "1.15.0",
                  "huggingface-hub": "1.33.0", "transformers": "5.17.0"}
IMAGE_TORCH = ("torch", "triton", "nvidia-", "cuda-")  # the image's CUDA torch stack (names or prefixes)
# On the image, version not read, trusted: torch's own needs (a second copy under torch could break it)
# and what the 2026-12-04 run imported from the image. The device's `env.unmet` lists any that fall short.
IMAGE_ANY = ("filelock", "typing-extensions", "setuptools", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
             "fsspec", "pillow", "packaging", "pyyaml", "typer", "requests", "urllib3", "certifi",
             "charset-normalizer", "idna", "h11", "psutil")
OPTIONAL = {"hf-xet": "huggingface_hub imports it only to download from the Hub (no network there)",
            "kernels": "transformers imports it only where is_kernels_available() (Hub kernels: not used)"}
# (package, dependency) pins left unmet on purpose: tokenizers 0.23.2 (the image's) pins huggingface-hub<2.0,
# but calls it only to download; carrying tokenizers (3.2 MiB) would break the travel budget.
ACCEPTED = {("tokenizers", "huggingface-hub"): "tokenizers calls the hub only to download"}
TRAVEL_LIMIT = 60 * 2**20  # bytes: the tree + .gpu (the device tool takes 64 MiB a call)
PART_BYTES = 20 * 2**20


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_requirements(lines, extras=()) -> list:
    """The requirements (Requires-Dist lines) that hold on the GPU machine, with `extras` asked for."""
    from packaging.requirements import Requirement

    env = dict(python_version=GPU_PYTHON, python_full_version=GPU_PYTHON + ".3", platform_machine="x86_64",
               sys_platform="linux", platform_system="Linux", os_name="posix", implementation_name="cpython",
               platform_python_implementation="CPython")
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in ("", *extras))]


def dependency_graph(root: str, extras, requires) -> dict:
    """name -> [(dependency, specifier)] from `root` down, not into the image's torch stack."""
    graph, todo = {}, [(canon(root), tuple(extras))]
    while todo:
        name, ex = todo.pop()
        graph[name] = [(canon(r.name), str(r.specifier)) for r in gpu_requirements(requires(name) or [], ex)]
        for r in gpu_requirements(requires(name) or [], ex):
            dep = canon(r.name)
            if dep not in graph and not dep.startswith(IMAGE_TORCH) and all(dep != n for n, _ in todo):
                todo.append((dep, tuple(r.extras)))
    return graph


def image_reason(name: str, asked: list[str]) -> str | None:
    """Why the image's copy of `name` serves (None: carry it). `asked`: the specifiers on it."""
    from packaging.specifiers import SpecifierSet

    if name.startswith(IMAGE_TORCH):
        return "the image's CUDA torch stack"
    if name in IMAGE_ANY:
        return "on the image (version trusted)"
    if name in OPTIONAL:
        return "optional: " + OPTIONAL[name]
    v = IMAGE_VERSIONS.get(name)
    if v is not None and all(SpecifierSet(s).contains(v, prereleases=True) for s in asked):
        return f"on the image at {v}"
    return None


def wheel_plan(root="glance-rt", extras=ROOT_EXTRAS, requires=None, version=None) -> tuple[dict, dict]:
    """(carried: name -> this venv's version, excluded: name -> why): the closure of what `root` needs
    on the GPU machine, less what its image provides (importlib.metadata of this venv by default)."""
    requires, version = requires or importlib.metadata.requires, version or importlib.metadata.version
    graph = dependency_graph(root, extras, requires)
    asked = {}
    for deps in graph.values():
        for dep, spec in deps:
            asked.setdefault(dep, []).append(spec)
    excluded = {n: why for n in sorted(asked) if (why := image_reason(n, asked[n]))}
    carried, todo = {}, [canon(root)]
    while todo:  # only what a carried package needs: not what an excluded one alone needs
        for dep, _ in graph.get(todo.pop(), []):
            if dep not in excluded and dep not in carried:
                carried[dep] = version(dep)
                todo.append(dep)
    return dict(sorted(carried.items())), excluded


def unmet_requirements(carried) -> list[str]:
    """What glance-rt and the `carried` packages ask, or the image's packages ask of a carried one, and
    this environment does not meet (read on the GPU machine after the install; ACCEPTED left out)."""
    graph = dependency_graph("glance-rt", ROOT_EXTRAS, _requires)
    mine = set(carried) | {"glance-rt"}
    out = []
    for name, deps in graph.items():
        for dep, spec in deps:
            if dep.startswith(IMAGE_TORCH) or not (name in mine or dep in mine):
                continue
            try:
                have = importlib.metadata.version(dep)
            except importlib.metadata.PackageNotFoundError:
                have = None
            if have is None and dep not in OPTIONAL:
                out.append(f"{name} needs {dep}{spec}: not installed")
            elif have is not None and spec and not _contains(spec, have) and (name, dep) not in ACCEPTED:
                out.append(f"{name} needs {dep}{spec}: {have} installed")
    return out


def carried_names() -> list[str]:
    """The carried wheels' names (.gpu/plan.json, written by --prepare)."""
    plan = ROOT / ".gpu" / "plan.json"
    return list(json.loads(plan.read_text())["carried"]) if plan.is_file() else []


def _requires(name):
    try:
        return importlib.metadata.requires(name)
    except importlib.metadata.PackageNotFoundError:
        return []


def _contains(spec: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version.split("+")[0], prereleases=True)


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree that travels: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return sum(p.stat().st_size for n in set(out.split(b"\0")) if n and (p := root / os.fsdecode(n)).is_file())


def folder_bytes(path: Path) -> int:
    """Bytes under `path` (.gpu), less parts/: parts travel one call at a time (--split)."""
    files = [f for f in Path(path).rglob("*") if f.is_file() and "parts" not in f.relative_to(path).parts[:1]]
    return sum(f.stat().st_size for f in files)


def check_size(tree: int, gpu: int, limit: int = TRAVEL_LIMIT) -> str:
    """The travel line; SystemExit when tree + .gpu is over `limit`."""
    mib = 2**20
    line = f"travels: tree {tree / mib:.1f} MiB + .gpu {gpu / mib:.1f} MiB = {(tree + gpu) / mib:.1f} MiB"
    if tree + gpu > limit:
        raise SystemExit(f"{line}: over the {limit / mib:.0f} MiB budget (the device tool takes 64 MiB a call): "
                         "carry fewer wheels, or stage big files in parts (--split)")
    return f"{line} (budget {limit / mib:.0f} MiB)"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split_file(path: Path, out: Path, part_bytes: int = PART_BYTES) -> dict:
    """`path` as parts of at most `part_bytes` under `out`, with NAME.manifest.json (sha256 of each
    part and of the whole)."""
    path, out = Path(path), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{path.name}.part*"):  # an earlier split's
        old.unlink()
    parts = []
    with open(path, "rb") as f:
        for i, data in enumerate(iter(lambda: f.read(part_bytes), b"")):
            part = out / f"{path.name}.part{i:03d}"
            part.write_bytes(data)
            parts.append({"file": part.name, "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256(path), "parts": parts}
    (out / f"{path.name}.manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def stage_parts(src: Path, stage: Path) -> list[str]:
    """Copy the parts and manifests this call carried (`src`) into `stage`, kept between calls."""
    stage.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(Path(src).glob("*")) if Path(src).is_dir() else []:
        shutil.copyfile(f, stage / f.name)
        copied.append(f.name)
    return copied


def assemble(stage: Path) -> dict:
    """name -> its path once joined and checked, or what is still missing or wrong."""
    out = {}
    for mf in sorted(Path(stage).glob("*.manifest.json")):
        m = json.loads(mf.read_text())
        dest = Path(stage) / m["name"]
        if dest.is_file() and dest.stat().st_size == m["bytes"] and sha256(dest) == m["sha256"]:
            out[m["name"]] = str(dest)
            continue
        bad = [p["file"] for p in m["parts"] if not (Path(stage) / p["file"]).is_file()
               or sha256(Path(stage) / p["file"]) != p["sha256"]]
        if bad:
            out[m["name"]] = "missing or corrupt parts: " + ", ".join(bad)
            continue
        with open(dest, "wb") as f:
            for p in m["parts"]:
                f.write((Path(stage) / p["file"]).read_bytes())
        out[m["name"]] = str(dest) if sha256(dest) == m["sha256"] else "joined file's sha256 differs"
    return out


def tool_main(args) -> bool:
    """The modes that measure nothing (--prepare's helpers, staging). True when one ran."""
    if args.plan:
        carried, excluded = wheel_plan()
        Path(args.plan).write_text(json.dumps({"carried": carried, "excluded": excluded}, indent=1))
        print("\n".join(f"{n}=={v}" for n, v in carried.items()))
    elif args.size:
        print(check_size(tree_bytes(), folder_bytes(args.size)))
    elif args.split:
        tree = tree_bytes()
        part = int(args.part_mib * 2**20) if args.part_mib else min(PART_BYTES, (TRAVEL_LIMIT - tree) // 2**20 * 2**20)
        m = split_file(args.split, ROOT / ".gpu" / "parts", part)
        print(f"{m['name']}: {len(m['parts'])} parts of {part / 2**20:.0f} MiB under .gpu/parts/ (one a call)")
        print("a staging call", check_size(tree, part + 4096))
    elif args.stage:
        print("staged:", stage_parts(ROOT / ".gpu" / "parts", Path(args.stage)))
        print(json.dumps(assemble(Path(args.stage)), indent=1))
    else:
        return False
    return True


# ------------------------------------------------------------------------------------------------ the run


class Run:
    """The deadline, the report, and where it is written after every section."""

    def __init__(self, args):
        self.args, self.start, self.report = args, time.perf_counter(), {}
        self.device = torch.device("cpu" if args.cpu else "cuda")
        self.regions = args.regions == "on"  # the compile backend's layers as nested compile regions
        self.out = Path(args.out) / "gpu_check.json"

    def left(self) -> float:
        return self.args.deadline - (time.perf_counter() - self.start)

    def section(self, name: str, fn) -> None:
        t = time.perf_counter()
        print(f"\n== {name} ({self.left():.0f} s left)", flush=True)
        try:
            self.report[name] = fn(self)
        except Exception as e:  # record it and go on: one broken section must not hide the others' figures
            traceback.print_exc()
            self.report[name] = {"error": f"{type(e).__name__}: {e}"}
        self.report[name + "_wall_s"] = round(time.perf_counter() - t, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=2, default=str))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, reps: int | None = None) -> float:
        """Median seconds of fn() after two warm-up calls."""
        for _ in range(2):
            fn()
        out = []
        for _ in range(reps or self.args.reps):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - t)
        return statistics.median(out)


# ------------------------------------------------------------------------------------------------ kernel


def opt_in_attempt(fig: dict, name: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) for an opt-in launch setting not yet the op's default (`name`: "fused", the
    combine folded in; "path_rows", path programs of several rows), whose error of its own is a result, not
    a failure of the kernel section: recorded once as fig[f"{name}_error"], after which no call of that
    setting runs. -> fn's value, or None."""
    if f"{name}_error" in fig:
        return None
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        fig[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return None


def kernel_section(run: Run) -> dict:
    from glance_rt.models.attention import tree_attention_reference
    from glance_rt.plugins import tree_attention_triton as triton_kernel
    from tests.test_attention import random_tree_mask

    dev, fig, worst, same = run.device, {}, {}, {True: 0, False: 0}
    tol = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}
    if dev.type == "cpu":  # Triton's interpreter multiplies bf16 tiles as integers (tests/test_triton_kernel.py)
        del tol[torch.bfloat16]
    gen = torch.Generator().manual_seed(0)
    cases = [(4, 2, 1, 7, 16), (4, 4, 9, 13, 8), (12, 2, 17, 100, 32), (28, 4, 64, 1000, 128), (16, 2, 128, 513, 128)]
    for dtype in tol:
        for heads, kv_heads, t, prefix, d in cases:
            kv_len = prefix + t + 300  # spare splits past prefix + T
            q = torch.randn(1, heads, t, d, generator=gen)
            k, v = (torch.randn(1, kv_heads, kv_len, d, generator=gen) for _ in range(2))
            k[:, :, prefix + t :], v[:, :, prefix + t :] = float("nan"), float("nan")
            mask = random_tree_mask(t, gen)
            want = tree_attention_reference(q, k[:, :, : prefix + t], v[:, :, : prefix + t], mask,
                                            torch.tensor(prefix), d**-0.5)
            q, k, v, mask = (x.to(dev, dtype) if x.is_floating_point() else x.to(dev) for x in (q, k, v, mask))
            # the direct kernel (TensorRT's), the op's default splits, and many small splits
            for split_rows in (None, triton_kernel.SPLIT_ROWS, 32 if dev.type == "cuda" or prefix < 200 else None):
                got = triton_kernel.tree_attention(q, k, v, mask, torch.tensor(prefix, device=dev), d**-0.5,
                                                   split_rows)
                if split_rows is not None and prefix + t > split_rows:  # several splits: the fused combine too
                    fused = opt_in_attempt(fig, "fused", triton_kernel.tree_attention, q, k, v, mask,
                                           torch.tensor(prefix, device=dev), d**-0.5, split_rows, tune={"FUSED": True})
                    if fused is not None:
                        same[bool(torch.equal(fused, got))] += 1
                err = (got.float().cpu() - want).abs().max().item()
                key = str(dtype).removeprefix("torch.")
                worst[key] = max(worst.get(key, 0.0), err)
                if not err <= tol[dtype]:
                    raise AssertionError(f"kernel != reference: {key} H={heads} KVH={kv_heads} T={t} P={prefix} "
                                         f"D={d} split_rows={split_rows}: max error {err:.3g} (NaN: it read the "
                                         "cache tail)")
    fig["max_abs_error"] = worst
    fig["fused_combine_equals_combine"] = f"{same[True]}/{same[True] + same[False]}"  # bit for bit
    fig["batched_call_equals_each_sequence"] = batched_call_check(run, triton_kernel, random_tree_mask)
    # issue 39's path kernel: every dtype on a GPU; fp32 alone through the (slow) interpreter
    fig["path_rows_equal_their_ar_steps"] = path_check(tol if dev.type == "cuda" else [torch.float32])
    # opt-in: several query rows a path program (an AR step fills one of them). Bit equality there rests on
    # the MMA giving a row the same bits at every row slot of a tile: the GPU's to show. On CPU (the script's
    # own check) fp32 through the interpreter, whose host BLAS may not (tests/conftest.py's interpreter_dot)
    for rows in path_rows(run) if dev.type == "cuda" else path_rows(run)[:1]:
        got = opt_in_attempt(fig, "path_rows", path_check, [torch.bfloat16 if dev.type == "cuda" else torch.float32],
                             {"PATH_ROWS": rows})
        if got is not None:
            fig[f"path_rows_equal_their_ar_steps_rows{rows}"] = got
    if dev.type == "cuda":
        fig["cuda_graph_follows_prefix_len"] = captured_prefix_check(run)
        fig.update(kernel_timings(run))
    else:
        fig["cuda_graph_follows_prefix_len"] = "not checked (no GPU)"
    return fig


def batched_call_check(run: Run, triton_kernel, random_tree_mask) -> bool:
    """Issue 40: one call over 4 sequences (their own prefixes, trees, and cache slots: the slices of one
    slot-major cache) gives each sequence its own call's bits, direct and split."""
    dev, gen = run.device, torch.Generator().manual_seed(1)
    slots, rows, t = 4, 640, 6
    k, v = (torch.randn(slots, 2, rows, 32, generator=gen).to(dev) for _ in range(2))  # a slot-major cache
    q = torch.randn(slots, 8, t, 32, generator=gen).to(dev)
    masks = torch.stack([random_tree_mask(t, gen) for _ in range(slots)]).to(dev)
    prefix = torch.tensor([0, 5, 300, 600], device=dev)
    for split_rows in (None, 64):
        together = triton_kernel.tree_attention(q, k, v, masks, prefix, 0.17, split_rows)
        for i in range(slots):
            alone = triton_kernel.tree_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], masks[i], prefix[i], 0.17,
                                                 split_rows)
            if not torch.equal(together[i : i + 1], alone):
                return False
    return True


def path_check(dtypes, tune: dict | None = None) -> dict:
    """Issue 39: the path kernel (exact numerics; launch settings `tune`) gives every tree row its AR step's
    bits on this device: {dtype: rows equal / rows}, over tests/test_triton_kernel.py's cases."""
    from tests.test_triton_kernel import PATH_CASES, path_case, rows_equal_to_their_ar_steps

    out = {}
    for dtype in dtypes:
        same = [ok for i, (h, kvh, t, p, d, split) in enumerate(PATH_CASES)
                for ok in rows_equal_to_their_ar_steps(*path_case(h, kvh, t, p, d, dtype, seed=i), split,
                                                       tune=tune)]
        out[str(dtype).removeprefix("torch.")] = f"{sum(same)}/{len(same)}"
    return out


def captured_prefix_check(run: Run) -> bool:
    """The op captured in a CUDA graph with prefix_len a device tensor: replays after writing another
    prefix_len give that prefix's attention (nothing baked in at capture), across 1, 2 and 6 live splits."""
    from glance_rt.models.attention import tree_attention, tree_attention_reference

    dev = run.device
    q = torch.randn(1, 8, 4, 64, device=dev)
    k, v = (torch.randn(1, 2, 2048, 64, device=dev) for _ in range(2))
    mask = torch.ones(4, 4, dtype=torch.bool, device=dev).tril()
    prefix = torch.tensor(10, device=dev)
    tree_attention(q, k, v, mask, prefix, 0.125)  # warm-up: Triton compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention(q, k, v, mask, prefix, 0.125)
    for p in (10, 300, 1500, 100):
        prefix.fill_(p)
        graph.replay()
        want = tree_attention_reference(q.cpu(), k.cpu()[:, :, : p + 4], v.cpu()[:, :, : p + 4], mask.cpu(),
                                        torch.tensor(p), 0.125)
        if not torch.allclose(out.cpu(), want, atol=2e-6, rtol=2e-6):
            return False
    return True


def graph_time_us(fn, calls: int = 20, reps: int = 20) -> float:
    """Device time of fn() in microseconds: `calls` calls captured in one CUDA graph, the median replay
    over `reps`, divided by `calls` (no Python launch overhead, as the decoder's captured passes run)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


KERNEL_GOALS_US = {"T1_P1024": 10.0, "T1_P6000": 15.0, "T64_P6000": 20.0}  # issue 37, at the 7B's shapes


def kernel_timings(run: Run) -> dict:
    """The kernel at a 7B's attention shapes (28 query heads, 4 KV heads, head dim 128, bf16, an 8k-row
    cache) in CUDA graphs: the direct kernel (TensorRT's; the first run's 102/291 us), the op's default
    split-KV, a sweep of split sizes, and the reference op (SDPA over every row with a [T, L] mask)."""
    from glance_rt.models.attention import tree_attention_reference
    from glance_rt.models.exact import static_row_attention
    from glance_rt.plugins import tree_attention_triton as triton_kernel

    dev, fig, sweeps = run.device, {}, {}
    k, v = (torch.randn(1, 4, 8192, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for t in (1, 64):
        q = torch.randn(1, 28, t, 128, device=dev, dtype=torch.bfloat16)
        mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        for prefix in (1024, 6000):
            args = (q, k, v, mask, torch.tensor(prefix, device=dev), 0.088)
            key = f"T{t}_P{prefix}"
            fig[f"direct_{key}_us"] = graph_time_us(lambda a=args: triton_kernel.tree_attention(*a, split_rows=None))
            for rows in (64, 128, 256, 512, 1024):
                fig[f"split{rows}_{key}_us"] = graph_time_us(lambda a=args, r=rows: triton_kernel.tree_attention(*a, r))
            fig[f"kernel_{key}_us"] = fig[f"split{triton_kernel.SPLIT_ROWS}_{key}_us"]  # the op's default
            # the default launch with the tree mask gathered tile by tile (before 2026-12-06: 255 registers
            # and spills at T = 64; scripts/kernel_resources.py) against the op's int64 bits per query row
            fig[f"mask_gathered_{key}_us"] = graph_time_us(
                lambda a=args: triton_kernel.tree_attention(*a, tune={"TREE_BITS": False}))
            # the combine folded into the split kernel (one launch, not yet the default)
            fused_us = opt_in_attempt(fig, "fused", graph_time_us,
                                      lambda a=args: triton_kernel.tree_attention(*a, tune={"FUSED": True}))
            if fused_us is not None:
                fig[f"fused_{key}_us"] = fused_us
            fig[f"reference_{key}_us"] = graph_time_us(lambda a=args: tree_attention_reference(*a))
            # exact numerics (issue 39): the path kernel, and the gathered copies + SDPA it replaced
            fig[f"exact_{key}_us"] = graph_time_us(lambda a=args: triton_kernel.tree_attention(*a, exact=True))
            for rows in path_rows(run):  # opt-in: path programs of several rows, reading the shared prefix once
                us = opt_in_attempt(fig, "path_rows", graph_time_us, lambda a=args, r=rows:
                                    triton_kernel.tree_attention(*a, exact=True, tune={"PATH_ROWS": r}))
                if us is not None:
                    fig[f"exact_rows{rows}_{key}_us"] = us
            fig[f"gathered_{key}_us"] = graph_time_us(lambda a=args: static_row_attention(*a))
            if key in KERNEL_GOALS_US:
                fig[f"kernel_{key}_goal_us"] = KERNEL_GOALS_US[key]
            print(key, {n: round(x, 1) for n, x in fig.items() if key in n}, flush=True)
            if key in SWEEP_SHAPES:
                sweeps[key] = (args, t)
    fig.update(batched_timings(dev, triton_kernel))
    fig["matmul"] = matmul_timings(run)
    for key, (args, t) in sweeps.items():  # last: a launch setting that broke the device would cost no figure
        fig[f"sweep_{key}"] = tune_sweep(run, args, t, triton_kernel)
    return fig


def path_rows(run: Run) -> tuple[int, ...]:
    """--path-rows: issue 39's path kernel with several query rows a program (`tree_attention(...,
    tune={"PATH_ROWS": r})`, opt-in), checked for bit equality with its AR steps on the device and timed
    beside the one-row programs."""
    return tuple(int(r) for r in run.args.path_rows.split(",") if r)


# issue 39's row-invariant matmul at Qwen2.5-VL-3B's linears (out, in): q+k+v, o, gate+up, down
MATMUL_SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (22016, 2048), "down": (2048, 11008)}
# after the default (matmul_triton.CONFIGS): the tiles before 2026-12-06, then alternatives;
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
MATMUL_CONFIGS = ((16, 64, 64, 4, 2), (16, 32, 128, 4, 4), (64, 16, 128, 4, 4), (16, 16, 256, 8, 3))


def matmul_timings(run: Run) -> dict:
    """Device us of exact numerics' row-invariant Triton matmul against torch's linear (cuBLAS) at the 3B's
    linears, bf16, for a one-row call (the AR step) and 64 rows (a verify), config by config: the default,
    then `MATMUL_CONFIGS` in order (the tiles are the reduction order: a config is chosen once per dtype,
    never per call), within --matmul-s seconds (a config starts only with time left: the default and the
    old tiles first); `layer_rows{M}_us` sums a layer's four linears per config."""
    from glance_rt.plugins import matmul_triton

    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    configs = {"default": None} | {"m{}_n{}_k{}_w{}_s{}".format(*c): dict(zip(keys, c, strict=True))
                                   for c in MATMUL_CONFIGS}
    out, stop = {}, time.perf_counter() + run.args.matmul_s
    calls = {(rows, name): (torch.randn(rows, k, device=run.device, dtype=torch.bfloat16),
                            torch.randn(n, k, device=run.device, dtype=torch.bfloat16) * 0.02)
             for rows in (1, 64) for name, (n, k) in MATMUL_SHAPES.items()}
    for (rows, name), (x, w) in calls.items():
        torch_us = graph_time_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))  # cuBLAS
        out[f"{name}_rows{rows}_us"] = {"torch": round(torch_us, 1)}
    for label, cfg in configs.items():
        for (rows, name), (x, w) in calls.items():
            if time.perf_counter() > stop or run.left() < run.args.floor:
                fig = "skipped: --matmul-s"
            else:
                try:
                    fig = round(graph_time_us(lambda x=x, w=w, cfg=cfg: matmul_triton.invariant_linear(
                        x, w, None, config=cfg)), 1)
                except Exception as e:  # out of shared memory: a result of the sweep, not a failure
                    fig = f"{type(e).__name__}: {str(e)[:120]}"
            out[f"{name}_rows{rows}_us"][label] = fig
    for rows in (1, 64):
        shapes = [out[f"{name}_rows{rows}_us"] for name in MATMUL_SHAPES]
        out[f"layer_rows{rows}_us"] = {label: round(sum(f[label] for f in shapes), 1) for label in shapes[0]
                                       if all(isinstance(f[label], float) for f in shapes)}  # timed on all four
        print(f"matmul rows={rows} (a layer's four linears, us):", out[f"layer_rows{rows}_us"], flush=True)
    return out


def batched_timings(dev, triton_kernel, slots: int = 8, rows: int = 2048) -> dict:
    """Issue 40 at the 7B's attention shapes: `slots` sequences (prefix 1,024 each, their own cache slots)
    attended in one batched call, against a call per sequence, for AR steps (T = 1) and 16-row trees."""
    fig = {}
    k, v = (torch.randn(slots, 4, rows, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))  # [S, 4, L, 128]
    prefix = torch.full((slots,), 1024, device=dev)
    for t in (1, 16):
        q = torch.randn(slots, 28, t, 128, device=dev, dtype=torch.bfloat16)
        masks = torch.ones(slots, t, t, dtype=torch.bool, device=dev).tril()
        fig[f"batch{slots}_T{t}_P1024_us"] = graph_time_us(
            lambda q=q, m=masks: triton_kernel.tree_attention(q, k, v, m, prefix, 0.088))
        fig[f"each{slots}_T{t}_P1024_us"] = graph_time_us(
            lambda q=q, m=masks: [triton_kernel.tree_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], m[i],
                                                               prefix[i], 0.088) for i in range(slots)])
        print(f"batch T{t}", {n: round(x, 1) for n, x in fig.items() if f"_T{t}_" in n}, flush=True)
    return fig


SWEEP_SHAPES = ("T1_P1024", "T64_P6000")  # the decode step and the verify call furthest from their goals


def tune_configs(t: int) -> list[dict]:
    """Launch settings for the split kernel at the default split size: query rows per program, tile rows,
    warps, pipelining stages (the first H200 run: 4 warps, 2 stages, 64-row tiles, 16/64 query rows)."""
    block_ms = (16,) if t == 1 else (64, 128, 32)
    return [dict(block_m=m, BLOCK_N=n, num_warps=w, num_stages=st)
            for m in block_ms for n in (64, 32, 128) for w in (4, 8) for st in (2, 3)]


def tune_sweep(run: Run, args: tuple, t: int, triton_kernel) -> dict:
    """Device us of the op's split kernel under each of `tune_configs` (configs that fail to compile,
    e.g. past shared memory, are recorded as such), within --sweep-s seconds."""
    out, stop = {}, time.perf_counter() + run.args.sweep_s / len(SWEEP_SHAPES)
    for cfg in tune_configs(t):
        name = "m{block_m}_n{BLOCK_N}_w{num_warps}_s{num_stages}".format(**cfg)
        if time.perf_counter() > stop or run.left() < run.args.floor:
            out[name] = "skipped: --sweep-s"
            continue
        tune = {k: v for k, v in cfg.items() if k != "block_m"}
        try:
            out[name] = round(graph_time_us(lambda c=cfg, tn=tune: triton_kernel.tree_attention(
                *args, triton_kernel.SPLIT_ROWS, block_m=c["block_m"], tune=tn)), 1)
        except Exception as e:  # out of shared memory or registers: a result of the sweep, not a failure
            out[name] = f"{type(e).__name__}: {str(e)[:120]}"
    timed = {k: v for k, v in out.items() if isinstance(v, float)}
    if timed:
        out["best"] = min(timed, key=timed.get)
        print("sweep", out["best"], timed[out["best"]], "us", flush=True)
    return out


# ---------------------------------------------------------------------------------------------- lossless


def lossless_section(run: Run) -> dict:
    import glance_rt
    from tests.conftest import hf_greedy
    from tests.tiny_models import ARCHS, VLM_ARCHS, make_inputs, make_tiny

    dev, res = run.device, {}
    archs = ARCHS if not run.args.cpu else ["llama", "qwen2_5_vl"]
    wanted = run.args.compile_archs.split(",")
    compiled = archs if wanted == ["all"] else [a for a in archs if a in wanted]
    for backend, backend_archs in (("eager", archs), ("compile", compiled)):
        for arch in backend_archs:
            if run.left() < run.args.reserve:  # the timings need their time too
                res[f"{arch}/{backend}"] = "skipped: deadline"
                continue
            t = time.perf_counter()
            torch._dynamo.reset()
            model, processor = make_tiny(arch)
            target = glance_rt.load_target(model, device=str(dev), processor=processor)
            drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=3)
            kind = compile_backend(run.args.cuda_graphs, 8, run.regions) if backend == "compile" else backend
            dec = glance_rt.Decoder(target, drafter, tree_budget=8, max_length=256, backend=kind, chunk=8)
            vlm = arch in VLM_ARCHS
            prompts = [("Describe it.", 1 if vlm else 0, 24), ("Hi", 0, 30),
                       ("Count the objects, then name their colours.", 2 if vlm else 0, 20)]
            ok, graphs, device_rounds, device_steps, skips = True, [], 0, 0, cudagraph_skips()
            for prompt, n_images, new in prompts:
                inputs = make_inputs(arch, processor, prompt=prompt, n_images=n_images, seed=new)
                inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
                out = dec.generate(max_new_tokens=new, **inputs)
                ok &= out.token_ids == hf_greedy(model, inputs, new)
                device_rounds += out.stats.draft_passes if out.stats.timings["round"] > 0 else 0
                device_steps += out.stats.budgets.count(0) if dec.device_round else 0  # the gate's AR steps
                graphs.append(unique_graphs())
            entry = {"tokens_equal_hf": ok, "s": round(time.perf_counter() - t, 1)}
            if backend == "compile":
                entry["recompiles_after_first_prompt"] = graphs[-1] - graphs[0]
                entry["device_rounds"] = device_rounds  # drafted rounds run as one graph (default on CUDA)
                entry["device_steps"] = device_steps  # and AR steps
                entry["cuda_graphs"], entry["regions"] = run.args.cuda_graphs, run.regions
                entry["cudagraph_skips"] = cudagraph_skips() - skips  # (trees only: the runner captures itself)
                if dev.type == "cuda" and run.args.cuda_graphs == "runner":  # captured graphs were replayed
                    entry["replays"] = {n: f.replays for n, f in dec.passes.fns.items()}
            res[f"{arch}/{backend}"] = entry
            print(arch, backend, entry, flush=True)
    res["all_equal_hf"] = all(e["tokens_equal_hf"] for e in res.values() if isinstance(e, dict))
    res["no_recompiles"] = all(e.get("recompiles_after_first_prompt", 0) == 0 for e in res.values()
                               if isinstance(e, dict))
    return res


def numerics_section(run: Run) -> dict:
    """Issue 39 on this device: verify rows bit-equal to AR steps (an 11-row tree) and GLANCE's tokens
    against the same engine's AR, bf16 and fp16, with the fast kernels and in exact numerics (on CUDA:
    the Triton matmul), greedy and sampled, on `--numerics-backend` (eager: no compile time; compile:
    the device's default, CUDA graphs); counted, not gated."""
    import glance_rt
    from glance_rt.tools.numerics import row_agreement
    from tests.tiny_models import make_inputs, make_tiny

    dev, res = run.device, {"backend": run.args.numerics_backend, "rows": {}, "tokens": {}}
    archs = run.args.numerics_archs.split(",")
    tree = ([11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [-1, 0, 0, 1, 1, 2, 3, 6, 7, 8, 9])
    samplings = {"greedy": glance_rt.Sampling(), "sampled": glance_rt.Sampling(do_sample=True, temperature=1.5, seed=7)}
    configs = ({"tree_budget": 8, "lookup": 0}, {"tree_budget": 16, "lookup": 3})
    for arch in archs:
        for dtype in ("bfloat16", "float16"):
            if run.left() < run.args.reserve:
                res["tokens"][f"{arch}/{dtype}"] = "skipped: deadline"
                continue
            torch._dynamo.reset()
            model, processor = make_tiny(arch)
            target = glance_rt.load_target(model, device=str(dev), processor=processor, dtype=dtype)
            for numerics in ("fast", "exact"):
                checks = row_agreement(target, list(range(5, 40)), *tree, numerics=numerics)
                res["rows"][f"{arch}/{dtype}/{numerics}"] = f"{sum(c.equal for c in checks)}/{len(checks)}"
            inputs = make_inputs(arch, processor, prompt="Say something long about the sea.", n_images=0)
            inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
            for numerics in ("fast", "exact"):
                kw = {"numerics": numerics, "max_length": 256, "chunk": 8, "backend": run.args.numerics_backend}
                ar = glance_rt.Decoder(target, None, **kw)
                decs = [glance_rt.Decoder(target, drafter, gate=False, **kw, **cfg) for cfg in configs]
                same, runs = 0, 0
                for s in samplings.values():
                    want = ar.generate(max_new_tokens=32, sampling=s, **inputs).token_ids
                    for dec in decs:
                        same += dec.generate(max_new_tokens=32, sampling=s, **inputs).token_ids == want
                        runs += 1
                res["tokens"][f"{arch}/{dtype}/{numerics}"] = f"{same}/{runs}"
            print(arch, dtype, {k: v for k, v in res["tokens"].items() if k.startswith(f"{arch}/{dtype}")}, flush=True)
    for numerics in ("fast", "exact"):
        counts = [v for k, v in res["tokens"].items() if k.endswith(numerics) and "/" in v]
        res[f"tokens_equal_ar_{numerics}"] = (f"{sum(int(c.split('/')[0]) for c in counts)}/"
                                              f"{sum(int(c.split('/')[1]) for c in counts)}")
    return res


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def cudagraph_skips() -> int:
    """Graphs Inductor compiled for CUDA graph trees but runs without them (it logs "skipping cudagraphs due
    to ..."): a pass that would silently lose its CUDA graph ("reduce-overhead", e.g. over compile regions)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


# ----------------------------------------------------------------------------------------------- timings


def build_target(cfg: dict, dtype, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import glance_rt

    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(dtype).eval()
    return glance_rt.load_target(model, dtype=str(dtype).removeprefix("torch."), device=str(device))


def compile_backend(cuda_graphs: str, chunk: int = 64, regions: bool = True):
    """The compile backend whose passes replay on CUDA as `cuda_graphs` says ("runner" or "trees"); `regions`
    False: the verifier's layers inline, not a nested compile region each (`--regions off`)."""
    from dataclasses import replace

    from glance_rt.round.verify import named_backend

    return replace(named_backend("compile", chunk, cuda_graphs=cuda_graphs), regions=regions)


def pass_fns(run: Run, target, drafter, backend, budgets, numerics: str = "fast") -> dict:
    """name -> one call of each pass at a `--context`-row prefix, on ONE decoder (one compile of each
    graph: the AR step is its one-row verify, the step the draft gate takes): ar_step, draft,
    verify_N, round_N (the host tree between the passes) and, where the decoder runs rounds on the
    device (compile on CUDA), device_step and device_round_N (one graph, one copy back). `backend`: a name or a Backend.
    Graphs compile at their first call. `numerics`: the decoder's."""
    import glance_rt
    from glance_rt.round.tree import build_tree

    args, dev = run.args, run.device
    ctx = args.context
    compiled = getattr(backend, "name", backend) == "compile"
    dec = glance_rt.Decoder(target, drafter, tree_budget=max(budgets), max_length=ctx + max(budgets) + 128,
                            backend=backend, lookup=0, gate=False, numerics=numerics,
                            device_round=True if run.args.cpu and compiled else None)  # --cpu: check it
    pre = target.prefill_inputs({"input_ids": torch.randint(0, target.vocab_size, (1, ctx), device=dev)})
    _, feats = dec.passes.prefill(pre.embeds[None].to(target.dtype), pre.positions[None].to(dev))
    dec.passes.draft(feats, 0, 0, ctx)  # the prompt's context, once
    last = feats[-1:]

    def draft():
        return dec.passes.draft(last, ctx - 1, 0, ctx)

    def verify(tree):
        t = lambda x: torch.from_numpy(x).to(dev)  # noqa: E731
        return dec.passes.verify(tree, t(tree.tokens), (t(tree.depth) + ctx)[None], ctx, t(tree.mask))

    def round_(budget):
        dec.passes.commit(verify(build_tree(draft(), 0, budget))[3], ctx)

    def device_round(budget):  # draft, tree, verify, accept, compact: one graph, one copy back
        return dec.passes.round(last, ctx - 1, 0, ctx, 0, budget, False, (0, []))

    root = build_tree(None, 0, 0)
    fns = {"ar_step": lambda: verify(root), "draft": draft}
    if dec.device_round:  # the AR step a decoder runs on the device: one graph, one copy in, one back
        fns["device_step"] = lambda: dec.passes.step(0, ctx, 0)
    for b in budgets:
        tree = build_tree(draft(), 0, b)
        fns[f"verify_{b}"] = lambda tree=tree: verify(tree)
        fns[f"round_{b}"] = lambda b=b: round_(b)  # the host tree between the passes
        if dec.device_round:
            fns[f"device_round_{b}"] = lambda b=b: device_round(b)
    return fns


def pass_figures(run: Run, fns: dict) -> dict:
    """Median ms of each pass, until the deadline's floor."""
    fig = {}
    for name, fn in fns.items():
        if run.left() < run.args.floor:
            fig[name] = "skipped: deadline"
            continue
        fig[name + "_ms"] = 1e3 * run.timed(fn)
    return fig


def profile_table(run: Run, fns: dict, rows: int = 15, reps: int = 5) -> dict:
    """The top ops of each pass by device time (CPU time without a GPU) over `reps` calls."""
    from torch.profiler import ProfilerActivity, profile

    cuda = run.device.type == "cuda"
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    out = {"reps": reps, "by": key}
    for name, fn in fns.items():
        fn()
        run.sync()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(reps):
                fn()
            run.sync()
        events = prof.key_averages()
        top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:rows]
        out[name] = [{"name": e.key[:100], "calls": e.count, "total_us": round(getattr(e, key), 1)} for e in top]
        if cuda:  # every kernel and copy on the device, per call: the wall time less this is the GPU's idle time
            from torch.autograd import DeviceType

            on_device = [e for e in events if e.device_type == DeviceType.CUDA]
            out[f"{name}_device_us_per_call"] = round(sum(e.self_device_time_total for e in on_device) / reps, 1)
            # launches per call (kernels and copies): what the gaps between them scale with
            out[f"{name}_device_ops_per_call"] = round(sum(e.count for e in on_device) / reps, 1)
    return out


def hf_step(run: Run, target, short: int = 16, long: int = 48) -> dict:
    """HF generate's per-step ms on the same model (static cache: transformers compiles the step on a
    GPU), from the difference of two generation lengths after a warm-up."""
    model, ctx = target.hf_model, run.args.context
    ids = torch.randint(0, target.vocab_size, (1, ctx), device=run.device)

    def gen(n):
        run.sync()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, cache_implementation="static", max_cache_len=ctx + long + 8)
        run.sync()
        return time.perf_counter() - t

    t = time.perf_counter()
    gen(8), gen(8)  # compiles (on a GPU)
    warm = time.perf_counter() - t
    a, b = min(gen(short) for _ in range(2)), min(gen(long) for _ in range(2))
    return {"step_ms": 1e3 * (b - a) / (long - short), "warmup_s": round(warm, 1)}


def bandwidth_bound_ms(target, context: int, dtype) -> float:
    """The AR step's floor: every weight and the prefix's KV rows read once at H200 bandwidth."""
    text = target.parts
    weight_bytes = sum(p.numel() * p.element_size() for p in text.text_model.parameters())
    if text.lm_head.weight.data_ptr() != text.text_model.embed_tokens.weight.data_ptr():
        weight_bytes += text.lm_head.weight.numel() * text.lm_head.weight.element_size()
    c = target.text_config
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * context
    kv_bytes *= (c.hidden_size // c.num_attention_heads) * (torch.finfo(dtype).bits // 8)
    return 1e3 * (weight_bytes + kv_bytes) / H200_BANDWIDTH


def ratios(fig: dict) -> dict:
    """ar_step and device_step / bound, hf_static / each, verify_N, round_N and device_round_N / ar_step
    (compiled)."""
    c = fig.get("compile", {})
    ar = c.get("ar_step_ms")
    if not isinstance(ar, float):
        return {}
    hf = fig.get("hf_static", {}).get("step_ms") if isinstance(fig.get("hf_static"), dict) else None
    out = {}
    for step in ("ar_step", "device_step"):
        if isinstance(c.get(f"{step}_ms"), float):
            out[f"{step}/bound"] = c[f"{step}_ms"] / fig["ar_bandwidth_bound_ms"]
            if hf:
                out[f"hf_static/{step}"] = hf / c[f"{step}_ms"]
    for k, v in c.items():
        if k.startswith(("verify_", "round_", "device_round_")) and isinstance(v, float):
            out[f"{k.removesuffix('_ms')}/ar_step"] = v / ar
    for k, v in fig.get("compile_exact", {}).items():  # issue 39: exact numerics' cost, pass by pass
        if isinstance(v, float) and isinstance(c.get(k), float):
            out[f"exact/fast {k.removesuffix('_ms')}"] = v / c[k]
    return {k: round(v, 3) for k, v in out.items()}


def exact_figures(run: Run, target, drafter, budget: int) -> dict:
    """Issue 39's cost: the compiled AR step, verify and round at `budget` in exact numerics (the Triton
    matmul and path kernel on CUDA), to set beside the fast mode's."""
    fns = pass_fns(run, target, drafter, compile_backend(run.args.cuda_graphs, regions=run.regions), [budget],
                   numerics="exact")
    return pass_figures(run, {k: fns[k] for k in ("ar_step", f"verify_{budget}", f"round_{budget}")})


AB_S = 60  # seconds the CUDA-graphs A/B of the AR step starts with: compiles of the one-row verify and the draft


def cuda_graphs_ab(run: Run, target, drafter, mode: str, ar_ms) -> dict:
    """The AR step under each way compiled passes replay on CUDA: `mode`'s from the main figures, the other's
    from the same decoder built again (graphs compile at their first call: the one-row verify, and the
    draft pass that takes the prompt's context), same model, same run."""
    other = "trees" if mode == "runner" else "runner"
    out = {mode: ar_ms}
    try:
        torch._dynamo.reset()
        fns = pass_fns(run, target, drafter, compile_backend(other, regions=run.regions), [1])
        out[other] = 1e3 * run.timed(fns["ar_step"])
    except Exception as e:  # recorded: the main figures stand
        traceback.print_exc()
        out[other] = f"{type(e).__name__}: {e}"
    print("AR step by CUDA graphs (ms):", out, flush=True)
    return out


EXACT_S = 240  # seconds exact timings start with: a compile of the passes (~200 s at the 3B on the first H200)


def model_figures(run: Run, cfg: dict, dtype, budgets, profile: bool, exact_after: float | None = None) -> dict:
    """The model's figures; `exact_after`: time exact numerics' passes too if, once the rest is done, this
    many seconds (the later models' floors) plus EXACT_S are left."""
    import glance_rt

    torch._dynamo.reset()
    target = build_target(cfg, dtype, run.device)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=16).to(dtype)
    fig = {"context": run.args.context, "dtype": str(dtype),
           "ar_bandwidth_bound_ms": bandwidth_bound_ms(target, run.args.context, dtype)}
    eager = pass_fns(run, target, drafter, "eager", budgets)
    fig["eager"] = pass_figures(run, eager if run.args.eager_passes else {"ar_step": eager["ar_step"]})
    del eager
    t, mode, regions, skips = time.perf_counter(), run.args.cuda_graphs, run.regions, cudagraph_skips()
    # on CUDA a failure is a finding, and the figures still come: compile regions off first (not yet run on a
    # GPU), then the trees for the runner; each failure in `compile_errors`
    fallbacks = [(mode, False)] if regions else []
    fallbacks += [("trees", False)] if mode == "runner" else []
    while True:
        try:
            fns = pass_fns(run, target, drafter, compile_backend(mode, regions=regions), budgets)
            fig["compile"] = pass_figures(run, fns)
            break
        except Exception as e:
            if not fallbacks or run.device.type != "cuda":
                raise
            traceback.print_exc()
            fig.setdefault("compile_errors", []).append(f"{mode}, regions {regions}: {type(e).__name__}: {e}")
            mode, regions = fallbacks.pop(0)
            torch._dynamo.reset()
    fig["cuda_graphs"], fig["regions"] = mode, regions
    # graphs compiled for CUDA graph trees that run without them (should be 0; the runner captures by itself):
    # every pass's with --cuda-graphs trees, else the A/B's AR step below (not HF's step in between)
    fig["trees_cudagraph_skips"] = cudagraph_skips() - skips
    fig["compile"]["wall_s"] = round(time.perf_counter() - t, 1)
    print("compile", mode, json.dumps(fig["compile"]), flush=True)
    if profile and run.left() > run.args.floor:
        b = 64 if 64 in budgets else max(budgets)
        keys = ("ar_step", "device_step", "draft", f"verify_{b}", f"round_{b}", f"device_round_{b}")
        fig["profile"] = profile_table(run, {k: fns[k] for k in keys if k in fns})
    del fns
    fig["hf_static"] = hf_step(run, target) if run.left() > run.args.floor else "skipped: deadline"
    if run.left() > run.args.floor + AB_S:  # (--cpu: both are plain compiled passes; checks the code)
        skips = cudagraph_skips()
        fig["ar_step_ms_by_cuda_graphs"] = cuda_graphs_ab(run, target, drafter, mode, fig["compile"].get("ar_step_ms"))
        fig["trees_cudagraph_skips"] += cudagraph_skips() - skips
    if exact_after is not None and run.left() > exact_after + EXACT_S:
        torch._dynamo.reset()
        fig["compile_exact"] = exact_figures(run, target, drafter, 64 if 64 in budgets else max(budgets))
        print("compile exact", json.dumps(fig["compile_exact"]), flush=True)
    fig["ratios"] = ratios(fig)
    print(json.dumps({k: fig[k] for k in ("eager", "hf_static", "ratios")}), flush=True)
    return fig


def timings_section(run: Run) -> dict:
    res = {}
    dtype = torch.float32 if run.args.cpu else torch.bfloat16
    models = {"toy": TOY} if run.args.cpu else {n: MODELS[n] for n in run.args.models.split(",")}
    budgets = [int(b) for b in run.args.budgets.split(",")]
    for i, (name, cfg) in enumerate(models.items()):
        later = len(models) - i - 1  # models after this one: each needs --model-floor seconds
        if run.left() < run.args.model_floor:
            res[name] = "skipped: deadline"
            continue
        spare = [int(b) for b in run.args.spare_budgets.split(",") if b]
        extra = spare if run.left() > run.args.model_floor * later + 260 else []  # this model, spares, gpu_tests
        exact_after = run.args.model_floor * later if i == 0 else None  # issue 39's cost: the 3B's shapes
        res[name] = model_figures(run, cfg, dtype, sorted(set(budgets + extra)), profile=i == 0,
                                  exact_after=exact_after)
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
    return res


def batch_section(run: Run) -> dict:
    """Issue 40 on this device: aggregate tokens/s of `--batch-size` sequences decoded together (Batch,
    compile backend: CUDA graphs per (slots, rows) bucket) against the same sequences one after another
    (max_batch=1), autoregression at the first --models shapes (random weights, bf16), and how many
    batched sequences commit their alone tokens (bf16 fast numerics: rounding may differ; counted)."""
    import glance_rt

    torch._dynamo.reset()
    dtype = torch.float32 if run.args.cpu else torch.bfloat16
    cfg = TOY if run.args.cpu else MODELS[run.args.models.split(",")[0]]
    target = build_target(cfg, dtype, run.device)
    n, new = run.args.batch_size, 64
    gen = torch.Generator().manual_seed(0)
    prompts = [{"input_ids": torch.randint(0, target.vocab_size, (1, 32 + 8 * i), generator=gen).to(run.device)}
               for i in range(n)]
    res = {"batch": n, "max_new_tokens": new, "dtype": str(dtype)}
    alone, together = [], []
    for slots in (1, n):
        if run.left() < run.args.floor:
            res[f"batch_{slots}"] = "skipped: deadline"
            continue
        t = time.perf_counter()
        dec = glance_rt.Decoder(target, None, backend="compile", max_length=512, max_batch=slots)
        dec.passes.warmup(dec.budgets, dec.chain)
        warm = round(time.perf_counter() - t, 1)
        batch = glance_rt.Batch(dec)
        batch.run([dict(p, max_new_tokens=4) for p in prompts])  # first-call costs of every bucket
        run.sync()
        t = time.perf_counter()
        if slots == 1:  # one after another
            out = alone = [batch.run([dict(p, max_new_tokens=new)])[0].token_ids for p in prompts]
        else:
            out = together = [r.token_ids for r in batch.run([dict(p, max_new_tokens=new) for p in prompts])]
        run.sync()
        wall = time.perf_counter() - t
        res[f"batch_{slots}"] = {"tok_s": round(sum(map(len, out)) / wall, 1), "wall_s": round(wall, 2),
                                 "warmup_s": warm}
        print("batch", slots, res[f"batch_{slots}"], flush=True)
        del dec, batch
    if alone and together:
        res["speedup"] = round(res[f"batch_{n}"]["tok_s"] / res["batch_1"]["tok_s"], 2)
        res["same_tokens"] = f"{sum(a == b for a, b in zip(alone, together, strict=True))}/{n}"
    return res


# --------------------------------------------------------------------------------------------- gpu tests


def gpu_tests_section(run: Run) -> dict:
    """`pytest -m gpu` over the gpu-marked test files, from a copy of tests/ outside the repository, so
    `glance_rt` is the INSTALLED package (the root's glance_rt/ lacks engines/, export/, plugins/)."""
    files = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    work = Path(tempfile.mkdtemp(prefix="glance-gpu-tests-"))
    shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", work)  # the markers
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs",
           "--continue-on-collection-errors", *files]
    timeout = max(30, min(run.args.tests_timeout, int(run.left() - 10)))
    try:
        done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"status": f"timed out after {timeout} s", "files": files, "tail": str(e.stdout or "")[-1500:]}
    print(done.stdout[-3000:], done.stderr[-1500:])
    lines = done.stdout.strip().splitlines()
    return {"status": "passed" if done.returncode == 0 else f"failed (rc {done.returncode})", "files": files,
            "summary": lines[-1] if lines else "", "tail": done.stdout[-1500:]}


# -------------------------------------------------------------------------------------------------- real


def hf_static_runner(target, max_new_tokens: int, max_length: int):
    """HF greedy generate with its static cache (compiled by transformers on a GPU), one size for all."""

    def run(inputs):
        t = time.perf_counter()
        with torch.inference_mode():
            out = target.hf_model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                           eos_token_id=sorted(target.eos_token_ids) or None,
                                           cache_implementation="static", max_cache_len=max_length)
        return out[0, inputs["input_ids"].shape[1]:].tolist(), time.perf_counter() - t, None, None

    return run


def real_figures(run: Run, target, drafter, rows: list, reference: str, method: str | None = None) -> dict:
    """GLANCE (`method`, default --method), the same engine's AR (in the method's numerics) and HF
    static-cache greedy on `rows`: tokens/s, tau, and how many outputs equal `reference`'s ("hf" or
    "ar"), counted not gated."""
    from glance_rt.method import Method
    from glance_rt.tools.bench import BenchConfig, make_runner, suite_max_length
    from glance_rt.tools.suites import encode_rows

    a = run.args
    method = method or a.method
    m = Method.parse(method)
    encoded = encode_rows(target, rows)
    ar = Method(kind="ar", lookup=0, backend=m.backend, numerics=m.numerics).name  # the same engine's AR
    cfg = BenchConfig(methods=("hf", ar, method), max_new_tokens=a.real_new_tokens)
    cfg = replace(cfg, max_length=suite_max_length(encoded, cfg))
    runners = {"hf_static": hf_static_runner(target, cfg.max_new_tokens, cfg.max_length),
               "ar": make_runner(ar, target, drafter, cfg),
               "glance": make_runner(method, target, drafter, cfg)}
    for r in runners.values():  # warm-up: HF compiles its step here
        r(encoded[0])
    tokens, seconds, taus, same = dict.fromkeys(runners, 0), dict.fromkeys(runners, 0.0), [], {}
    for inputs in encoded:
        if run.left() < a.floor:
            break
        ids = {}
        for m, r in runners.items():
            ids[m], s, _, stats = r(inputs)
            tokens[m], seconds[m] = tokens[m] + len(ids[m]), seconds[m] + s
            if m == "glance":
                taus.append(stats.tau)
        ref = ids["hf_static" if reference == "hf" else "ar"]
        for m in runners:
            same[m] = same.get(m, 0) + (ids[m] == ref)
    n = len(taus)
    return {"prompts": n, "method": method, "reference": reference, "max_new_tokens": a.real_new_tokens,
            "tok_s": {m: round(tokens[m] / seconds[m], 1) for m in runners if seconds[m]},
            "tau": round(statistics.mean(taus), 3) if taus else None,
            "equal_reference": {m: f"{same.get(m, 0)}/{n}" for m in runners}}


def real_section(run: Run) -> dict:
    """A real target and drafter (--target, --drafter) on held-out prompts, bf16 (fast and exact
    numerics) and fp32."""
    import glance_rt
    from glance_rt.method import Method
    from glance_rt.tools.suites import suite_rows

    a = run.args
    if not a.target:
        return {"status": "not run: no --target"}
    rows = suite_rows(a.suite, a.per_kind)[: a.prompts]
    res = {}
    for dtype, reference in (("bfloat16", "ar"), ("float32", "hf")):
        if run.left() < a.model_floor:
            res[dtype] = "skipped: deadline"
            continue
        torch._dynamo.reset()
        target = glance_rt.load_target(a.target, dtype=dtype, device=str(run.device))
        drafter = glance_rt.load_drafter(a.drafter, target)
        res[dtype] = real_figures(run, target, drafter, rows, reference)
        print(dtype, json.dumps(res[dtype]), flush=True)
        if dtype == "bfloat16" and run.left() >= a.model_floor:  # issue 39: exact numerics beside the fastest
            exact = replace(Method.parse(a.method), backend=None, numerics="exact").name
            res["bfloat16_exact"] = real_figures(run, target, drafter, rows, "ar", exact)
            print("bfloat16 exact", json.dumps(res["bfloat16_exact"]), flush=True)
        del target, drafter
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------- tensorrt


def tensorrt_section(run: Run) -> dict:
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return {"status": "not run: tensorrt is not installed on this machine"}
    import subprocess

    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_tensorrt.py"),
           "-m", "tensorrt", "-rs"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60, int(run.left()) - 30))
    print(done.stdout[-3000:], done.stderr[-2000:])
    return {"status": "passed" if done.returncode == 0 else f"failed (rc {done.returncode})",
            "tail": done.stdout[-1500:]}


def summary(report: dict) -> None:
    print("\n== summary")
    env = report.get("env", {})
    print("unmet requirements:", env.get("unmet") or "none")
    k = report.get("kernel", {})
    for key in ("T1_P1024", "T1_P6000", "T64_P6000"):
        if f"fused_{key}_us" in k:
            print(f"kernel {key}: split + combine {k[f'kernel_{key}_us']:.1f} us, fused combine "
                  f"{k[f'fused_{key}_us']:.1f} us, tree mask gathered {k[f'mask_gathered_{key}_us']:.1f} us, "
                  f"goal {k.get(f'kernel_{key}_goal_us')}")
    print("fused combine == split + combine, bit for bit:", k.get("fused_combine_equals_combine"),
          k.get("fused_error", ""))
    print("kernel max |error| vs reference:", k.get("max_abs_error"), "| CUDA graph follows prefix_len:",
          k.get("cuda_graph_follows_prefix_len"), "| a batched call == each sequence's own:",
          k.get("batched_call_equals_each_sequence"), "| path kernel rows == AR steps:",
          k.get("path_rows_equal_their_ar_steps"))
    for key in ("T1_P1024", "T64_P6000"):
        if f"exact_{key}_us" in k:
            rows = ", ".join(f"{n.removeprefix('exact_rows').split('_')[0]} rows a program {x:.1f} us"
                             for n, x in k.items() if n.startswith("exact_rows") and n.endswith(f"_{key}_us"))
            print(f"exact attention {key}: path kernel {k[f'exact_{key}_us']:.1f} us ({rows or 'no other rows'}), "
                  f"gathered + SDPA {k[f'gathered_{key}_us']:.1f} us, fast kernel {k[f'kernel_{key}_us']:.1f} us")
    print("path programs of several rows, rows == AR steps:",
          {n.rsplit("rows", 1)[1]: x for n, x in k.items() if n.startswith("path_rows_equal_their_ar_steps_rows")},
          k.get("path_rows_error", ""))
    for rows in (1, 64):
        layer = k.get("matmul", {}).get(f"layer_rows{rows}_us")
        if layer:
            print(f"a layer's linears at {rows} row(s), us: torch {layer.get('torch')}, row-invariant Triton "
                  f"{layer.get('default')} (all configs: {layer})")
    for t in (1, 16):
        if f"batch8_T{t}_P1024_us" in k:
            print(f"kernel, 8 sequences at T={t}: one batched call {k[f'batch8_T{t}_P1024_us']:.1f} us, a call each "
                  f"{k[f'each8_T{t}_P1024_us']:.1f} us")
    lo = report.get("lossless", {})
    print("lossless: all == HF:", lo.get("all_equal_hf"), "| no recompiles:", lo.get("no_recompiles"))
    print("gpu tests:", report.get("gpu_tests", {}).get("status"), report.get("gpu_tests", {}).get("summary", ""))
    nu = report.get("numerics", {})
    print("numerics (issue 39), GLANCE == same-engine AR, bf16/fp16 tiny models: fastest",
          nu.get("tokens_equal_ar_fast"), "| exact", nu.get("tokens_equal_ar_exact"))
    for name, fig in report.get("timings", {}).items():
        if not isinstance(fig, dict) or "compile" not in fig:
            continue
        for backend in (b for b in ("eager", "compile", "compile_exact") if b in fig):
            cells = "  ".join(f"{k.removesuffix('_ms')} {v:.2f}" for k, v in fig.get(backend, {}).items()
                              if k.endswith("_ms") and isinstance(v, float))
            print(f"{name:14} {backend:13} ms: {cells}")
        hf = fig.get("hf_static")
        hf = f"{hf['step_ms']:.2f} ms" if isinstance(hf, dict) else hf
        print(f"{name:14} AR bandwidth bound {fig['ar_bandwidth_bound_ms']:.2f} ms | HF static step {hf}")
        print(f"{name:14} ratios: " + "  ".join(f"{k} {v:.2f}" for k, v in fig.get("ratios", {}).items()))
        if "cuda_graphs" in fig:
            print(f"{name:14} compiled passes replayed by: {fig['cuda_graphs']}, compile regions {fig.get('regions')}"
                  + (f" (after failures: {fig['compile_errors']})" if "compile_errors" in fig else "")
                  + f" | AR step ms by CUDA graphs: {fig.get('ar_step_ms_by_cuda_graphs', 'not timed')}")
    for dtype, fig in report.get("real", {}).items():
        if isinstance(fig, dict):
            print(f"real {dtype}: tok/s {fig['tok_s']} | tau {fig['tau']} | == {fig['reference']}: "
                  f"{fig['equal_reference']}")
    ba = report.get("batch", {})
    n = ba.get("batch")
    if isinstance(ba.get("batch_1"), dict) and "speedup" in ba:
        print(f"batch (issue 40): {n} sequences at {ba['speedup']}x the tokens/s of one after another "
              f"({ba['batch_1']['tok_s']} -> {ba[f'batch_{n}']['tok_s']}); same tokens {ba['same_tokens']}")
    print("tensorrt:", report.get("tensorrt", {}).get("status"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="toy sizes on CPU: checks the script itself")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    ap.add_argument("--deadline", type=float, default=510, help="seconds for all sections together")
    ap.add_argument("--reserve", type=float, default=360, help="seconds the lossless sweep leaves for the rest")
    ap.add_argument("--floor", type=float, default=20, help="seconds left under which a timing is skipped")
    ap.add_argument("--model-floor", type=float, default=120, help="seconds a model's timings need (else skipped)")
    ap.add_argument("--compile-archs", default="llama",
                    help="tiny architectures the lossless sweep also runs compiled ('all': every one)")
    ap.add_argument("--regions", default="on", choices=["on", "off"],
                    help="compiled passes: each verifier layer a nested compile region (the compile backend's default: "
                         "a layer compiled once per graph) or inline (a fallback where regions fail)")
    ap.add_argument("--cuda-graphs", default="runner", choices=["runner", "trees"],
                    help="lossless and timings: how compiled passes replay (the timings time the AR step with the "
                         "other one beside; gpu_tests check both)")
    ap.add_argument("--numerics-archs", default="qwen2_5_vl",
                    help="numerics: tiny architectures (issue 39 saw bf16 differences on qwen2_5_vl and qwen2_vl)")
    ap.add_argument("--numerics-backend", default="eager", choices=["eager", "compile"],
                    help="numerics: the backend both modes run on (compile: a compile per decoder, minutes)")
    ap.add_argument("--tests-timeout", type=int, default=150, help="seconds for the gpu_tests subprocess")
    ap.add_argument("--context", type=int, default=1024, help="prefix rows already in the cache (timings)")
    ap.add_argument("--budgets", default="64", help="tree budgets timed (issue 37's goals are at 64)")
    ap.add_argument("--spare-budgets", default="16,128", help="timed too when time allows")
    ap.add_argument("--models", default=",".join(MODELS), help=f"timings: any of {', '.join(MODELS)}")
    ap.add_argument("--sweep-s", type=float, default=60, help="kernel: seconds for the launch-settings sweep")
    ap.add_argument("--matmul-s", type=float, default=30,
                    help="kernel: seconds in all for exact numerics' matmul against torch's linear, config by config")
    ap.add_argument("--path-rows", default="2,4",
                    help="kernel: exact numerics' path kernel at these query rows a program too (opt-in; '' for none)")
    ap.add_argument("--eager-passes", action="store_true", help="time every pass eagerly too (default: the AR step)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--target", help="real section: a GGUF file or HF model folder (glance_rt.load_target)")
    ap.add_argument("--drafter", help="real section: a drafter folder (default: the target's shipped one)")
    ap.add_argument("--method", default="tree-8+lookup@compile", help="real section: the GLANCE method")
    ap.add_argument("--suite", default="all", help="real section: held-out prompts (glance_rt.tools.suites)")
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--real-new-tokens", type=int, default=128)
    ap.add_argument("--sections", default="kernel,lossless,numerics,timings,gpu_tests,real,batch,tensorrt")
    ap.add_argument("--batch-size", type=int, default=8, help="batch section: sequences decoded together")
    tools = ap.add_argument_group("tools (no measuring)")
    tools.add_argument("--plan", metavar="JSON", help="print the wheels to carry (name==version), write the plan")
    tools.add_argument("--size", metavar="DIR", help="check tree + DIR against the travel budget")
    tools.add_argument("--split", metavar="FILE", help="FILE in parts under .gpu/parts/ with a sha256 manifest")
    tools.add_argument("--part-mib", type=float, help="part size (default: what the budget leaves, <= 20)")
    tools.add_argument("--stage", metavar="DIR", help="copy the carried .gpu/parts into DIR, join what is complete")
    args = ap.parse_args(argv)
    if set(args.models.split(",")) - set(MODELS):
        ap.error(f"--models: any of {', '.join(MODELS)} (comma-separated), got {args.models!r}")
    return args


def main():
    args = parse_args()
    if tool_main(args):
        return
    if args.cpu:
        args.context, args.reps, args.reserve, args.model_floor, args.floor = 64, 3, 60, 30, 5
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel on CPU tensors (read when triton is imported)
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run on the GPU machine, or with --cpu to check the script")
    run = Run(args)
    run.report["env"] = environment(args)
    sections = {"kernel": kernel_section, "lossless": lossless_section, "numerics": numerics_section,
                "gpu_tests": gpu_tests_section, "timings": timings_section, "real": real_section,
                "batch": batch_section, "tensorrt": tensorrt_section}
    for name in args.sections.split(","):
        run.section(name, sections[name])
    summary(run.report)
    print(f"\nwritten: {run.out}")


def environment(args) -> dict:
    import glance_rt

    env = {"device": torch.cuda.get_device_name() if not args.cpu else "cpu", "torch": torch.__version__,
           "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"), "python": sys.version.split()[0],
           "glance_rt": str(Path(glance_rt.__file__).parent)}
    for name in ("triton", "transformers", "huggingface-hub", "tokenizers", "safetensors", "numpy", "accelerate"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    env["carried"] = carried_names()
    env["unmet"] = unmet_requirements(env["carried"])
    return env


if __name__ == "__main__":
    main()
