"""ONNX Runtime engines: the exported graphs (`glance-rt export`) run through ONNX Runtime sessions.

Each graph takes the caches it reads as inputs (bound through IOBinding to the running model's
cache buffers) and returns only the rows it wrote, which are written back into those buffers, so a
cache is never copied across the graph boundary. The `portable` flavor runs anywhere (tree
attention is a model-local ONNX function); the `plugin` flavor runs every `glance.TreeAttention`
node through glance-rt's compiled kernel library (`ort_plugin`), which the folder carries.

Weights: the graphs share one data file on disk (`glance_rt.export.weights`). In memory, by default
("prepacked"), each session prepacks its own copy for its GEMMs (the fastest kernels; +2.3 GB for the
default target's six graphs, 0.5 GB less as five with one verify graph for every tree bucket, the
default `dynamic_rows`). An engine built with mapped weights (`build-engine --mapped-weights`)
hands every session the same read-only memory map of the data file and turns prepacking off: one copy
of the weights, shared with the page cache, at a measured cost in speed (docs/engines.md).
"""

import math
from pathlib import Path

import torch

from glance_rt.engines import ort_plugin
from glance_rt.engines.ort_plugin import library_for
from glance_rt.errors import require
from glance_rt.export.onnx import concrete, export_onnx, exported_runners, write_back, written_rows
from glance_rt.export.vision import VisionGraphs, export_vision
from glance_rt.export.weights import mapped_initializers, share_weights

BACKEND = "onnxruntime"


def session_options(path: Path, flavor: str, threads: int | None = None):
    """Options for a session over a graph in the folder `path` (the plugin flavor registers the
    folder's TreeAttention kernel library)."""
    require("onnx", "onnxruntime")
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    # ONNX Runtime's pool threads spin after each run by default, taking the cores from the torch work
    # between graph calls (tree, acceptance bookkeeping, cache write-back), slowing it down (docs/engines.md).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if flavor == "plugin":

        so.register_custom_ops_library(str(library_for(path)))
    return so


def _session(path: Path, info: dict, flavor: str, mapped: dict | None = None):
    """A session over one graph. `mapped` None: it prepacks its own copy of the weights (as
    `add_external_initializers` does too: that copies); else the engine's one memory map of its data file
    (`mapped_initializers`, this dict shared by all its sessions and kept as long as they are) with
    prepacking off, which alone keeps ONNX Runtime from copying (docs/benchmarks.md 2026-12-05)."""
    import onnxruntime as ort

    so = session_options(path, flavor, torch.get_num_threads())
    if mapped is not None:
        so.add_session_config_entry("session.disable_prepacking", "1")
        for name, value in mapped_initializers(path, info["file"], mapped):
            so.add_initializer(name, value)
    return ort.InferenceSession(str(path / info["file"]), so, providers=["CPUExecutionProvider"])


def _weights(manifest: dict) -> dict | None:
    """The engine's shared memory map of its weights (filled as sessions load), or None: prepacked."""
    return {} if manifest.get("weights", "prepacked") == "mapped" else None


DTYPES = {"float": torch.float32, "float32": torch.float32, "float16": torch.float16, "int64": torch.int64,
          "bool": torch.bool}


def _bind(binding, name: str, t: torch.Tensor, output: bool = False) -> None:
    """Bind a CPU tensor's own memory to a graph input or output (no copy)."""
    ptr = t.data_ptr() or t.untyped_storage().data_ptr()  # an empty tensor reports a null data_ptr
    args = (name, "cpu", 0, t.numpy().dtype, list(t.shape), ptr)
    binding.bind_output(*args) if output else binding.bind_input(*args)


def _empty(shape, dtype) -> torch.Tensor:
    """A tensor of `shape` whose memory has an address even when it holds no element (IOBinding
    refuses a null pointer: a target without a drafter has [T, 0] features)."""
    n = math.prod(shape)
    return torch.empty(max(n, 1), dtype=dtype)[:n].view(shape)


