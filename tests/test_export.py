"""`glance-rt export` (ONNX): every graph passes onnx.checker; tree attention is one
`glance.TreeAttention` node per attention in both flavors; per-graph parity with the torch static
graphs through ONNX Runtime; end-to-end tokens == HF greedy through ONNX Runtime on every
architecture; `build-engine --backend onnxruntime`; the CLI."""

import json

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

import glance_rt
from glance_rt.cli import main
from glance_rt.export.onnx import export_model, written_rows
from glance_rt.round.verify import example_inputs, static_graphs, static_shapes
from tests.conftest import extended, hf_greedy, tiny_target, vocab_drafter
from tests.test_cli import model_folder
from tests.tiny_models import ARCHS, VLM_ARCHS, make_inputs

pytestmark = pytest.mark.full  # builds engines / exports graphs: the full tier (docs/testing.md)

NEW = 16


def drafter_for(target, arch="llama"):
    """Every other architecture gets a draft vocabulary (the draft graph's head is its rows)."""
    if ARCHS.index(arch) % 2:
        return vocab_drafter(target, 30, seed=1, num_layers=2, block_size=4)
    return glance_rt.init_drafter(target, num_layers=2, block_size=4, seed=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_onnxruntime_runs_the_export_losslessly(arch, tmp_path):
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    drafter = drafter_for(target, arch)
    export_model(target, drafter, tmp_path / "x", budgets=(6,), max_len=128, chunk=8, progress=False)
    dec = glance_rt.Decoder.from_engine(tmp_path / "x", target, drafter)
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_graph_matches_its_torch_graph(arch, tmp_path):
    import onnxruntime as ort

    target, _, _ = tiny_target(arch)
    drafter = drafter_for(target, arch)
    export_model(target, drafter, tmp_path / "x", budgets=(5,), max_len=96, chunk=8, progress=False)
    m = json.loads((tmp_path / "x" / "manifest.json").read_text())
    graphs = static_graphs(target, drafter, 96)  # the plain weights, as exported
    gen = torch.Generator().manual_seed(0)
    for cache in (graphs.verifier.cache, graphs.draft_pass.cache):  # random cache contents, both sides
        for b in cache.buffers():
            b.copy_(torch.randn(b.shape, generator=gen))
    for key, args in example_inputs(graphs, static_shapes(graphs, 8), (5,), False).items():
        name = key.split("-")[0]
        args = tuple(a.clone() for a in args)
        if name in ("prefill", "context"):
            args = (torch.randn(args[0].shape, generator=gen), *args[1:])
        args = (*args[:-2], torch.tensor(9), args[-1]) if name == "draft" else args
        if name != "draft":
            args = (args[0], args[1], torch.tensor(20), *args[3:]) if name != "context" else (args[0], torch.tensor(20))
        model = onnx.load(str(tmp_path / "x" / m["graphs"][key]["file"]))
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        cache = graphs.draft_pass.cache if name in ("draft", "context") else graphs.verifier.cache
        bufs = list(cache.buffers())
        names = [i.name for i in sess.get_inputs()]
        outs = sess.run(None, {n: a.numpy() for n, a in zip(names, [*args, *bufs], strict=True)})
        with torch.no_grad():
            want = getattr(graphs, name)(*args)
        want = want if isinstance(want, tuple) else (want,)
        rows = written_rows(graphs, name, args)
        for got, ref in zip(outs, [*want, *(b.index_select(2, rows) for b in bufs)], strict=True):
            np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-3, err_msg=f"{arch} {key}")


def test_plugin_flavor_keeps_one_named_node_per_attention(tmp_path):
    target, _, _ = tiny_target("qwen3")
    drafter = drafter_for(target, "qwen3")
    export_model(target, drafter, tmp_path / "p", flavor="plugin", budgets=(4,), max_len=64, chunk=8, progress=False)
    m = json.loads((tmp_path / "p" / "manifest.json").read_text())
    layers = target.text_config.num_hidden_layers
    counts = {k: g["tree_attention_nodes"] for k, g in m["graphs"].items()}
    assert counts == {"prefill": layers, "verify-5": layers, "draft": 2, "context": 0}
    model = onnx.load(str(tmp_path / "p" / "verify-5.onnx"))
    assert not model.functions  # the runtime must bring the kernel
    nodes = [n for n in model.graph.node if n.domain == "glance"]
    assert {n.op_type for n in nodes} == {"TreeAttention"} and all(n.attribute[0].name == "scale" for n in nodes)
    onnx.checker.check_model(model)
    with pytest.raises(glance_rt.GlanceError, match="plugin"):
        glance_rt.Decoder.from_engine(tmp_path / "p", target, drafter)
    with pytest.raises(glance_rt.GlanceError, match="already holds an export"):
        export_model(target, drafter, tmp_path / "p", progress=False)


