"""TensorRT engines. What runs here (no TensorRT, no GPU): the ONNX rewrite TensorRT's parser reads, on
every architecture's plugin-flavor export; the plugin module's declarations against the rules
`tensorrt.plugin` enforces (read from its source, not imported); the errors a user without TensorRT
or without a GPU gets. The build and the lossless run need both: marked `tensorrt` and `gpu`, skipped."""

import ast
import json
from pathlib import Path

import onnx
import pytest
import torch

import glance_rt
from glance_rt.engines.tensorrt import PLUGIN_NAMESPACE, PLUGIN_OP, tensorrt_onnx
from glance_rt.plugins import TENSORRT_PLUGIN
from glance_rt.round.tree import max_depth
from tests.conftest import extended, hf_greedy, tiny_target
from tests.test_export import drafter_for
from tests.tiny_models import ARCHS, VLM_ARCHS, make_inputs

PLUGIN_SOURCE = Path(glance_rt.__file__).resolve().parent.parent / "plugins" / "tensorrt_plugin.py"
TENSORS = ["q", "k", "v", "tree_mask", "prefix_len"]  # glance.TreeAttention's inputs, in order


def plugin_functions() -> dict:
    """name of the tensorrt.plugin decorator ("register", "autotune", "aot_impl") -> its FunctionDef."""
    tree = ast.parse(PLUGIN_SOURCE.read_text())
    found = {}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.value.id == "trtp":
                found[dec.func.attr] = fn
    return found


def test_plugin_declarations_follow_tensorrt_plugin_rules():
    """tensorrt.plugin validates: register = tensors then attributes, all annotated, no defaults, a
    return annotation; aot_impl = the same tensors and EVERY attribute in order (TensorRT passes them
    all positionally), then outputs, tactic, and a return annotation; autotune = tensors (+ attrs) +
    outputs, one io type per input and output."""
    fns = plugin_functions()
    assert set(fns) == {"register", "autotune", "aot_impl"}  # no JIT `impl`: the engine must not need Python
    reg, aot, tune = (fns[k] for k in ("register", "aot_impl", "autotune"))
    reg_args = [a.arg for a in reg.args.args]
    assert reg_args[: len(TENSORS)] == TENSORS
    attrs = reg_args[len(TENSORS) :]
    assert attrs == ["scale"]
    assert all(a.annotation is not None for a in reg.args.args) and not reg.args.defaults and reg.returns
    assert [a.arg for a in aot.args.args] == TENSORS + attrs + ["outputs", "tactic"]
    assert aot.returns is not None and not aot.args.defaults
    assert [a.arg for a in tune.args.args] == TENSORS + ["outputs"]
    combos = [n for n in ast.walk(tune) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") ==
              "AutoTuneCombination"]
    (combo,) = combos
    types = ast.unparse(combo.args[0])
    assert types.count(",") == len(TENSORS)  # 5 inputs + 1 output
    assert "BOOL" in types and "INT64" in types
    assert any(isinstance(d, ast.Call) and ast.unparse(d.args[0]) == "NAME" for d in reg.decorator_list)


def test_rewrite_refuses_a_node_without_its_attribute():
    """The parser skips a missing plugin attribute and shifts the rest: refuse such a node up front."""
    from onnx import TensorProto, helper

    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in TENSORS]
    node = helper.make_node(PLUGIN_OP, TENSORS, ["out"], domain=PLUGIN_NAMESPACE)
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])])
    with pytest.raises(glance_rt.GlanceError, match="no scale attribute"):
        tensorrt_onnx(helper.make_model(graph))


def attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


# llama in CI's tier (the ONNX export of every architecture is in tests/test_export.py); the rewrite of the
# other eight, VLMs included, runs in the extended tier (5 min)
CI_ARCHS = ("llama",)


