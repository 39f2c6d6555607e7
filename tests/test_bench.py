"""`glance-rt bench` end to end on tiny models: well-formed JSON / Markdown / PNG outputs, every
output checked against HF greedy, skips with reasons, and a valid partial report on Ctrl-C.
(No test asserts a timing.)"""

import gzip
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import glance_rt
from glance_rt.cli import main
from glance_rt.tools.bench import SCHEMA, BenchConfig, fit_law, markdown, run_bench, write_outputs
from tests.conftest import tiny_target
from tests.tiny_models import make_tiny

ROWS = [{"id": "a", "kind": "chat", "prompt": "Tell me about rivers."},
        {"id": "b", "kind": "extraction", "prompt": "Copy exactly: red green blue."},
        {"id": "c", "kind": "chat", "prompt": "Say something kind."}]
CFG = BenchConfig(methods=("ar", "chain", "tree-4", "tree-12", "tree-12+lookup", "adaptive", "hf", "hf-lookup"),
                  max_new_tokens=12, warmup=1)


def quiet(_):
    pass


@pytest.fixture(scope="module")
def report():
    target, _, _ = tiny_target("qwen3")
    return run_bench(target, glance_rt.init_drafter(target, block_size=4), ROWS, CFG, progress=False, log=quiet)


def test_report_is_well_formed(report, tmp_path):
    assert report["schema"] == SCHEMA and not report["partial"] and report["mismatches"] == []
    assert list(report["overall"]) == ["hf", "ar", "chain", "tree-4", "tree-12", "tree-12+lookup", "hf-lookup",
                                       "adaptive"]
    assert set(report["kinds"]) == {"chat", "extraction"}
    assert len(report["records"]) == len(ROWS) * 8
    assert {b["budget"] for b in report["adaptive_buckets"]} == {4, 12}  # plain trees calibrate it
    assert report["overall"]["adaptive"]["mismatches"] == 0
    tree = report["overall"]["tree-12"]
    assert tree["prompts"] == 3 and tree["speedup_vs_ar"]["n"] == 3 and tree["speedup_vs_hf"]["n"] == 3
    assert tree["tau"] >= 1 and sum(tree["tau_hist"]) > 0
    recs = [r for r in report["records"] if r["method"] == "tree-12"]  # the draft gate may skip some rounds' drafts
    assert tree["draft_passes_per_round"] == sum(r["draft_passes"] for r in recs) / sum(r["rounds"] for r in recs) > 0
    assert report["overall"]["ar"]["draft_passes_per_round"] == 0.0
    assert tree["lookup_rounds_per_round"] == sum(r["lookup_rounds"] for r in recs) / sum(r["rounds"] for r in recs)
    assert set(tree["phase_seconds"]) == {"prefill", "draft", "tree", "verify", "round", "commit"}  # round: on-device
    assert tree["entropy_law"]["n"] == sum(tree["tau_hist"])
    written = write_outputs(report, tmp_path / "b.json", tmp_path / "b.md", tmp_path / "plots")
    assert json.loads((tmp_path / "b.json").read_text())["schema"] == SCHEMA
    md = (tmp_path / "b.md").read_text()
    assert "| tree-12 |" in md and "× same-engine AR" in md
    for name in ("speedup.png", "tau_hist.png", "tau_vs_entropy.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert len(written) == 5
    write_outputs(report, tmp_path / "b.json.gz")  # a .gz name: the same JSON, compressed
    with gzip.open(tmp_path / "b.json.gz", "rt") as f:
        assert json.load(f) == json.loads((tmp_path / "b.json").read_text())


def test_vlm_skips_prompt_lookup_with_a_reason():
    target, _, _ = tiny_target("qwen2_vl")
    cfg = BenchConfig(methods=("ar", "tree-4", "hf", "hf-lookup"), max_new_tokens=8, warmup=0)
    rep = run_bench(target, glance_rt.init_drafter(target, block_size=4), ROWS[:1], cfg, progress=False, log=quiet)
    assert "hf-lookup" in rep["skipped"] and "text models" in rep["skipped"]["hf-lookup"]
    assert rep["mismatches"] == [] and "Skipped" in markdown(rep)


def test_glance_beside_eagle3(tmp_path):
    """eagle3-N methods draft with the EAGLE-3 head given beside the GLANCE drafter; the report sets each
    tree-N against eagle3-N (accepted length ratio, passes per round), and every output is still HF's."""
    from glance_rt.models.eagle3 import init_eagle3

    target, _, _ = tiny_target("qwen3")
    layers = target.text_config.num_hidden_layers
    eagle3 = init_eagle3(target, depth=3, top_k=2, target_layer_ids=(0, layers // 2, layers - 1))
    cfg = BenchConfig(methods=("hf", "ar", "tree-6", "eagle3-6", "eagle3-4"), max_new_tokens=10, warmup=0)
    rep = run_bench(target, glance_rt.init_drafter(target, block_size=4), ROWS[:2], cfg, progress=False, log=quiet,
                    eagle3=eagle3)
    assert rep["mismatches"] == [] and set(rep["overall"]) == {"hf", "ar", "tree-6", "eagle3-6", "eagle3-4"}
    pair = rep["glance_vs_eagle3"]["tree-6 vs eagle3-6"]
    assert set(pair) == {"overall", "chat", "extraction"}
    e = pair["overall"]
    assert e["tau_ratio"] == pytest.approx(e["glance_tau"] / e["eagle3_tau"])
    assert e["eagle3_passes"] > e["glance_passes"]  # a pass per depth against one
    assert e["glance_draft_ms"] > 0 and e["eagle3_draft_ms"] > 0 and e["glance_tok_s"] > 0 and e["eagle3_tok_s"] > 0
    ov = rep["overall"]
    assert e["glance_tok_s"] == ov["tree-6"]["tok_s"]["median"]
    assert e["eagle3_tok_s"] == ov["eagle3-6"]["tok_s"]["median"]
    by = {(r["prompt"], r["method"]): r["tok_s"] for r in rep["records"]}
    ratios = sorted(by[(p, "tree-6")] / by[(p, "eagle3-6")] for p, m in by if m == "tree-6")
    assert e["speed_ratio"] == pytest.approx(float(np.median(ratios)))
    assert "tree-4 vs eagle3-4" not in rep["glance_vs_eagle3"]  # no tree-4 in this run
    assert "GLANCE against EAGLE-3 at equal budget (tree-6 vs eagle3-6)" in markdown(rep)
    written = write_outputs(rep, plot_dir=tmp_path)
    assert (tmp_path / "glance_vs_eagle3.png") in written
    assert (tmp_path / "glance_vs_eagle3.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = run_bench(target, None, ROWS[:1], BenchConfig(methods=("hf", "ar", "eagle3-4"), max_new_tokens=4, warmup=0),
                    progress=False, log=quiet)
    assert "--eagle3" in rep["skipped"]["eagle3-4"]


def test_each_eagle3_method_is_set_against_glance_at_the_same_budget_gate_and_backend():
    from glance_rt.tools.bench import glance_partner

    methods = {"tree-8", "tree-8+always", "tree-8+lookup@aoti:g", "tree-8@aoti:g", "tree-16@aoti:g",
               "tree-8@onnxruntime:o"}
    assert glance_partner("eagle3-8", methods) == "tree-8"
    assert glance_partner("eagle3-8+always", methods) == "tree-8+always"
    assert glance_partner("eagle3-8@compile", methods) is None  # no tree-8@compile in the run
    assert glance_partner("eagle3-8@aoti:e", methods) == "tree-8@aoti:g"  # the GLANCE engine, its own folder
    assert glance_partner("eagle3-16@aoti:e", methods) == "tree-16@aoti:g"
    assert glance_partner("eagle3-8+always@aoti:e", methods) is None  # no GLANCE engine drafting every round
    assert glance_partner("eagle3-8@onnxruntime:x", methods) == "tree-8@onnxruntime:o"


def test_no_drafter_skips_drafted_methods():
    target, _, _ = tiny_target("llama")
    rep = run_bench(target, None, ROWS[:1], BenchConfig(methods=("ar", "chain", "hf"), max_new_tokens=6, warmup=0),
                    progress=False, log=quiet)
    assert "chain" in rep["skipped"] and list(rep["overall"]) == ["hf", "ar"]


def test_mismatch_is_loud_and_ctrl_c_leaves_a_partial_report(monkeypatch):
    target, _, _ = tiny_target("llama")
    real = glance_rt.Decoder.generate
    calls = {"n": 0}

    def flaky(self, max_new_tokens=128, **inputs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        res = real(self, max_new_tokens=max_new_tokens, **inputs)
        res.token_ids[1] = (res.token_ids[1] + 1) % 50
        return res

    monkeypatch.setattr(glance_rt.Decoder, "generate", flaky)
    logs = []
    rep = run_bench(target, None, ROWS, BenchConfig(methods=("ar", "hf"), max_new_tokens=6, warmup=0),
                    progress=False, log=logs.append)
    assert rep["partial"] and len(rep["records"]) >= 2
    assert rep["mismatches"] and any("MISMATCH" in m for m in logs)
    assert "Partial report" in markdown(rep) and "MISMATCH" in markdown(rep)


def test_entropy_law_fit():
    law = fit_law([0.0, 1.0, 2.0, 3.0], [5, 4, 3, 2])
    assert law["slope"] == pytest.approx(-1.0) and law["intercept"] == pytest.approx(5.0) and law["r2"] == 1.0
    assert fit_law([1.0, 1.0, 1.0], [1, 2, 3])["slope"] is None
    assert fit_law([1.0, 2.0, 3.0], [1, 1, 1])["r2"] is None  # constant accepted length: no law to fit


def test_cli_bench(tmp_path):
    model, processor = make_tiny("llama")
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    suite = tmp_path / "s.jsonl"
    suite.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    r = CliRunner().invoke(main, ["bench", "--target", str(tmp_path / "m"), "--suite", str(suite), "--methods",
                                  "ar,hf,hf-lookup", "--max-new-tokens", "6", "--json", str(tmp_path / "r.json"),
                                  "--report", str(tmp_path / "r.md"), "--plots", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    assert "| ar |" in r.stdout and json.loads((tmp_path / "r.json").read_text())["target"]


@pytest.mark.full
def test_compiled_and_engine_methods_are_compared_with_their_eager_method(tmp_path):
    from glance_rt.engines.engine import build_engine
    from glance_rt.tools.bench import suite_max_length

    torch._dynamo.reset()  # compiled graphs of earlier tests' decoders count toward dynamo's recompile limit

    target, _, _ = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    from glance_rt.export.onnx import export_model

    cfg = BenchConfig(methods=("ar", "tree-4", "tree-4+lookup", "tree-4+lookup-4", "tree-4@compile", "tree-4@plain",
                               "adaptive@compile", "hf"), max_new_tokens=10, warmup=1, engine_lookup=True)
    encoded = [target.encode_chat(r["prompt"]) for r in ROWS]
    assert suite_max_length(encoded, cfg) % 64 == 0
    build_engine(target, drafter, tmp_path / "e", budgets=(0, 4), max_len=suite_max_length(encoded, cfg), chunk=16,
                 progress=False)  # 0: the one-row verify graph of the draft gate's steps
    export_model(target, None, tmp_path / "ar", max_len=suite_max_length(encoded, cfg), chunk=16, progress=False)
    cfg = BenchConfig(**{**cfg.__dict__, "engines": (str(tmp_path / "e"), str(tmp_path / "ar"))})
    rep = run_bench(target, drafter, ROWS, cfg, progress=False, log=quiet)  # the AR engine runs without the drafter
    assert rep["mismatches"] == [] and not rep["skipped"]
    # the engine has no 7-row bucket: its lookup rounds verify the tree's 4 rows (tree-4+lookup-4)
    assert set(rep["overall"]) == {"hf", "ar", "ar@onnx:ar", "tree-4", "tree-4+lookup", "tree-4+lookup-4",
                                   "tree-4@compile", "tree-4@plain", "tree-4@aoti:e", "tree-4+lookup-4@aoti:e",
                                   "adaptive@compile"}
    assert rep["overall"]["tree-4+lookup-4@aoti:e"]["speedup_vs_eager"]["n"] == len(ROWS)  # vs tree-4+lookup-4
    assert rep["overall"]["tree-4@compile"]["ar_method"] == "ar"  # the run has no ar@compile
    assert rep["overall"]["ar@onnx:ar"]["ar_method"] == "ar@onnx:ar"
    assert rep["overall"]["adaptive@compile"]["ar_method"] == "ar" and "Same-engine AR is" not in markdown(rep)
    for m in ("tree-4@compile", "tree-4@plain", "tree-4@aoti:e", "ar@onnx:ar"):
        assert rep["overall"][m]["speedup_vs_eager"]["n"] == len(ROWS)
    assert rep["overall"]["tree-4"]["speedup_vs_eager"] is None
    assert "× its eager method" in markdown(rep)


def test_bf16_outputs_are_checked_against_the_same_engines_ar_in_their_numerics():
    """In bf16 HF's kernels round otherwise, so outputs are checked against the same engine's autoregression:
    `ar` for the fast methods, `ar+exact` for the `+exact` ones (issue 39), each required."""
    model, processor = make_tiny("qwen2_5_vl")
    target = glance_rt.load_target(model, processor=processor, dtype="bfloat16")
    drafter = glance_rt.init_drafter(target, block_size=4)
    methods = ("hf", "ar", "ar+exact", "tree-6+always+exact", "tree-6+always")
    with pytest.raises(glance_rt.GlanceError, match="add ar\\+exact to --methods"):
        run_bench(target, drafter, ROWS[:1], BenchConfig(methods=("hf", "ar", "tree-6+exact"), max_new_tokens=6,
                                                          warmup=0), progress=False, log=quiet)
    rep = run_bench(target, drafter, ROWS[:2], BenchConfig(methods=methods, max_new_tokens=16, warmup=0),
                    progress=False, log=quiet)
    assert rep["reference"] == ("the same engine's autoregression (same seed) / the same engine's autoregression in "
                                "exact numerics (same seed)")
    ok = {(r["method"], r["matches_hf"]) for r in rep["records"]}
    assert {("ar+exact", True), ("tree-6+always+exact", True), ("hf", None)} <= ok
    assert not any(m["method"].endswith("+exact") for m in rep["mismatches"])