def test_build_engine_onnxruntime_and_cli_export(tmp_path_factory, tmp_path):
    path = model_folder("llama", str(tmp_path_factory.mktemp("models")))
    target = glance_rt.load_target(path)
    drafter_for(target).save(tmp_path / "drafter")
    result = CliRunner().invoke(main, ["build-engine", "--backend", "onnxruntime", "--target", path, "--drafter",
                                       str(tmp_path / "drafter"), "--tree-budget", "6", "--max-length", "128",
                                       "--chunk", "16", "--out", str(tmp_path / "ort")])
    assert result.exit_code == 0, result.output
    m = json.loads((tmp_path / "ort" / "manifest.json").read_text())
    assert m["backend"] == "onnxruntime" and all(g["file"].endswith(".opt.onnx") for g in m["graphs"].values())
    assert m["budgets"] == [6, 7] and m["lookup_budget"] == 7  # the lookup rounds' max_depth(4) rows, by default
    inputs = target.encode_chat("Hello there.")
    want = target.decode(hf_greedy(target.hf_model, inputs, 12))
    result = CliRunner().invoke(main, ["generate", "--engine", str(tmp_path / "ort"), "--prompt", "Hello there.",
                                       "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert want.strip() in result.stdout
    result = CliRunner().invoke(main, ["export", "--target", path, "--no-drafter", "--max-length", "64",
                                       "--chunk", "16", "--out", str(tmp_path / "x")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "x" / "GRAPHS.md").read_text().count("## ") == 2  # prefill, verify


def test_an_export_holds_one_copy_of_the_weights(tmp_path):
    """Five graphs (prefill, verify at two budgets: `--graph-per-bucket`, draft, context) share one data
    file holding each weight once; sharing again changes nothing; ONNX Runtime runs the graphs losslessly."""
    from glance_rt.export.weights import WEIGHTS, share_weights

    target, model, processor = tiny_target("qwen2")
    drafter = glance_rt.init_drafter(target, num_layers=2, block_size=4, seed=1)
    out = tmp_path / "x"
    export_model(target, drafter, out, budgets=(4, 8), max_len=96, chunk=8, progress=False, dynamic_rows=False)
    assert [p.name for p in out.glob("*.data")] == [WEIGHTS]
    params = {id(p): p.numel() * p.element_size() for m in (model, drafter) for p in m.parameters()}
    size = (out / WEIGHTS).stat().st_size
    head = target.parts.lm_head.weight
    # each weight once (five graphs used to hold five copies), and the head's table twice: as the
    # embedding's gather reads it and as the exporter folds its transpose for the logits' MatMul
    assert size < 1.05 * (sum(params.values()) + head.numel() * head.element_size())
    files = [g["file"] for g in json.loads((out / "manifest.json").read_text())["graphs"].values()]
    assert len(files) == 5
    again = share_weights(out, files)
    assert again["bytes"] == size and again["references"] > again["tensors"] > 0
    inputs = make_inputs("qwen2", processor)
    dec = glance_rt.Decoder.from_engine(out, target, drafter)
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)


def test_an_onnxruntime_engine_with_mapped_weights_reads_one_memory_map(tmp_path):
    """`build-engine --mapped-weights`: every session takes its initializers from one read-only memory map
    of the engine's data file (a tensor several graphs read: one value), prepacking off; tokens == HF
    greedy; recorded in the manifest; other backends refuse the flag."""
    from glance_rt.engines.engine import build_engine
    from glance_rt.export.weights import WEIGHTS, mapped_initializers

    target, model, processor = tiny_target("qwen2")
    drafter = glance_rt.init_drafter(target, num_layers=2, block_size=4, seed=1)
    out = build_engine(target, drafter, tmp_path / "ort", backend="onnxruntime", budgets=(4,), max_len=96, chunk=8,
                       progress=False, mapped_weights=True)
    m = json.loads((out / "manifest.json").read_text())
    assert m["weights"] == "mapped" and m["session_options"]["session.disable_prepacking"] == "1"
    values = {}
    named = {g: mapped_initializers(out, info["file"], values) for g, info in m["graphs"].items()}
    assert all(named.values()) and isinstance(values[WEIGHTS], np.memmap)
    shared = [v for g in named if g.startswith(("prefill", "verify")) for _, v in named[g]]
    assert len({id(v) for v in shared}) < len(shared)  # the target's weights: one value for both graphs
    inputs = make_inputs("qwen2", processor)
    dec = glance_rt.Decoder.from_engine(out, target, drafter)
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)
    bound = [f for f in dec.passes.fns.values() if hasattr(f, "weights")]  # the sessions the load made
    assert bound and all(f.weights is bound[0].weights and WEIGHTS in f.weights for f in bound)
    with pytest.raises(glance_rt.GlanceError, match="--mapped-weights is for onnxruntime"):
        build_engine(target, drafter, tmp_path / "aoti", backend="aoti", budgets=(4,), max_len=96, chunk=8,
                     progress=False, mapped_weights=True)


@pytest.mark.parametrize("arch", ["llama", extended("qwen2_5_vl")])
def test_one_verify_graph_with_dynamic_rows_serves_every_tree_bucket(arch, tmp_path):
    """`--dynamic-rows`: the tree buckets' verify graphs are ONE graph whose row dimension is symbolic
    (the one-row AR step keeps its own); run at each bucket's rows it gives the torch verify pass's outputs
    (its path is R long: the static graph's, then -1s); an ONNX Runtime engine of it opens one session for
    every bucket and its tokens == HF greedy at each tree budget; aoti refuses the flag."""
    import onnxruntime as ort

    from glance_rt.engines.engine import build_engine
    from glance_rt.export.onnx import ROWS

    target, model, processor = tiny_target(arch)
    drafter = drafter_for(target, arch)
    out = export_model(target, drafter, tmp_path / "x", budgets=(0, 4, 8), max_len=96, chunk=8, progress=False,
                       dynamic_rows=True)
    m = json.loads((out / "manifest.json").read_text())
    assert sorted(m["graphs"]) == ["context", "draft", "prefill", "verify", "verify-1"] and m["dynamic_rows"]
    info = m["graphs"]["verify"]
    assert info["rows"] == [5, 9] and info["inputs"][0][1] == [ROWS] and info["inputs"][3][1] == [ROWS, ROWS]
    graphs = static_graphs(target, drafter, 96)
    gen = torch.Generator().manual_seed(0)
    bufs = list(graphs.verifier.cache.buffers())
    for b in bufs:
        b.copy_(torch.randn(b.shape, generator=gen))
    sess = ort.InferenceSession(str(out / info["file"]), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    examples = example_inputs(graphs, static_shapes(graphs, 8), (4, 8), False)
    for t in info["rows"]:
        tokens, positions, _, _, _ = examples[f"verify-{t}"]
        tokens = torch.randint(0, target.vocab_size, (t,), generator=gen)
        parent = torch.tensor([-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, t)])
        mask = torch.eye(t, dtype=torch.bool)
        for i in range(1, t):  # each row sees its ancestors
            mask[i] |= mask[int(parent[i])]
        tokens[1:] = torch.where(torch.rand(t - 1, generator=gen) < 0.5, tokens[1:], tokens[parent[1:]])
        args = (tokens, positions + 20, torch.tensor(20), mask, parent)
        got = sess.run(None, {n: a.numpy() for n, a in zip(names, [*args, *bufs], strict=True)})
        with torch.no_grad():
            want = graphs.verify(*args)
        np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-4, atol=1e-3, err_msg=f"{arch} T={t}")
        assert (got[2] == want[2].numpy()).all()
        r = graphs.ctx_rows
        assert got[3].shape == (r,) and list(got[3]) == [*want[3].tolist(), *[-1] * (r - len(want[3]))]
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    engine = build_engine(target, drafter, tmp_path / "ort", backend="onnxruntime", budgets=(0, 4, 8), max_len=96,
                          chunk=8, progress=False, dynamic_rows=True)
    for budget in (4, 8):
        dec = glance_rt.Decoder.from_engine(engine, target, drafter, tree_budget=budget, gate=False)
        assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW), budget
    verify = dec.passes.fns["verify"]
    assert sorted(verify.buckets) == [1, 5, 9]
    assert verify.buckets[5].sess is verify.buckets[9].sess is not verify.buckets[1].sess  # 5 and 9: one session
    with pytest.raises(glance_rt.GlanceError, match="--dynamic-rows is for onnxruntime"):
        build_engine(target, drafter, tmp_path / "aoti", backend="aoti", budgets=(4,), max_len=96, chunk=8,
                     progress=False, dynamic_rows=True)
