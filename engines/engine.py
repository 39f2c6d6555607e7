"""Build and load engines: `build_engine` (what `glance-rt build-engine` runs) and `load_engine`
(behind `Decoder.from_engine`), dispatching on the backend named in the manifest."""

import json
import warnings
from collections import Counter
from pathlib import Path

from torch import nn

from glance_rt.engines import aoti, onnxruntime
from glance_rt.errors import GlanceError, GlanceWarning, require
from glance_rt.export.manifest import (
    FORMAT,
    check_manifest,
    graph_budgets,
    read_manifest,
    source,
    versions,
    write_manifest,
)
from glance_rt.hf.target import load_target
from glance_rt.models.drafter import load_drafter
from glance_rt.models.kernels import KernelTuner, cpu_model, machine
from glance_rt.models.linear import can_pack
from glance_rt.round.adaptive import AdaptiveBudget
from glance_rt.round.verify import Backend, static_graphs, static_passes

ENGINE_BACKENDS = ("aoti", "onnxruntime", "tensorrt")
# the first flavor is the default
FLAVORS = {"aoti": ("frozen", "shared"), "onnxruntime": ("portable", "plugin"), "tensorrt": ("plugin",)}


def _backend(name: str):
    if name == "aoti":
        return aoti
    if name in ("onnxruntime", "onnx"):  # a `glance-rt export` folder also runs as-is
        require("onnx", "onnx", "onnxruntime", "onnxscript")
        return onnxruntime
    if name == "tensorrt":
        require("onnx", "onnx", "onnxscript")
        require("tensorrt", "tensorrt", "triton")
        from glance_rt.engines import tensorrt

        return tensorrt
    raise GlanceError(f"unknown engine backend {name!r}: choose one of {', '.join(ENGINE_BACKENDS)}")


def build_engine(target, drafter, out, backend: str = "aoti", budgets=(8,), chain: bool = False,
                 max_len: int = 1024, chunk: int = 64, target_source=None, drafter_source=None,
                 progress: bool = True, flavor: str | None = None, ort_include=None, image_sizes=(),
                 tuner: KernelTuner | None = None) -> Path:
    """Build the static graphs of `target` (+ `drafter`) for `backend` into the folder `out`.
    An interrupted build resumes from its finished graphs; the manifest is written last.
    `flavor` (None: the backend's default, the first in FLAVORS): for aoti, "frozen" compiles the
    weights into every package (Inductor freezing: oneDNN-packed linears on a CPU) and "shared" hands
    one copy of the running model's weights to all packages at load; for onnxruntime, "plugin" runs
    tree attention through glance-rt's compiled kernel library, built against the ONNX Runtime C API
    headers in `ort_include`; an aoti flavor left unset is chosen by timing the verify pass's linear
    layers both ways on this machine (`choose_flavor`, with `tuner`; recorded in the manifest with
    the CPU model); tensorrt takes "plugin" alone (its TreeAttention plugin runs the Triton
    kernel) and needs a target on a CUDA GPU. `image_sizes` (onnxruntime and tensorrt, VLM targets):
    (W, H) image buckets to build vision graphs for."""
    if backend not in FLAVORS:
        raise GlanceError(f"unknown engine backend {backend!r}: choose one of {', '.join(ENGINE_BACKENDS)}")
    if flavor is not None and flavor not in FLAVORS[backend]:
        owner = next((b for b, fl in FLAVORS.items() if flavor in fl and b != backend), None)
        raise GlanceError(f"flavor {flavor!r} with backend {backend!r}: "
                          + (f"the {flavor!r} flavor is for {owner} engines; " if owner else "")
                          + f"{backend} takes {' or '.join(FLAVORS[backend])}")
    impl = _backend(backend)
    image_sizes = [list(s) for s in image_sizes]
    if image_sizes and backend == "aoti":
        raise GlanceError("vision graphs (--image-size) are built for onnxruntime and tensorrt engines; an aoti engine "
                          "runs the vision tower in torch at prefill")
    budgets = graph_budgets(drafter, budgets, max_len, chunk)
    flavor, kernels = choose_flavor(backend, flavor, target, budgets, tuner)
    out = Path(out)
    config = {"backend": backend, "budgets": list(budgets), "chain": chain, "max_len": max_len, "chunk": chunk,
              "flavor": flavor, "image_sizes": image_sizes}
    if (out / "manifest.json").exists():
        raise GlanceError(f"{out} already holds an engine: pick another --out, or delete it to rebuild")
    graphs = static_graphs(target, drafter, max_len)  # the plain weights: they are what gets traced
    manifest = {"format": FORMAT, **config, "block_size": drafter.block_size if drafter is not None else 1,
                "source": source(target, drafter), "versions": versions(),
                "target_source": None if target_source is None else str(target_source),
                "drafter_source": None if drafter_source is None else str(drafter_source), "kernels": kernels}
    started = out / "build.json"
    if out.exists() and any(out.iterdir()):
        if not started.exists():
            raise GlanceError(f"{out} is not empty and holds no engine build: pick an empty or new --out folder")
        old = json.loads(started.read_text())
        if old != {k: manifest[k] for k in old}:
            raise GlanceError(f"{out} holds an unfinished build of another engine ({old}); "
                              "delete it or pick another --out")
    out.mkdir(parents=True, exist_ok=True)
    if not started.exists():
        keep = ("backend", "budgets", "chain", "max_len", "chunk", "flavor", "image_sizes", "source", "versions")
        (out / "build.json.tmp").write_text(json.dumps({k: manifest[k] for k in keep}, indent=2))
        (out / "build.json.tmp").replace(started)
    if backend == "onnxruntime":
        impl.build(graphs, out, budgets, chain, chunk, manifest, progress, flavor=flavor, ort_include=ort_include,
                   image_sizes=image_sizes, target=target)
    elif backend == "tensorrt":
        impl.build(graphs, out, budgets, chain, chunk, manifest, progress, flavor=flavor, image_sizes=image_sizes,
                   target=target)
    else:
        impl.build(graphs, out, budgets, chain, chunk, manifest, progress, flavor=flavor)
    write_manifest(out, manifest)
    return out