@pytest.mark.full
@pytest.mark.parametrize("arch", [a if a in CI_ARCHS else extended(a) for a in ARCHS])
def test_tensorrt_rewrite_on_every_architecture(arch, tmp_path):
    """Every glance.TreeAttention node of every graph comes out tagged for TensorRT's parser: looked up
    as (op_type, plugin_version, plugin_namespace) = the registered plugin, its AOT implementation
    picked (aot=1), carrying the attribute the plugin declares (scale, a float); nothing else in the
    graph changes, no local function is left to inline, and the exported file is left as it was. The
    verify graph is the one a TensorRT build exports: one graph for the tree buckets (a symbolic row
    dimension), whose optimization profiles pin each bucket's shapes."""
    from glance_rt.engines.tensorrt import bucket_profiles
    from glance_rt.export.onnx import ROWS, export_onnx
    from glance_rt.round.verify import static_graphs

    target, _, _ = tiny_target(arch)
    drafter = drafter_for(target, arch)
    info = export_onnx(static_graphs(target, drafter, 96), tmp_path, (4, 5), False, 8, "plugin", progress=False,
                       dynamic_rows=True)
    assert set(info) == {"prefill", "verify", "draft", "context"} and info["verify"]["rows"] == [5, 6]
    mrope = info["verify"]["inputs"][1][1][0] == 3
    assert bucket_profiles(info["verify"]) == [{"tokens": [t], "positions": [3, 1, t] if mrope else [1, t],
                                                "tree_mask": [t, t], "parent": [t]} for t in (5, 6)]
    assert bucket_profiles(info["prefill"]) == []
    logits, feats, greedy, path = (o[1] for o in info["verify"]["outputs"][:4])
    assert logits == [ROWS, target.vocab_size] and feats[0] == ROWS and greedy == [ROWS]
    assert path == [max_depth(4) + 1]  # R long at any T
    layers = target.text_config.num_hidden_layers
    for key, g in info.items():
        path = tmp_path / g["file"]
        before = path.read_bytes()
        model = onnx.load(str(path), load_external_data=False)
        tagged = tensorrt_onnx(model)
        nodes = [n for n in tagged.graph.node if n.op_type == PLUGIN_OP]
        assert path.read_bytes() == before
        assert (model.SerializeToString() != tagged.SerializeToString()) == bool(nodes)
        assert len(nodes) == {"prefill": layers, "verify": layers, "draft": 2, "context": 0}[key] == \
            g["tree_attention_nodes"]
        for n in nodes:
            a = attrs(n)
            assert f"{a['plugin_namespace'].decode()}::{n.op_type}" == TENSORRT_PLUGIN
            assert a["plugin_version"] == b"1" and a["aot"] == 1
            assert isinstance(a["scale"], float) and a["scale"] > 0
            assert list(n.input)[:5] and len(n.input) == len(TENSORS)
        assert not [f for f in tagged.functions if f.name == PLUGIN_OP]
        untagged = [(n.op_type, n.domain, list(n.input), list(n.output)) for n in model.graph.node]
        assert untagged == [(n.op_type, n.domain, list(n.input), list(n.output)) for n in tagged.graph.node]
        onnx.save(tagged, str(tmp_path / f"{key}.trt.onnx"))  # beside its external data, as the build writes it
        onnx.checker.check_model(str(tmp_path / f"{key}.trt.onnx"))
    assert PLUGIN_NAMESPACE == "glance"


