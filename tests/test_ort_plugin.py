"""glance-rt's ONNX Runtime kernel for glance.TreeAttention (engines/tree_attention_ort.cc): the
op alone == the torch op on random trees, GQA and static cache tails; a plugin-flavor engine runs
tokens == HF greedy; missing headers or library are reported with how to get them.

The kernel builds against ONNX Runtime's C API header, which no package registry reachable here
serves: without it these tests skip and say so (the README says where to get it)."""

import json

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

import glance_rt
from glance_rt.cli import main
from glance_rt.engines import ort_plugin
from glance_rt.engines.engine import build_engine
from glance_rt.export.onnx import tree_attention_function
from glance_rt.models.attention import tree_attention
from glance_rt.round.batch import Batch
from tests.conftest import hf_greedy, tiny_target
from tests.test_attention import random_tree_mask
from tests.test_cli import model_folder
from tests.tiny_models import make_inputs

pytestmark = pytest.mark.full  # builds engines / exports graphs: the full tier (docs/testing.md)

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    try:
        ort_plugin.find_header()
    except glance_rt.GlanceError as e:
        pytest.skip(str(e))
    return ort_plugin.build_library(tmp_path_factory.mktemp("plugin"))


def one_node_model(scale: float) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    f, b, i = TensorProto.FLOAT, TensorProto.BOOL, TensorProto.INT64
    node = helper.make_node("TreeAttention", ["q", "k", "v", "tree_mask", "prefix_len"], ["out"],
                            domain="glance", scale=scale)
    graph = helper.make_graph([node], "tree_attention", [
        helper.make_tensor_value_info("q", f, None), helper.make_tensor_value_info("k", f, None),
        helper.make_tensor_value_info("v", f, None), helper.make_tensor_value_info("tree_mask", b, None),
        helper.make_tensor_value_info("prefix_len", i, [])], [helper.make_tensor_value_info("out", f, None)])
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("glance", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("heads,kv_heads,t,prefix,tail", [(4, 4, 1, 9, 0), (9, 3, 17, 40, 23), (6, 2, 5, 0, 7),
                                                          (8, 1, 9, 12, 0), (4, 2, 33, 100, 15)])
def test_kernel_matches_the_torch_op(library, heads, kv_heads, t, prefix, tail):
    gen = torch.Generator().manual_seed(heads + t + prefix)
    d, kv_len, scale = 16, prefix + t + tail, 0.25
    q = torch.randn(1, heads, t, d, generator=gen)
    k = torch.randn(1, kv_heads, kv_len, d, generator=gen)
    v = torch.randn(1, kv_heads, kv_len, d, generator=gen)
    k[:, :, prefix + t :] = 1e4  # the static tail must be invisible, whatever it holds
    mask = random_tree_mask(t, gen)
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(one_node_model(scale).SerializeToString(), so, providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "tree_mask": mask.numpy(),
                             "prefix_len": np.array(prefix, dtype=np.int64)})
    want = tree_attention(q, k, v, mask, torch.tensor(prefix), scale)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flavor", ["portable", "plugin"])
@pytest.mark.parametrize("heads,kv_heads,t", [(4, 2, 5), (6, 6, 1), (9, 3, 9)])
def test_the_op_over_a_batch_equals_each_sequence_alone(request, flavor, heads, kv_heads, t):
    """glance.TreeAttention's batched form (q [B, H, T, D], k, v [B, KVH, L, D], tree_mask [B, T, T],
    prefix_len [B]: what batched engines' graphs call), as the portable flavor's ONNX function and as the
    plugin's kernel, == the torch op on each sequence alone (its own tree, prefix and cache tail)."""
    model = one_node_model(0.25)
    so = ort.SessionOptions()
    if flavor == "plugin":
        so.register_custom_ops_library(str(request.getfixturevalue("library")))
    else:
        model.functions.append(tree_attention_function(20))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(heads + t)
    batch, d, kv_len = 3, 16, 40
    q = torch.randn(batch, heads, t, d, generator=gen)
    k, v = (torch.randn(batch, kv_heads, kv_len, d, generator=gen) for _ in range(2))
    prefix = torch.tensor([0, 17, kv_len - t])
    masks = torch.stack([random_tree_mask(t, gen) for _ in range(batch)])
    for b in range(batch):
        k[b, :, prefix[b] + t :] = 1e4  # each sequence's own static tail must be invisible to it
    (got,) = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "tree_mask": masks.numpy(),
                             "prefix_len": prefix.numpy()})
    for b in range(batch):
        want = tree_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], masks[b], prefix[b], 0.25)
        np.testing.assert_allclose(got[b : b + 1], want.numpy(), rtol=1e-5, atol=1e-5)