def choose_flavor(backend: str, flavor: str | None, target, budgets, tuner: KernelTuner | None = None):
    """(flavor, the manifest's "kernels" record). An aoti engine of an fp32 CPU target left unset is
    timed here: each linear layer of the target at the largest verify bucket's rows, torch's own
    kernel (MKL, what `shared` runs) against oneDNN's prepacked one (what `frozen` compiles), summed
    over the layers; `frozen` only where oneDNN is faster by the tuner's margin. Otherwise the
    backend's default. The record names the machine, so a load on another CPU can say so."""
    record = {"machine": machine(), "chosen_by": "user" if flavor is not None else "default"}
    if flavor is not None or backend != "aoti" or not can_pack(target.parts.lm_head.weight):
        return flavor or FLAVORS[backend][0], record
    tuner = tuner or KernelTuner()
    rows = max(budgets) + 1
    count = Counter((m.out_features, m.in_features, m.weight.dtype) for m in target.parts.text_model.modules()
                    if isinstance(m, nn.Linear))
    head = target.parts.lm_head.weight
    count[(*head.shape, head.dtype)] += 1
    times = tuner.timings([(o, i, rows, dt) for o, i, dt in count])
    total = {k: sum(n * times[(o, i, rows, dt)][k] for (o, i, dt), n in count.items()) for k in ("mkl", "onednn")}
    flavor = "frozen" if tuner.choose(total) == "onednn" else "shared"
    return flavor, {**record, "chosen_by": "measurement", "verify_rows": rows, "linear_seconds": total}


def check_machine(path, m: dict) -> str | None:
    """A warning when the engine in `path` was built (and its kernels chosen) on another CPU model."""
    built = (m.get("kernels") or {}).get("machine", {}).get("cpu")
    here = cpu_model()
    if built is None or built == here:
        return None
    return (f"engine {path} was built and tuned on a {built}; this CPU is a {here}, where its kernel choice "
            f"(flavor {m.get('flavor')!r}) may be slower: rebuild it here to re-tune")


def _load_sources(m: dict, target, drafter):
    if target is None:
        target = load_target(m["target_source"], dtype=m["source"]["dtype"], device=m["source"]["device"])
    if drafter is None and m["source"]["drafter_weights"] is not None:
        drafter = load_drafter(m["drafter_source"], target)
    return target, drafter


def engine_backend(path, m: dict) -> Backend:
    """The Backend that runs the engine in `path` (manifest `m`): its graphs loaded over the
    Decoder's own modules and caches, and its vision graphs (if any) for the prompt's images."""
    impl = _backend(m["backend"])
    exact = m.get("prefill") == "exact"  # older engines (and onnxruntime's) run the prompt in padded chunks
    passes = static_passes(lambda graphs: impl.runners(path, m, graphs), m["chunk"], exact)
    vision = (lambda target: impl.vision(path, m, target)) if m.get("vision") else None
    return Backend(m["backend"], passes, prefill_inputs=vision, prepack=False)


def load_engine(cls, path, target=None, drafter=None, tree_budget=None, lookup: int | None = None):
    """A `cls` (Decoder) whose passes run the engine in `path`."""
    path = Path(path)
    m = read_manifest(path)
    if (warning := check_machine(path, m)) is not None:
        warnings.warn(warning, GlanceWarning, stacklevel=3)
    target, drafter = _load_sources(m, target, drafter)
    check_manifest(m, target, drafter, path)
    budgets = m["budgets"]
    if tree_budget is None:
        tree_budget = max(budgets) or 1
    asked = [b.budget for b in tree_budget.buckets] if isinstance(tree_budget, AdaptiveBudget) else [tree_budget]
    if drafter is not None and any(b not in budgets for b in asked):
        raise GlanceError(f"engine {path} has tree budgets {budgets}; {asked} asked. Pick among them or rebuild "
                          "with `glance-rt build-engine --tree-budget ...`")
    return cls(target, drafter, tree_budget=tree_budget, chain=m["chain"], max_length=m["max_len"],
               backend=engine_backend(path, m), lookup=lookup)