class BoundGraph:
    """One graph's session with its I/O bound once through IOBinding: the caches it reads are the
    model's cache buffers, its outputs are preallocated tensors; per call only the small inputs are
    rebound. The rows it wrote come back as outputs and are copied into the caches. `dims`: the bucket it
    runs a graph exported for several at (`served`: its outputs' shapes; one BoundGraph per bucket, one
    session for all).

    Outputs are reused by the next call of the same graph (as with a CUDA-graph replay)."""

    def __init__(self, sess, info: dict, name: str, graphs, bufs: list, weights: dict | None = None,
                 dims: dict | None = None):
        self.sess, self.name, self.graphs, self.bufs = sess, name, graphs, bufs
        self.weights = weights  # the memory map its session reads (mapped weights): alive as long as it is
        self.in_names = [i[0] for i in info["inputs"][: len(info["inputs"]) - len(bufs)]]
        self.binding = sess.io_binding()
        for (n, _, _), b in zip(info["inputs"][len(self.in_names) :], bufs, strict=True):
            _bind(self.binding, n, b)
        self.outs = [_empty(concrete(shape, dims), DTYPES[dt]) for _, shape, dt in info["outputs"]]  # [*shape]
        for (n, _, _), t in zip(info["outputs"], self.outs, strict=True):
            _bind(self.binding, n, t, output=True)
        self.n_out = len(self.outs) - len(bufs)

    def __call__(self, *args):
        args = [a.detach().contiguous() for a in args]  # alive (and bound) until the run returns
        for n, a in zip(self.in_names, args, strict=True):
            _bind(self.binding, n, a)
        self.sess.run_with_iobinding(self.binding)
        write_back(self.bufs, written_rows(self.graphs, self.name, args), self.outs[self.n_out :])
        res = tuple(self.outs[: self.n_out])
        return res if len(res) > 1 else res[0]


def runners(path: Path, manifest: dict, graphs) -> dict:
    """The callables StaticPasses runs, one ONNX Runtime session per graph (a dynamic-rows verify graph:
    one session bound once per bucket; mapped weights: all over one memory map of the engine's data file)."""
    mapped, sessions = _weights(manifest), {}

    def make(info, name, bufs, dims):
        if info["file"] not in sessions:
            sessions[info["file"]] = _session(path, info, manifest["flavor"], mapped)
        return BoundGraph(sessions[info["file"]], info, name, graphs, bufs, mapped, dims)

    return exported_runners(manifest, graphs, make)


def vision(path: Path, manifest: dict, target):
    """The engine's vision graphs (one per image bucket) as a `prefill_inputs` for the Decoder."""
    return VisionGraphs(target, path, manifest, lambda p, info: _session(p, info, "portable")).prefill_inputs


def _optimize(out: Path, key: str, info: dict, flavor: str) -> None:
    """Save graph `key` as ONNX Runtime's optimized graph (once) and point `info` at it."""
    import onnxruntime as ort

    opt = out / f"{key}.opt.onnx"
    if not opt.exists():
        so = session_options(out, flavor)
        tmp = out / f"{key}.opt.tmp.onnx"
        so.optimized_model_filepath = str(tmp)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{key}.opt.onnx.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(str(out / info["file"]), so, providers=["CPUExecutionProvider"])
        tmp.replace(opt)
    info["exported"], info["file"] = info["file"], opt.name


def build(graphs, out: Path, budgets, chain: bool, chunk: int, manifest: dict, progress: bool = True,
          flavor: str = "portable", ort_include=None, image_sizes=(), target=None,
          mapped_weights: bool = False, dynamic_rows: bool = True) -> None:
    """Export the graphs (and a VLM's vision graphs, one per image size), then save each as ONNX
    Runtime's optimized graph. The plugin flavor first compiles the TreeAttention kernel library
    into the folder (`ort_include`: its C API headers). `mapped_weights`: a load's decode sessions read
    one memory map of the weights (manifest `weights`: "mapped"; else "prepacked", each session its own
    copy; vision sessions prepack theirs either way). `dynamic_rows`: one verify graph (one session) for
    every tree bucket (`glance_rt.export.onnx.dynamic_verify`), recorded in the manifest."""
    from importlib import metadata


    if flavor == "plugin":

        ort_plugin.build_library(out, ort_include)
        manifest["plugin_library"] = {"file": ort_plugin.LIBRARY, "source_sha256": ort_plugin.source_hash()}
    opset = manifest.setdefault("opset", 20)
    exported = export_onnx(graphs, out, budgets, chain, chunk, flavor, opset, progress, dynamic_rows)
    for key, info in exported.items():
        _optimize(out, key, info, flavor)
    optimized = [info["file"] for info in exported.values()]
    if image_sizes:

        manifest["vision"] = export_vision(target, out, image_sizes, opset, progress)
        for key, info in manifest["vision"].items():
            _optimize(out, key, info, "portable")
        optimized += [info["file"] for info in manifest["vision"].values()]
    share_weights(out, optimized)  # ONNX Runtime's optimized graphs too: each weight once
    libs = {"onnxruntime": metadata.version("onnxruntime"), "onnx": metadata.version("onnx")}
    manifest.update(flavor=flavor, graphs=exported, dynamic_rows=dynamic_rows,
                    versions={**manifest["versions"], **libs},
                    session_options={"graph_optimization_level": "ORT_ENABLE_ALL",
                                     "providers": ["CPUExecutionProvider"], "session.intra_op.allow_spinning": "0",
                                     "intra_op_num_threads": "torch.get_num_threads() at load",
                                     **({"session.disable_prepacking": "1"} if mapped_weights else {})},
                    weights="mapped" if mapped_weights else "prepacked")