def test_kernel_reports_bad_input(library):
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(one_node_model(1.0).SerializeToString(), so, providers=["CPUExecutionProvider"])
    q, k = np.zeros((1, 4, 3, 8), np.float32), np.zeros((1, 2, 5, 8), np.float32)
    feed = {"q": q, "k": k, "v": k, "tree_mask": np.ones((3, 3), bool), "prefix_len": np.array(4, np.int64)}
    with pytest.raises(Exception, match="prefix_len \\+ T must fit"):
        sess.run(None, feed)
    feed.update(prefix_len=np.array(2, np.int64), q=np.zeros((1, 3, 3, 8), np.float32))
    with pytest.raises(Exception, match="multiple of KV heads"):
        sess.run(None, feed)
    q, k = np.zeros((2, 4, 3, 8), np.float32), np.zeros((2, 2, 5, 8), np.float32)  # a batch of two sequences
    feed = {"q": q, "k": k, "v": k, "tree_mask": np.ones((3, 3), bool), "prefix_len": np.array([1, 2], np.int64)}
    with pytest.raises(Exception, match="expected tree_mask \\[B, T, T\\]"):
        sess.run(None, feed)
    feed.update(tree_mask=np.ones((2, 3, 3), bool), prefix_len=np.array(1, np.int64))
    with pytest.raises(Exception, match="expected prefix_len \\[B\\]"):
        sess.run(None, feed)


@pytest.mark.parametrize("max_batch", [1, 2])
def test_plugin_engine_is_lossless(library, tmp_path, max_batch):
    """A plugin-flavor engine's tokens == HF greedy, one sequence at a time and (--max-batch 2: the batched
    graphs' nodes through the kernel's batched form) two decoded together."""
    target, model, tok = tiny_target("qwen3")
    drafter = glance_rt.init_drafter(target, num_layers=2, block_size=4, seed=1)
    build_engine(target, drafter, tmp_path / "e", backend="onnxruntime", budgets=(6,), max_len=128, chunk=8,
                 progress=False, flavor="plugin", ort_include=ort_plugin.find_header(), max_batch=max_batch)
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert m["flavor"] == "plugin" and m["plugin_library"]["source_sha256"] == ort_plugin.source_hash()
    graph = onnx.load(str(tmp_path / "e" / m["graphs"]["verify-7"]["file"]), load_external_data=False)
    assert not graph.functions  # ONNX Runtime ran the glance nodes through the library, not a function body
    assert sum(n.domain == "glance" for n in graph.graph.node) == target.text_config.num_hidden_layers
    dec = glance_rt.Decoder.from_engine(tmp_path / "e", target, drafter)
    prompts = [make_inputs("qwen3", tok, prompt=p) for p in
               ("Hello there.", "A longer prompt, so that the prefill takes several chunks of eight rows.")]
    if max_batch > 1:
        batched = onnx.load(str(tmp_path / "e" / m["graphs"]["verify_batch"]["file"]), load_external_data=False)
        assert not batched.functions
        results = Batch(dec).run([dict(inputs, max_new_tokens=16) for inputs in prompts])
        assert [r.token_ids for r in results] == [hf_greedy(model, inputs, 16) for inputs in prompts]
    for inputs in prompts:
        assert dec.generate(max_new_tokens=16, **inputs).token_ids == hf_greedy(model, inputs, 16)