def node_input_shapes(model, node) -> list:
    """The shapes (ints, or a symbolic dimension's name) of `node`'s inputs, by ONNX shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model)
    values = {v.name: v for v in (*inferred.graph.input, *inferred.graph.value_info)}
    return [[d.dim_value if d.HasField("dim_value") else d.dim_param for d in values[i].type.tensor_type.shape.dim]
            for i in node.input]


@pytest.mark.full
@pytest.mark.parametrize("arch", ["llama", extended("qwen2_5_vl")])
def test_batched_graphs_a_tensorrt_build_exports(arch, tmp_path):
    """`build-engine --backend tensorrt --max-batch 3` exports what the ONNX Runtime engine does (one
    batched verify graph symbolic in slots and rows, a batched AR step and draft graph symbolic in
    slots) and builds an engine of each with an optimization profile per bucket: here their profiles,
    slots-major in the order a load binds its contexts (`served`), every input pinned to its bucket's
    shape; and their TreeAttention nodes as the plugin gets them, tagged, with q [S, H, T, D], k and v the
    S slots' cache rows as one packed [S, KVH, L, D] tensor (so a sequence's stride is KVH * L rows,
    what the plugin passes as KV_BATCH), masks [S, T, T] and prefix lengths [S]."""
    from glance_rt.engines.tensorrt import bucket_profiles
    from glance_rt.export.onnx import served

    target, _, _ = tiny_target(arch)
    drafter = drafter_for(target, arch)
    info = export_onnx_for(target, drafter, tmp_path, slots=3)
    assert {k: (g.get("slots"), g.get("rows")) for k, g in info.items() if "_batch" in k} == {
        "verify_batch": ([2, 3], [5, 6]), "verify_batch-1": ([2, 3], [1]), "draft_batch": ([2, 3], None)}
    lead = [3, 1] if info["verify"]["inputs"][1][1][0] == 3 else [1]  # positions [3, 1, S, T] under M-RoPE
    profiles = bucket_profiles(info["verify_batch"])
    assert served(info["verify_batch"]) == [{"slots": s, "rows": t} for s in (2, 3) for t in (5, 6)]
    assert profiles == [{"tokens": [s, t], "positions": [*lead, s, t], "starts": [s], "tree_masks": [s, t, t],
                         "parents": [s, t]} for s in (2, 3) for t in (5, 6)]
    assert [p["tokens"] for p in bucket_profiles(info["verify_batch-1"])] == [[2, 1], [3, 1]]
    assert len(bucket_profiles(info["draft_batch"])) == 2
    cfg = target.text_config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    for key in ("verify_batch", "verify_batch-1"):
        model = onnx.load(str(tmp_path / info[key]["file"]), load_external_data=False)
        tagged = tensorrt_onnx(model)
        nodes = [n for n in tagged.graph.node if n.op_type == PLUGIN_OP]
        assert len(nodes) == cfg.num_hidden_layers and all(attrs(n)["aot"] == 1 for n in nodes)
        q, k, v, mask, prefix = node_input_shapes(model, next(n for n in model.graph.node if n.op_type == PLUGIN_OP))
        s, t = "slots", "rows" if key == "verify_batch" else 1
        assert q == [s, cfg.num_attention_heads, t, head_dim] and k == v == [s, kv_heads, 96, head_dim], key
        assert mask == [s, t, t] and prefix == [s]


class FakeContext:
    """What EngineGraph and EngineFiles call on a TensorRT execution context, recorded."""

    def __init__(self, engine, strategy):
        self.engine, self.strategy, self.profile, self.shapes, self.memory = engine, strategy, None, {}, []

    def set_optimization_profile_async(self, index, stream):
        self.profile = index

    def set_input_shape(self, name, shape):
        self.shapes[name] = list(shape)

    def set_tensor_address(self, name, ptr):
        pass

    def set_device_memory(self, ptr, size):
        self.memory.append((ptr, size))


class FakeTensorRT:
    """The slice of the `tensorrt` module engines/tensorrt.py's runtime uses (no GPU, no TensorRT)."""

    class ExecutionContextAllocationStrategy:
        USER_MANAGED = "user-managed"

    class Logger:
        WARNING = 0

        def __init__(self, level):
            pass

    def __init__(self, sizes: dict):
        self.sizes = sizes  # engine file name -> device_memory_size_v2

    def Runtime(self, logger):  # noqa: N802  (TensorRT's name)
        fake = self

        class Runtime:
            def deserialize_cuda_engine(self, data):
                name = data.decode()
                return type("Engine", (), {"device_memory_size_v2": fake.sizes[name], "name": name,
                                           "create_execution_context": lambda e, s: FakeContext(e, s)})()

        return Runtime()


def test_engine_contexts_take_their_buckets_profile_and_share_one_scratch(tmp_path, monkeypatch):
    """The load side of a batched TensorRT engine, against a fake `tensorrt`: every (slots, rows) bucket's
    context selects the profile the build made for that bucket (the build's `bucket_profiles` order) and
    pins its inputs to the bucket's shapes; a fixed-shape graph selects none; every context is made
    without memory of its own and gets ONE scratch, as large as the largest engine needs, once all exist;
    a context asked for after that is refused."""
    import glance_rt.engines.tensorrt as trt_engines
    from glance_rt.export.onnx import served

    fake = FakeTensorRT({"verify_batch.engine": 3000, "prefill.engine": 5000})
    monkeypatch.setattr(trt_engines, "_tensorrt", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 0})())
    for name in fake.sizes:
        (tmp_path / name).write_bytes(name.encode())
    batched = {"engine": "verify_batch.engine", "slots": [2, 3], "rows": [5, 7],
               "inputs": [["tokens", ["slots", "rows"], "int64"], ["starts", ["slots"], "int64"],
                          ["k0", [3, 2, 16, 4], "float32"]],
               "outputs": [["logits", ["slots", "rows", 11], "float32"]]}
    fixed = {"engine": "prefill.engine", "inputs": [["tokens", [8], "int64"], ["k0", [3, 2, 16, 4], "float32"]],
             "outputs": [["logits", [1, 11], "float32"]]}
    cache = torch.zeros(3, 2, 16, 4)
    files = trt_engines.EngineFiles(tmp_path)
    graphs = {tuple(d.values()): trt_engines.EngineGraph(files, batched, [cache], dims=d) for d in served(batched)}
    prefill = trt_engines.EngineGraph(files, fixed, [cache], dims={})
    files.share_scratch(torch.device("cpu"))
    profiles = trt_engines.bucket_profiles(batched)
    assert list(graphs) == [(2, 5), (2, 7), (3, 5), (3, 7)] and len(profiles) == 4
    for i, ((s, t), g) in enumerate(graphs.items()):
        assert g.context.profile == i and g.context.shapes == profiles[i] == {"tokens": [s, t], "starts": [s]}
        assert [list(x.shape) for x in g.inputs + g.outs] == [[s, t], [s], [s, t, 11]]
    assert prefill.context.profile is None and prefill.context.shapes == {}
    contexts = [g.context for g in graphs.values()] + [prefill.context]
    assert {c.strategy for c in contexts} == {"user-managed"}
    assert {tuple(c.memory) for c in contexts} == {((files.scratch.data_ptr(), 5000),)}
    with pytest.raises(glance_rt.GlanceError, match="create every context first"):
        trt_engines.EngineGraph(files, fixed, [cache], dims={})


