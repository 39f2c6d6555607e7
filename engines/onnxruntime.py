"""ONNX Runtime engines: the exported graphs (`glance-rt export`) run through ONNX Runtime sessions.

Each graph takes the caches it reads as inputs (bound zero-copy to the running model's cache
buffers) and returns only the rows it wrote, which are written back into those buffers, so a
cache is never copied across the graph boundary. The `portable` flavor runs anywhere (tree
attention is a model-local ONNX function); the `plugin` flavor runs every `glance.TreeAttention`
node through glance-rt's compiled kernel library (`ort_plugin`), which the folder carries.
"""

from pathlib import Path

import numpy as np
import torch

from glance_rt.errors import GlanceError

BACKEND = "onnxruntime"


def session_options(path: Path, flavor: str, threads: int | None = None):
    """Options for a session over a graph in the folder `path` (the plugin flavor registers the
    folder's TreeAttention kernel library)."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise GlanceError("ONNX Runtime engines need onnxruntime: pip install 'glance-rt[onnx]'") from e
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    if flavor == "plugin":
        from glance_rt.engines.ort_plugin import library_for

        so.register_custom_ops_library(str(library_for(path)))
    return so


def _session(path: Path, info: dict, flavor: str):
    import onnxruntime as ort

    so = session_options(path, flavor, torch.get_num_threads())
    return ort.InferenceSession(str(path / info["file"]), so, providers=["CPUExecutionProvider"])


def runners(path: Path, manifest: dict, graphs) -> dict:
    """The callables StaticPasses runs, one ONNX Runtime session per graph."""
    from glance_rt.engines.engine import verify_by_rows
    from glance_rt.export.onnx import graph_caches, written_rows

    fns, verify = {}, {}
    for key, info in manifest["graphs"].items():
        name = key.split("-")[0]
        sess = _session(path, info, manifest["flavor"])
        bufs = [b for cache in graph_caches(graphs, name) for b in cache.buffers()]
        in_names = [i[0] for i in info["inputs"]]
        n_args = len(in_names) - len(bufs)

        def run(*args, sess=sess, name=name, bufs=bufs, in_names=in_names, n_args=n_args):
            feeds = {n: a.detach().numpy() for n, a in zip(in_names[:n_args], args, strict=True)}
            feeds.update({n: b.numpy() for n, b in zip(in_names[n_args:], bufs, strict=True)})  # zero-copy views
            outs = sess.run(None, feeds)
            rows = written_rows(graphs, name, args)
            n_out = len(outs) - len(bufs)
            for b, new in zip(bufs, outs[n_out:], strict=True):
                b.index_copy_(2, rows, torch.from_numpy(np.ascontiguousarray(new)))
            res = tuple(torch.from_numpy(o) for o in outs[:n_out])
            return res if len(res) > 1 else res[0]

        if name == "verify":
            verify[int(key.split("-")[1])] = run
        else:
            fns[name] = run

    fns["verify"] = verify_by_rows(verify)
    return fns


def build(decoder, out: Path, budgets, chain: bool, chunk: int, manifest: dict, progress: bool = True,
          flavor: str = "portable", ort_include=None) -> None:
    """Export the graphs, then save each as ONNX Runtime's optimized graph. The plugin flavor first
    compiles the TreeAttention kernel library into the folder (`ort_include`: its C API headers)."""
    from importlib import metadata

    from glance_rt.export.onnx import export_onnx

    if flavor == "plugin":
        from glance_rt.engines import ort_plugin

        ort_plugin.build_library(out, ort_include)
        manifest["plugin_library"] = {"file": ort_plugin.LIBRARY, "source_sha256": ort_plugin.source_hash()}
    opset = manifest.setdefault("opset", 20)
    graphs = export_onnx(decoder, out, budgets, chain, chunk, flavor, opset, progress)
    for key, info in graphs.items():
        opt = out / f"{key}.opt.onnx"
        if not opt.exists():
            so = session_options(out, flavor)
            tmp = out / f"{key}.opt.tmp.onnx"
            so.optimized_model_filepath = str(tmp)
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                        f"{key}.opt.onnx.data")
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            import onnxruntime as ort

            ort.InferenceSession(str(out / info["file"]), so, providers=["CPUExecutionProvider"])
            tmp.replace(opt)
        info["exported"], info["file"] = info["file"], opt.name
    libs = {"onnxruntime": metadata.version("onnxruntime"), "onnx": metadata.version("onnx")}
    manifest.update(flavor=flavor, graphs=graphs, versions={**manifest["versions"], **libs},
                    session_options={"graph_optimization_level": "ORT_ENABLE_ALL",
                                     "providers": ["CPUExecutionProvider"],
                                     "intra_op_num_threads": "torch.get_num_threads() at load"})