def test_cli_builds_a_plugin_engine(library, tmp_path_factory, tmp_path):
    path = model_folder("llama", str(tmp_path_factory.mktemp("models")))
    result = CliRunner().invoke(main, ["build-engine", "--backend", "onnxruntime", "--flavor", "plugin",
                                       "--ort-include", str(ort_plugin.find_header()), "--target", path,
                                       "--no-drafter", "--max-length", "64", "--chunk", "16", "--out",
                                       str(tmp_path / "e")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "e" / ort_plugin.LIBRARY).is_file()
    target = glance_rt.load_target(path)
    inputs = target.encode_chat("Hello there.")
    dec = glance_rt.Decoder.from_engine(tmp_path / "e", target)
    assert dec.generate(max_new_tokens=8, **inputs).token_ids == hf_greedy(target.hf_model, inputs, 8)


def test_missing_headers_and_library_say_what_to_do(tmp_path):
    with pytest.raises(glance_rt.GlanceError, match="onnxruntime_c_api.h.*--ort-include"):
        ort_plugin.build_library(tmp_path / "lib", include_dir=tmp_path)
    assert not (tmp_path / "lib" / ort_plugin.LIBRARY).exists()
    with pytest.raises(glance_rt.GlanceError, match="not in that folder.*--flavor plugin --ort-include"):
        ort_plugin.library_for(tmp_path)
    target, _, _ = tiny_target("llama")
    with pytest.raises(glance_rt.GlanceError, match="plugin' flavor is for onnxruntime"):
        build_engine(target, None, tmp_path / "a", backend="aoti", flavor="plugin", progress=False)


def test_plugin_engine_in_exact_numerics(library, tmp_path):
    """`--flavor plugin --exact`: the decode graphs attend in exact numerics' own ops (no glance node), the
    prompt's chunks and the draft pass keep the op and run it through the library; every row of a 9-row tree
    has its AR step's logits bit for bit, and GLANCE commits the exact AR engine's tokens, greedy and sampled."""
    from glance_rt.tools.numerics import decoder_row_agreement

    target, model, tok = tiny_target("qwen3")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
    kw = {"backend": "onnxruntime", "max_len": 128, "chunk": 8, "progress": False, "flavor": "plugin",
          "ort_include": ort_plugin.find_header(), "numerics": "exact"}
    build_engine(target, drafter, tmp_path / "g", budgets=(0, 8), **kw)
    build_engine(target, None, tmp_path / "ar", budgets=(0,), **kw)
    m = json.loads((tmp_path / "g" / "manifest.json").read_text())
    assert m["flavor"] == "plugin" and m["numerics"] == "exact"
    glance_nodes = {}
    for key in ("prefill", "verify-9", "draft"):
        graph = onnx.load(str(tmp_path / "g" / m["graphs"][key]["file"]), load_external_data=False)
        glance_nodes[key] = sum(n.domain == "glance" for n in graph.graph.node)
    assert glance_nodes["verify-9"] == 0 and glance_nodes["prefill"] > 0 and glance_nodes["draft"] > 0, glance_nodes
    dec = glance_rt.Decoder.from_engine(tmp_path / "g", target, drafter, gate=False, lookup=0)
    ar = glance_rt.Decoder.from_engine(tmp_path / "ar", target, None)
    assert dec.numerics == ar.numerics == "exact"
    rows = decoder_row_agreement(dec, list(range(5, 40)), [11, 12, 13, 14, 15, 16, 17, 18, 19],
                                 [-1, 0, 0, 1, 1, 2, 3, 5, 6])
    assert all(r.equal for r in rows), rows
    for prompt in ("Hello there.", "A longer prompt, so that the prefill takes several chunks of eight rows."):
        inputs = make_inputs("qwen3", tok, prompt=prompt)
        for sampling in (glance_rt.Sampling(), glance_rt.Sampling(do_sample=True, temperature=1.5, seed=7)):
            assert dec.generate(max_new_tokens=16, sampling=sampling, **inputs).token_ids == \
                ar.generate(max_new_tokens=16, sampling=sampling, **inputs).token_ids, (prompt, sampling)
