"""TensorRT engines: one serialized engine per static graph, built from the `plugin` flavor ONNX export
with every `glance.TreeAttention` node run by glance-rt's TensorRT plugin (`plugins/tensorrt_plugin.py`:
the Triton kernel compiled ahead of time and baked into the engine as PTX).

Build: export the graphs (`export_onnx`, plugin flavor, the tree buckets' verify graphs as one graph
with a symbolic row dimension; a VLM's vision graphs per image bucket), tag a copy of each for
TensorRT (`tensorrt_onnx`), parse it with TensorRT's ONNX parser into a strongly typed network with
TF32 off (fp32 must stay IEEE fp32 for outputs equal to Hugging Face's), serialize to `<graph>.engine`
(written, then renamed: an interrupted build resumes). The verify graph becomes ONE engine with an
optimization profile per tree bucket (`bucket_profiles`: min = opt = max = that bucket's shapes, so each
bucket gets the kernels tuned for its shape, as engines per bucket did, over one copy of the weights);
an engine built for batches (`--max-batch`) likewise makes its batched verify graph one engine with a
profile per (slots, rows) bucket, its batched AR step and draft graphs one each with a profile per
slots bucket. The plugin's launch grid follows the symbolic dimensions (sequences, rows).

Run: each engine (deserialized once) gets one execution context per graph it serves (a verify
engine: one per profile, its input shapes set once), whose tensor addresses are bound once: the caches
it reads are the running model's CUDA cache buffers, its other inputs and its outputs are static CUDA tensors.
The contexts hold no activation memory of their own: a Decoder's decode contexts run one after another
on one stream, so they share one scratch buffer, as large as the largest engine needs (`EngineFiles.share_scratch`),
instead of each allocating the most any of its engine's profiles needs (each vision graph keeps its own).
A call copies its arguments into the static inputs, runs the context, and writes the rows the graph
returned back into the caches; after one warm-up run (TensorRT's deferred work, the driver's PTX JIT)
all of that is captured in one CUDA graph per context and replayed from then on.

TensorRT cannot be installed where glance-rt is developed (its PyPI packages fetch from a host out of
reach) and no GPU is there: the ONNX rewrite is tested; the build and run below are written to the
documented API and have not run (docs/engines.md).
"""

from pathlib import Path

import torch

from glance_rt.errors import GlanceError, require
from glance_rt.export.onnx import DOMAIN, concrete, export_onnx, exported_runners, served, write_back, written_rows
from glance_rt.export.vision import VisionGraphs, export_vision
from glance_rt.files import atomic_write
from glance_rt.plugins import TENSORRT_PLUGIN

BACKEND = "tensorrt"
PLUGIN_NAMESPACE, PLUGIN_OP = TENSORRT_PLUGIN.split("::")  # the parser looks plugins up by (op_type, namespace)
WORKSPACE = 4 << 30  # bytes of scratch TensorRT may use while building and running
DTYPES = {"float": torch.float32, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64, "bool": torch.bool}


def tensorrt_onnx(model):
    """A copy of an exported ModelProto tagged for TensorRT's ONNX parser. The parser finds a plugin by
    the node's op_type and its `plugin_namespace` attribute (it ignores the ONNX domain), and inlines a
    model-local function of the same name unless the node carries that attribute; `aot=1` picks the
    plugin's ahead-of-time implementation (the kernel baked into the engine, no Python at run time).
    The plugin receives every attribute it declares (here `scale`), so each node must carry them all."""
    from onnx import helper

    tagged = type(model)()
    tagged.CopyFrom(model)
    for n in (n for n in tagged.graph.node if n.op_type == PLUGIN_OP and n.domain == DOMAIN):
        names = {a.name for a in n.attribute}
        if "scale" not in names:
            raise GlanceError(f"TreeAttention node {n.name} has no scale attribute: re-export the graph")
        for a in [a for a in n.attribute if a.name in ("plugin_namespace", "plugin_version", "aot")]:
            n.attribute.remove(a)
        n.attribute.extend([helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
                            helper.make_attribute("plugin_version", "1"), helper.make_attribute("aot", 1)])
    keep = [f for f in tagged.functions if not (f.name == "TreeAttention" and f.domain == DOMAIN)]
    del tagged.functions[:]
    tagged.functions.extend(keep)  # the plugin runs it: no standard-op body to inline by mistake
    return tagged


def _tensorrt():
    require("tensorrt", "tensorrt")
    import tensorrt as trt

    from glance_rt.plugins import tensorrt_plugin  # noqa: F401  (registers glance::TreeAttention)

    return trt


def _logger(trt):
    return trt.Logger(trt.Logger.WARNING)


