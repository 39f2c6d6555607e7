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
    eagle3_shape,
    graph_budgets,
    lookup_buckets,
    read_manifest,
    source,
    versions,
    write_manifest,
)
from glance_rt.hf.target import load_target
from glance_rt.method import check_numerics
from glance_rt.models.eagle3 import Eagle3Drafter, open_drafter
from glance_rt.models.exact import ExactNumerics
from glance_rt.models.kernels import PREFILL_ROWS, KernelTuner, cpu_model, machine
from glance_rt.models.linear import can_pack
from glance_rt.round.adaptive import AdaptiveBudget
from glance_rt.round.tree import default_lookup_budget, grafts_lookup, max_depth, with_lookup_bucket
from glance_rt.round.verify import Backend, static_graphs, static_passes, verify_rows

ENGINE_BACKENDS = ("aoti", "onnxruntime", "tensorrt")
CACHE_LAYOUT = "slot-major"  # KVCache's [slots, KVH, L, D]: what a batched engine's graphs were built over
# the first flavor is the default
FLAVORS = {"aoti": ("frozen", "shared"), "onnxruntime": ("portable", "plugin"), "tensorrt": ("plugin",)}
# the kernels an aoti flavor runs: `shared` torch's own GEMM (MKL) on the plain weights, `frozen` oneDNN's
# prepacked layouts (the tuner's third kernel, MKL over transposed weights, is no flavor of an engine)
FLAVOR_KERNELS = ("mkl", "onednn")


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
                 tuner: KernelTuner | None = None, lookup_budget: int = 0, numerics: str = "fast",
                 max_batch: int = 1, mapped_weights: bool = False, dynamic_rows: bool | None = None) -> Path:
    """Build the static graphs of `target` (+ `drafter`) for `backend` into the folder `out`.
    An interrupted build resumes from its finished graphs; the manifest is written last.
    `flavor` (None: the backend's default, the first in FLAVORS): for aoti, "frozen" compiles the
    weights into every package (Inductor freezing: oneDNN-packed linears on a CPU) and "shared" hands
    one copy of the running model's weights to all packages at load; for onnxruntime, "plugin" runs
    tree attention through glance-rt's compiled kernel library, built against the ONNX Runtime C API
    headers in `ort_include`; an aoti flavor left unset is chosen per graph by timing its linear
    layers both ways on this machine (`choose_flavor`, with `tuner`; recorded in the manifest with
    the CPU model, flavor "mixed" where the graphs differ); tensorrt takes "plugin" alone (its
    TreeAttention plugin runs the Triton kernel) and needs a target on a CUDA GPU. `image_sizes`
    (onnxruntime and tensorrt, VLM targets): (W, H) image buckets to build vision graphs for.
    `lookup_budget` > 0 adds the verify graph of lookup rounds of that many rows (the CLI adds the
    default's, `default_lookup_budget`); `budgets` stay the tree budgets a load picks among.
    `numerics` "exact" (aoti, or onnxruntime with one sequence and a verify graph per bucket): the decode
    graphs in exact numerics (`glance_rt.models.exact`, the static form), recorded in the manifest; a load
    runs them as a Decoder with numerics="exact".
    `max_batch` > 1 (a GLANCE drafter or none): the caches hold that many sequences and
    the engine carries the batched graphs (`StaticGraphs.verify_batch` per (slots, rows) bucket and
    `draft_batch` per slots bucket: aoti a package each; onnxruntime one graph each with symbolic slots and
    rows, `glance_rt.export.onnx.merge_buckets`; tensorrt one engine each over those graphs, with an
    optimization profile per bucket) for `glance_rt.Batch`; a load runs a Decoder of that max_batch.
    `mapped_weights` (onnxruntime only): a load's sessions all read one memory map of the engine's
    weights file, prepacking off (one copy in memory, slower GEMMs), instead of each prepacking its own.
    `dynamic_rows` (None: on for onnxruntime in fast numerics, and tensorrt, which requires it): the tree
    buckets' verify graphs as one graph with a symbolic row dimension (`glance_rt.export.onnx.merge_buckets`): one ONNX
    Runtime session for all of them (one prepacked copy of the weights instead of one per bucket); a
    TensorRT build makes it one engine with an optimization profile per bucket. False: a graph per bucket."""
    if backend not in FLAVORS:
        raise GlanceError(f"unknown engine backend {backend!r}: choose one of {', '.join(ENGINE_BACKENDS)}")
    if flavor is not None and flavor not in FLAVORS[backend]:
        owner = next((b for b, fl in FLAVORS.items() if flavor in fl and b != backend), None)
        raise GlanceError(f"flavor {flavor!r} with backend {backend!r}: "
                          + (f"the {flavor!r} flavor is for {owner} engines; " if owner else "")
                          + f"{backend} takes {' or '.join(FLAVORS[backend])}")
    exact_mode = check_numerics(numerics) == "exact"
    if exact_mode and backend == "tensorrt":
        raise GlanceError("exact numerics engines are built with --backend aoti or onnxruntime: TensorRT picks each "
                          "engine's GEMM tactics by its own timing, so the AR step's engine and a verify engine could "
                          "compute the same 8-row block differently")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise GlanceError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if exact_mode and backend == "onnxruntime" and (max_batch > 1 or dynamic_rows):
        raise GlanceError("an exact numerics onnxruntime engine takes one sequence and a verify graph per tree bucket "
                          "(its GEMMs are blocks of a fixed row count, so neither the rows nor the batch can be "
                          "symbolic): drop --max-batch / --dynamic-rows, or build it with --backend aoti")
    if max_batch > 1 and eagle3_shape(drafter) is not None:
        raise GlanceError(f"--max-batch {max_batch}: batched engines are built over a GLANCE drafter or none; "
                          "EAGLE-3 heads take one sequence")
    if mapped_weights and backend != "onnxruntime":
        raise GlanceError(f"--mapped-weights is for onnxruntime engines; {backend} engines already hold one copy of "
                          "the weights in memory (aoti) or keep them in their engines (tensorrt)")
    if dynamic_rows and backend == "aoti":
        raise GlanceError("--dynamic-rows is for onnxruntime engines (tensorrt engines always have it); an aoti "
                          "engine compiles a package per verify bucket, sharing one copy of the weights at load")
    if dynamic_rows is False and backend == "tensorrt":
        raise GlanceError("--graph-per-bucket: a tensorrt engine builds ONE verify engine with an optimization profile "
                          "per tree bucket (from the dynamic-rows verify graph); drop the flag")
    if dynamic_rows is None:
        dynamic_rows = backend == "tensorrt" or (backend == "onnxruntime" and not exact_mode)
    impl = _backend(backend)
    image_sizes = [list(s) for s in image_sizes]
    if image_sizes and backend == "aoti":
        raise GlanceError("vision graphs (--image-size) are built for onnxruntime and tensorrt engines; an aoti engine "
                          "runs the vision tower in torch at prefill")
    tree_budgets = graph_budgets(drafter, budgets, max_len, chunk)
    budgets = lookup_buckets(drafter, chain, tree_budgets, lookup_budget)
    flavor, graph_flavors, kernels = choose_flavor(backend, flavor, target, drafter, budgets, chain, chunk, tuner)
    out = Path(out)
    config = {"backend": backend, "budgets": list(budgets), "tree_budgets": list(tree_budgets),
              "lookup_budget": lookup_budget or None, "chain": chain, "max_len": max_len, "chunk": chunk,
              "flavor": flavor, "image_sizes": image_sizes, "numerics": numerics, "max_batch": max_batch,
              "cache_layout": CACHE_LAYOUT,
              "dynamic_rows": dynamic_rows}
    if (out / "manifest.json").exists():
        raise GlanceError(f"{out} already holds an engine: pick another --out, or delete it to rebuild")
    exact = ExactNumerics(static=True) if exact_mode else None
    graphs = static_graphs(target, drafter, max_len, exact, max_batch)  # the plain weights: what gets traced
    manifest = {"format": FORMAT, **config, "block_size": drafter.block_size if drafter is not None else 1,
                "source": source(target, drafter), "versions": versions(), "eagle3": eagle3_shape(drafter),
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
        keep = ("backend", "budgets", "lookup_budget", "chain", "max_len", "chunk", "flavor", "image_sizes", "source",
                "versions", "numerics", "max_batch", "dynamic_rows")
        (out / "build.json.tmp").write_text(json.dumps({k: manifest[k] for k in keep}, indent=2))
        (out / "build.json.tmp").replace(started)
    if backend == "onnxruntime":
        impl.build(graphs, out, budgets, chain, chunk, manifest, progress, flavor=flavor, ort_include=ort_include,
                   image_sizes=image_sizes, target=target, mapped_weights=mapped_weights, dynamic_rows=dynamic_rows)
    elif backend == "tensorrt":
        impl.build(graphs, out, budgets, chain, chunk, manifest, progress, flavor=flavor, image_sizes=image_sizes,
                   target=target)
    else:
        impl.build(graphs, out, budgets, chain, chunk, manifest, progress, flavor=graph_flavors or flavor)
    write_manifest(out, manifest)
    return out


def graph_linears(target, drafter, budgets, chain: bool, chunk: int) -> dict[str, Counter]:
    """graph name -> Counter of the (out, in, rows, dtype) linear calls one run of that graph makes:
    prefill (the text model at PREFILL_ROWS rows, the head at one), each verify bucket (its rows,
    head included), and with a drafter, context (fc, k and v projections at `chunk` rows) and draft
    (the context part at a path's `max_depth` + 1 rows, the whole drafter at the block's rows, then the
    head)."""
    def calls(module, rows, keep=lambda name: True):
        return Counter((m.out_features, m.in_features, rows, m.weight.dtype) for n, m in module.named_modules()
                       if isinstance(m, nn.Linear) and keep(n))

    head = target.parts.lm_head.weight
    text = target.parts.text_model
    out = {"prefill": calls(text, PREFILL_ROWS) + Counter({(*head.shape, 1, head.dtype): 1})}
    block = drafter.block_size if drafter is not None else 1
    for budget in budgets:
        rows = verify_rows(budget, chain, block)
        out[f"verify-{rows}"] = calls(text, rows) + Counter({(*head.shape, rows, head.dtype): 1})
    if isinstance(drafter, Eagle3Drafter):  # context: the head at `chunk` rows, its logits at one; a depth
        head = drafter.head                     # pass: the head but fc at k rows
        vocab = head.lm_head.weight
        out["eagle3_context"] = (calls(head, chunk, lambda n: n != "lm_head")
                                 + Counter({(*vocab.shape, 1, vocab.dtype): 1}))
        for k in sorted({drafter.depth_rows(b, chain) for b in budgets if b}):
            out[f"eagle3_depth-{k}"] = calls(head, k, lambda n: n != "fc")
    elif drafter is not None:
        def is_context(name):
            return name == "fc" or name.endswith(("k_proj", "v_proj"))

        draft_rows = drafter.config.draft_vocab_size or head.shape[0]  # the head over the draft vocabulary
        out["context"] = calls(drafter, chunk, is_context)
        out["draft"] = (calls(drafter, max_depth(block) + 1, is_context) + calls(drafter, block)
                        + Counter({(draft_rows, head.shape[1], block, head.dtype): 1}))
    return out


def choose_flavor(backend: str, flavor: str | None, target, drafter, budgets, chain: bool, chunk: int,
                  tuner: KernelTuner | None = None):
    """(flavor, {graph: flavor} or None, the manifest's "kernels" record). An aoti engine of an fp32
    CPU target left unset is timed here, graph by graph: each linear call the graph makes
    (`graph_linears`), torch's own kernel (MKL, what `shared` runs) against oneDNN's prepacked one
    (what `frozen` compiles), summed over the graph; `frozen` only where oneDNN is faster by the
    tuner's margin. The flavor is then the graphs' common one, or "mixed". Otherwise the backend's
    default. The record names the machine, so a load on another CPU can say so."""
    record = {"machine": machine(), "chosen_by": "user" if flavor is not None else "default"}
    if flavor is not None or backend != "aoti" or not can_pack(target.parts.lm_head.weight):
        return flavor or FLAVORS[backend][0], None, record
    tuner = tuner or KernelTuner()
    calls = graph_linears(target, drafter, budgets, chain, chunk)
    times = tuner.timings(sorted({k for c in calls.values() for k in c}, key=str))
    per_graph, seconds = {}, {}
    for name, count in calls.items():
        total = {k: sum(n * times[call][k] for call, n in count.items()) for k in FLAVOR_KERNELS}
        per_graph[name] = "frozen" if tuner.choose(total) == "onednn" else "shared"
        seconds[name] = total
    kinds = set(per_graph.values())
    flavor = kinds.pop() if len(kinds) == 1 else "mixed"
    return flavor, per_graph, {**record, "chosen_by": "measurement", "graphs": per_graph, "linear_seconds": seconds}


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
        drafter = open_drafter(m["drafter_source"], target, m.get("eagle3"))
    return target, drafter


def engine_backend(path, m: dict) -> Backend:
    """The Backend that runs the engine in `path` (manifest `m`): its graphs loaded over the
    Decoder's own modules and caches, and its vision graphs (if any) for the prompt's images."""
    impl = _backend(m["backend"])
    exact = m.get("prefill") == "exact"  # older engines (and onnxruntime's) run the prompt in padded chunks
    passes = static_passes(lambda graphs: impl.runners(path, m, graphs), m["chunk"], exact)
    vision = (lambda target: impl.vision(path, m, target)) if m.get("vision") else None
    return Backend(m["backend"], passes, prefill_inputs=vision, prepack=False)


def load_engine(cls, path, target=None, drafter=None, tree_budget=None, lookup: int | None = None, gate=None,
                lookup_budget: int | None = None, numerics: str | None = None, max_batch: int | None = None,
                prefill_chunk: int | None = None):
    """A `cls` (Decoder) whose passes run the engine in `path`. `tree_budget` None: the largest
    tree budget it was built for (not its lookup rounds' bucket). The draft gate (`gate` None: where
    it can run) needs the one-row verify graph that `--tree-budget 0` builds. Lookup rounds verify
    `lookup_budget` rows where the engine has that bucket (None: the rows it was built for, which
    `build-engine` adds by default, or the default's; else the tree's budget). `numerics`: what the
    engine must have been built with (None: whatever it was); `max_batch` likewise (`--max-batch`)."""
    path = Path(path)
    m = read_manifest(path)
    if (warning := check_machine(path, m)) is not None:
        warnings.warn(warning, GlanceWarning, stacklevel=3)
    built = m.get("numerics", "fast")
    if numerics is not None and numerics != built:
        raise GlanceError(f"engine {path} was built with {built} numerics, {numerics} asked: rebuild it with "
                          f"`glance-rt build-engine{' --exact' if numerics == 'exact' else ''}` or ask for {built}")
    slots = m.get("max_batch", 1)
    if slots > 1 and m.get("cache_layout") != CACHE_LAYOUT:
        raise GlanceError(f"engine {path} was built for batches with caches laid out along the row axis, before "
                          "they became slot-major (`glance_rt.models.kv_cache`): rebuild it with this glance-rt")
    if max_batch is not None and max_batch != slots:
        raise GlanceError(f"engine {path} was built for batches of {slots}, max_batch={max_batch} asked: rebuild it "
                          f"with `glance-rt build-engine --max-batch {max_batch}` or ask for {slots}")
    target, drafter = _load_sources(m, target, drafter)
    check_manifest(m, target, drafter, path)
    budgets = m["budgets"]
    if tree_budget is None:
        tree_budget = max(m.get("tree_budgets", budgets)) or 1
    asked = [b.budget for b in tree_budget.buckets] if isinstance(tree_budget, AdaptiveBudget) else [tree_budget]
    if drafter is not None and any(b not in budgets for b in asked):
        raise GlanceError(f"engine {path} has tree budgets {budgets}; {asked} asked. Pick among them or rebuild "
                          "with `glance-rt build-engine --tree-budget ...`")
    if drafter is not None and 0 not in budgets:
        if gate is not None and gate is not False:
            raise GlanceError(f"engine {path} has no one-row verify graph (tree budgets {budgets}), which the draft "
                              "gate runs: rebuild with `--tree-budget 0` added, or pass gate=False")
        gate = False
    if grafts_lookup(drafter, m["chain"]) and lookup != 0:
        rows = lookup_budget if lookup_budget is not None else (
            m.get("lookup_budget") or default_lookup_budget(drafter.block_size))
        if rows in with_lookup_bucket(asked, rows) and rows not in budgets:  # a bucket of its own, not built
            if lookup_budget is not None:
                raise GlanceError(f"engine {path} has tree budgets {budgets}; lookup rounds of {rows} rows asked. "
                                  f"Rebuild with `glance-rt build-engine --tree-budget ...,{rows}` or leave it unset")
            rows = max(asked)  # lookup rounds at the tree's shape
        lookup_budget = rows
    return cls(target, drafter, tree_budget=tree_budget, chain=m["chain"], max_length=m["max_len"],
               backend=engine_backend(path, m), lookup=lookup, gate=gate, lookup_budget=lookup_budget, numerics=built,
               max_batch=slots, prefill_chunk=prefill_chunk)
