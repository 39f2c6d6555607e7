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
from tests.conftest import hf_greedy, tiny_target
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


@pytest.mark.full
@pytest.mark.parametrize("arch", ARCHS)
def test_tensorrt_rewrite_on_every_architecture(arch, tmp_path):
    """Every glance.TreeAttention node of every graph comes out tagged for TensorRT's parser: looked up
    as (op_type, plugin_version, plugin_namespace) = the registered plugin, its AOT implementation
    picked (aot=1), carrying the attribute the plugin declares (scale, a float); nothing else in the
    graph changes, no local function is left to inline, and the exported file is left as it was. The
    verify graph is the one a TensorRT build exports: one graph for the tree buckets (a symbolic row
    dimension), whose optimization profiles pin each bucket's shapes."""
    from glance_rt.engines.tensorrt import row_profiles
    from glance_rt.export.onnx import ROWS, export_onnx
    from glance_rt.round.verify import static_graphs

    target, _, _ = tiny_target(arch)
    drafter = drafter_for(target, arch)
    info = export_onnx(static_graphs(target, drafter, 96), tmp_path, (4, 5), False, 8, "plugin", progress=False,
                       dynamic_rows=True)
    assert set(info) == {"prefill", "verify", "draft", "context"} and info["verify"]["rows"] == [5, 6]
    mrope = info["verify"]["inputs"][1][1][0] == 3
    assert row_profiles(info["verify"]) == [{"tokens": [t], "positions": [3, 1, t] if mrope else [1, t],
                                             "tree_mask": [t, t], "parent": [t]} for t in (5, 6)]
    assert row_profiles(info["prefill"]) == []
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