def bucket_profiles(info: dict) -> list[dict[str, list[int]]]:
    """The optimization profiles of a graph exported with symbolic dimensions (manifest `rows` and/or
    `slots`: the buckets it serves), one per bucket in `served` order (slots-major): each pins every
    input with such a dimension to that bucket's shape (min = opt = max). [] for a graph of fixed shapes."""
    dynamic = [(name, shape) for name, shape, _ in info["inputs"] if any(isinstance(d, str) for d in shape)]
    if not dynamic:
        return []
    return [{name: concrete(shape, dims) for name, shape in dynamic} for dims in served(info)]


def build_engine_file(onnx_path: Path, engine_path: Path, profiles=()) -> None:
    """Parse one tagged ONNX graph and serialize its engine to `engine_path` (temporary name, then rename);
    `profiles` (`bucket_profiles`): one optimization profile each, in order."""
    trt = _tensorrt()
    logger = _logger(trt)
    builder = trt.Builder(logger)
    flags = 0
    for flag in ("STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS"):  # STRONGLY_TYPED: always on (and ignored) in TRT 11
        if hasattr(trt.NetworkDefinitionCreationFlag, flag):
            flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, flag))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise GlanceError(f"TensorRT's ONNX parser refused {onnx_path.name}:\n{errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE)
    config.clear_flag(trt.BuilderFlag.TF32)  # on by default: fp32 GEMMs would round their inputs to 10 bits
    for shapes in profiles:
        profile = builder.create_optimization_profile()
        for name, shape in shapes.items():
            profile.set_shape(name, shape, shape, shape)  # min, opt, max
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise GlanceError(f"TensorRT could not build an engine for {onnx_path.name} (its log above says why)")
    atomic_write(engine_path, lambda tmp: tmp.write_bytes(bytes(plan)))


def build(graphs, out: Path, budgets, chain: bool, chunk: int, manifest: dict, progress: bool = True,
          flavor: str = "plugin", image_sizes=(), target=None) -> None:
    """Export every graph (plugin flavor) and a VLM's vision graphs, then build one engine for each."""
    from importlib import metadata

    import onnx
    from tqdm import tqdm

    trt = _tensorrt()
    if not graphs.verifier.embed_tokens.weight.is_cuda:
        raise GlanceError("TensorRT engines bind the running model's CUDA caches: load the target on a GPU "
                          "(glance-rt build-engine --device cuda)")
    opset = manifest.setdefault("opset", 20)
    exported = export_onnx(graphs, out, budgets, chain, chunk, "plugin", opset, progress, dynamic_rows=True)
    vision = export_vision(target, out, image_sizes, opset, progress) if image_sizes else {}
    jobs = {**exported, **vision}
    bar = tqdm(jobs.items(), desc="tensorrt engines", unit="engine", disable=not progress)
    for key, info in bar:
        bar.set_postfix_str(key)
        engine = out / f"{key}.engine"
        if not engine.exists():
            tagged = out / f"{key}.trt.onnx"  # shares {key}.onnx.data: external data stays where it was written
            model = tensorrt_onnx(onnx.load(str(out / info["file"]), load_external_data=False))
            atomic_write(tagged, lambda tmp, m=model: tmp.write_bytes(m.SerializeToString()))
            build_engine_file(tagged, engine, bucket_profiles(info))
        info["engine"] = engine.name
        if profiles := bucket_profiles(info):
            info["profiles"] = profiles
    manifest.update(flavor=flavor, graphs=exported, vision=vision,
                    versions={**manifest["versions"], "tensorrt": trt.__version__,
                              "triton": metadata.version("triton")},
                    builder={"tf32": False, "strongly_typed": True, "plugin": f"{TENSORRT_PLUGIN} (AOT, Triton)"})


class EngineFiles:
    """An engine folder's engines, each deserialized once (a verify engine serves one EngineGraph per
    optimization profile), and the TensorRT runtime that made them, alive as long as they are; and the
    one activation scratch all their execution contexts share (`share_scratch`)."""

    def __init__(self, path: Path):
        self.trt = _tensorrt()
        self.path, self.runtime, self.loaded = path, self.trt.Runtime(_logger(self.trt)), {}
        self.contexts, self.scratch = [], None

    def __call__(self, info: dict):
        name = info["engine"]
        if name not in self.loaded:
            engine = self.runtime.deserialize_cuda_engine((self.path / name).read_bytes())
            if engine is None:
                raise GlanceError(f"TensorRT could not load {self.path / name}: rebuild it with this TensorRT version")
            self.loaded[name] = engine
        return self.loaded[name]

    def context(self, info: dict):
        """A new execution context of graph `info`'s engine without activation memory of its own: it gets
        the shared scratch in `share_scratch`, which must run before any context does."""
        if self.scratch is not None:
            raise GlanceError("a TensorRT context was asked for after its engine folder's shared scratch was "
                              "allocated: create every context first, then call share_scratch")
        context = self(info).create_execution_context(self.trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        self.contexts.append(context)
        return context

    def share_scratch(self, device) -> None:
        """One activation buffer for every context made so far, as large as the largest of their engines
        needs (`device_memory_size_v2`: the most over its profiles). Safe because the contexts run one
        after another on one stream (a Decoder's passes); its address is fixed from here on, so the
        CUDA graphs captured later stay valid."""
        size = max((e.device_memory_size_v2 for e in self.loaded.values()), default=0)
        self.scratch = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        for context in self.contexts:
            context.set_device_memory(self.scratch.data_ptr(), size)


class EngineGraph:
    """One engine's execution context with its tensors bound once. `bufs`: the caches it reads (bound
    in place); after a call, `write_back(inputs, outputs)` writes the rows it returned into them. `dims`:
    the bucket it runs an engine with a profile per bucket at (its profile and input shapes set once).
    The first call runs the context once (warm-up), the second captures the copy-in, run and write-back
    in a CUDA graph, every later call replays it. Outputs are reused by the next call (as any CUDA-graph
    replay). Its activation memory is `engines`' shared scratch."""

    def __init__(self, engines: EngineFiles, info: dict, bufs: list, write_back=None, dims: dict | None = None):
        dev = bufs[0].device if bufs else torch.device("cuda")
        self.engines = engines  # keeps the runtime, the engine and the scratch alive
        self.context = engines.context(info)
        if profiles := bucket_profiles(info):  # its bucket's profile (the build's order)
            profile = served(info).index(dims)
            self.context.set_optimization_profile_async(profile, torch.cuda.current_stream().cuda_stream)
            for name, shape in profiles[profile].items():
                self.context.set_input_shape(name, shape)
        n_args = len(info["inputs"]) - len(bufs)
        self.inputs = [torch.empty(concrete(shape, dims), dtype=DTYPES[dt], device=dev)
                       for _, shape, dt in info["inputs"][:n_args]]
        self.outs = [torch.empty(concrete(shape, dims), dtype=DTYPES[dt], device=dev)
                     for _, shape, dt in info["outputs"]]
        for (name, _, _), t in zip(info["inputs"] + info["outputs"], self.inputs + bufs + self.outs, strict=True):
            self.context.set_tensor_address(name, t.data_ptr() or t.untyped_storage().data_ptr())
        self.write_back, self.n_out = write_back, len(self.outs) - len(bufs)
        self.graph, self.calls = None, 0

    def _run(self) -> None:
        if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise GlanceError("TensorRT failed to run an engine (its log says why)")
        if self.write_back is not None:
            self.write_back(self.inputs, self.outs[self.n_out :])

    def __call__(self, *args):
        for static, a in zip(self.inputs, args, strict=True):
            static.copy_(a)
        if self.graph is not None:
            self.graph.replay()
        elif self.calls == 0:
            self._run()  # warm-up: TensorRT's deferred work and the driver's PTX JIT happen outside a capture
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._run()
            graph.replay()
            self.graph = graph
        self.calls += 1
        res = tuple(self.outs[: self.n_out])
        return res if len(res) > 1 else res[0]


def runners(path: Path, manifest: dict, graphs) -> dict:
    """The callables StaticPasses runs, one execution context per graph (an engine with profiles: one per
    bucket's profile), over the Decoder's own caches, all sharing one activation scratch."""
    if not graphs.verifier.embed_tokens.weight.is_cuda:
        raise GlanceError("a TensorRT engine runs on a CUDA GPU: load the target with device='cuda' (--device cuda)")
    engines = EngineFiles(path)

    def make(info, name, bufs, dims):
        def write(inputs, new):  # the written rows on the device, from the static inputs: capturable
            write_back(bufs, written_rows(graphs, name, inputs), new)

        return EngineGraph(engines, info, bufs, write, dims)

    fns = exported_runners(manifest, graphs, make)
    engines.share_scratch(graphs.verifier.embed_tokens.weight.device)
    return fns


class _VisionSession:
    """An engine behind VisionGraphs' session interface (`run(None, feeds) -> [features]`, numpy)."""

    def __init__(self, path: Path, info: dict):
        engines = EngineFiles(path)
        self.graph, self.names = EngineGraph(engines, info, []), [n for n, _, _ in info["inputs"]]
        engines.share_scratch(torch.device("cuda"))

    def run(self, _outputs, feeds: dict):
        out = self.graph(*(torch.from_numpy(feeds[n]) for n in self.names))
        return [out.float().cpu().numpy()]


def vision(path: Path, manifest: dict, target):
    """The engine's vision graphs (one per image bucket) as a `prefill_inputs` for the Decoder."""
    return VisionGraphs(target, path, manifest, _VisionSession).prefill_inputs