def export_onnx_for(target, drafter, out, slots: int = 1) -> dict:
    """What a TensorRT build exports (plugin flavor, dynamic rows) for tree budgets 0 (the gate's AR
    steps), 4 and 5, 96 cache rows."""
    from glance_rt.export.onnx import export_onnx
    from glance_rt.round.verify import static_graphs

    return export_onnx(static_graphs(target, drafter, 96, slots=slots), out, (0, 4, 5), False, 8, "plugin",
                       progress=False, dynamic_rows=True)


def test_build_engine_without_tensorrt_says_how(tmp_path):
    pytest.importorskip("onnx")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    from glance_rt.engines.engine import build_engine

    target, _, _ = tiny_target("llama")
    with pytest.raises(glance_rt.GlanceError, match=r"glance-rt\[tensorrt\]"):
        build_engine(target, None, tmp_path / "e", backend="tensorrt", max_len=64, chunk=8, progress=False)
    with pytest.raises(glance_rt.GlanceError, match="takes plugin"):
        build_engine(target, None, tmp_path / "e", backend="tensorrt", flavor="portable", max_len=64, chunk=8)
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)  # a batched build passes its checks too
    with pytest.raises(glance_rt.GlanceError, match=r"glance-rt\[tensorrt\]"):
        build_engine(target, drafter, tmp_path / "e", backend="tensorrt", max_len=64, chunk=8, max_batch=3)
    assert not (tmp_path / "e" / "manifest.json").exists()


@pytest.mark.gpu
@pytest.mark.tensorrt
@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_tensorrt_engine_is_lossless(arch, tmp_path):
    """fp32 on a GPU: the engine's tokens equal Hugging Face greedy's at each tree budget, its graphs
    replay, and the tree buckets share ONE verify engine (a profile each)."""
    from glance_rt.engines.engine import build_engine

    target, model, processor = tiny_target(arch)
    target = glance_rt.load_target(model.to("cuda"), dtype="float32", device="cuda")
    drafter = drafter_for(target, arch).to("cuda")
    build_engine(target, drafter, tmp_path / "e", backend="tensorrt", budgets=(0, 4, 6), max_len=128, chunk=8,
                 progress=False)
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert all((tmp_path / "e" / g["engine"]).is_file() for g in m["graphs"].values())
    assert m["graphs"]["verify"]["rows"] == [5, 7] and len(m["graphs"]["verify"]["profiles"]) == 2
    for budget in (4, 6):
        dec = glance_rt.Decoder.from_engine(tmp_path / "e", target, drafter, tree_budget=budget)
        for prompt in ("Hi", "Count the objects, then name their colours."):
            inputs = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in
                      make_inputs(arch, processor, prompt=prompt, n_images=1 if arch in VLM_ARCHS else 0).items()}
            assert dec.generate(max_new_tokens=16, **inputs).token_ids == hf_greedy(model, inputs, 16)


@pytest.mark.gpu
@pytest.mark.tensorrt
@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_tensorrt_engine_built_for_batches_is_lossless(arch, tmp_path):
    """fp32 on a GPU, `--max-batch 3`: the batched graphs are one engine each with a profile per bucket,
    and a Batch over the engine gives every sequence HF greedy's tokens (three requests finishing at
    different rounds, so the batch runs at 3 slots, then 2, then alone)."""
    from glance_rt.engines.engine import build_engine
    from glance_rt.round.batch import Batch
    from tests.test_batch import NEW, requests

    target, model, processor = tiny_target(arch)
    target = glance_rt.load_target(model.to("cuda"), dtype="float32", device="cuda")
    drafter = drafter_for(target, arch).to("cuda")
    build_engine(target, drafter, tmp_path / "e", backend="tensorrt", budgets=(0, 4, 6), max_len=128, chunk=8,
                 progress=False, max_batch=3)
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert len(m["graphs"]["verify_batch"]["profiles"]) == 4  # slots (2, 3) x rows (5, 7)
    dec = glance_rt.Decoder.from_engine(tmp_path / "e", target, drafter, gate=False)
    cuda = [{k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in r.items()}
            for r in requests(arch, processor)]
    want = [hf_greedy(model, r, n) for r, n in zip(cuda, NEW, strict=True)]
    reqs = [dict(r, max_new_tokens=n) for r, n in zip(cuda, NEW, strict=True)]
    assert [res.token_ids for res in Batch(dec).run(reqs)] == want
