"""AOTInductor engines (`glance-rt build-engine --backend aoti`, `Decoder.from_engine`): tokens ==
HF greedy from the built packages; the manifest refuses other weights, versions and budgets; an
interrupted build resumes; the CLI builds and runs one."""

import json
import os

import pytest
import torch
from click.testing import CliRunner

import glance_rt
from glance_rt.cli import main
from glance_rt.engines.engine import build_engine
from tests.conftest import extended, hf_greedy, tiny_target, vocab_drafter
from tests.test_cli import model_folder
from tests.tiny_models import VLM_ARCHS, make_inputs

pytestmark = pytest.mark.full  # builds engines / exports graphs: the full tier (docs/testing.md)

NEW = 20


def drafter_for(target, seed=1):
    """A drafter with a draft vocabulary: the draft package's head is the lm_head rows of its ids."""
    return vocab_drafter(target, 40, seed=seed, num_layers=1, block_size=4)


@pytest.fixture(scope="module")
def llama_engine(tmp_path_factory):
    target, _, _ = tiny_target("llama")
    out = tmp_path_factory.mktemp("engines") / "llama"
    build_engine(target, drafter_for(target), out, budgets=(6, 12), max_len=192, chunk=8, progress=False,
                 flavor="frozen")  # left unset, the flavor is timed (tests/test_kernels.py)
    return out


@pytest.mark.parametrize("budget", [6, 12])
def test_aoti_engine_is_lossless(llama_engine, budget):
    target, model, tok = tiny_target("llama")
    inputs = make_inputs("llama", tok)
    dec = glance_rt.Decoder.from_engine(llama_engine, target, drafter_for(target), tree_budget=budget)
    assert dec.backend.name == "aoti"
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)
    other = make_inputs("llama", tok, prompt="A longer prompt, longer than the engine's chunk of eight rows.")
    prefill, calls = dec.passes.fns["prefill"], []
    dec.passes.fns["prefill"] = lambda *a: calls.append(a[0].shape[1]) or prefill(*a)
    assert dec.generate(max_new_tokens=NEW, **other).token_ids == hf_greedy(model, other, NEW)
    assert calls == [other["input_ids"].shape[1]]  # the dynamic-length prefill package: one exact pass


def test_aoti_engine_one_token_prompt(llama_engine):
    """The dynamic prefill package takes 2+ rows: a one-token prompt is padded to two, losslessly."""
    target, model, _ = tiny_target("llama")
    inputs = {"input_ids": torch.tensor([[7]]), "attention_mask": torch.ones(1, 1, dtype=torch.long)}
    dec = glance_rt.Decoder.from_engine(llama_engine, target, drafter_for(target), tree_budget=6)
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)


@pytest.mark.parametrize("arch, flavor", [("qwen2_5_vl", "frozen"), ("qwen3", "shared"),
                                                 extended("qwen2_5_vl", "shared")])
def test_aoti_engine_vlm_and_autoregression(arch, flavor, tmp_path):
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    ref = hf_greedy(model, inputs, NEW)
    drafter = drafter_for(target) if arch in VLM_ARCHS else None  # M-RoPE tree engine / AR engine
    build_engine(target, drafter, tmp_path / "e", budgets=(8,), max_len=256, chunk=16, progress=False, flavor=flavor)
    dec = glance_rt.Decoder.from_engine(tmp_path / "e", target, drafter)
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == ref


def test_aoti_engine_runs_lookup_rounds_in_their_bucket(tmp_path, monkeypatch):
    """An engine built with the lookup rounds' bucket (max_depth(4) = 7 rows beside the tree's 6) runs
    them there: a long true match (an oracle for the n-gram lookup) commits 8 tokens a round without
    a draft pass, and the tokens stay HF greedy's."""
    import glance_rt.round.loop as dm

    target, model, tok = tiny_target("llama")
    inputs = make_inputs("llama", tok)
    ref, p = hf_greedy(model, inputs, NEW), inputs["input_ids"].shape[1]
    build_engine(target, drafter_for(target), tmp_path / "e", budgets=(6,), max_len=160, chunk=8, progress=False,
                 flavor="shared", lookup_budget=7)
    monkeypatch.setattr(dm, "lookup_match", lambda history, n, length: (n, ref[len(history) - p:][:length]))
    dec = glance_rt.Decoder.from_engine(tmp_path / "e", target, drafter_for(target))  # tree 6, not the 7-row bucket
    assert dec.lookup_budget == 7 and dec.budgets == [6, 7] and dec.method_name == "tree-6+lookup+always@aoti"
    res = dec.generate(max_new_tokens=NEW, **inputs)
    assert res.token_ids == ref
    s = res.stats  # 1 + 8 + 8 tokens, then a chain shorter than the tree: a drafted round
    assert s.accepted_lengths[:2] == [8, 8] and s.lookup_rounds == 2 and s.draft_passes == s.rounds - 2 == 1


def test_lookup_bucket_is_built_only_where_a_decoder_would_use_it():
    from glance_rt.export.manifest import lookup_buckets

    target, _, _ = tiny_target("llama")
    drafter = drafter_for(target)  # block 4: lookup rounds verify 1 to 7 rows
    assert lookup_buckets(drafter, False, (0, 4), 7) == (0, 4, 7)
    assert lookup_buckets(drafter, False, (0, 4, 8), 7) == (0, 4, 7, 8)
    assert lookup_buckets(drafter, False, (0, 8), 7) == (0, 8)  # the tree's 8 rows hold it
    assert lookup_buckets(drafter, False, (0, 4), 0) == (0, 4)
    for bad in (8, -1):
        with pytest.raises(glance_rt.GlanceError, match="1 to max_depth = 7"):
            lookup_buckets(drafter, False, (4,), bad)
    for d, chain in ((None, False), (drafter, True)):
        with pytest.raises(glance_rt.GlanceError, match="drop --lookup-budget"):
            lookup_buckets(d, chain, (4,), 7)


def test_aoti_engine_with_graphs_of_both_flavors_is_lossless(tmp_path):
    """Left unset, the flavor is measured per graph: where the timings differ (here, an injected timer
    in which oneDNN wins at the draft block's rows alone) the draft package is frozen and the others
    shared, and the engine runs them together, losslessly."""
    from glance_rt.models.kernels import KernelTuner
    from tests.test_kernels import FakeTimer

    target, model, processor = tiny_target("llama")
    drafter = drafter_for(target)
    inputs = make_inputs("llama", processor)
    tuner = KernelTuner(FakeTimer(lambda o, i, r: r == drafter.block_size), cache=tmp_path / "k.json")
    build_engine(target, drafter, tmp_path / "e", budgets=(6,), max_len=160, chunk=8, progress=False, tuner=tuner)
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert m["flavor"] == "mixed" and m["kernels"]["chosen_by"] == "measurement"
    assert {g: info["flavor"] for g, info in m["graphs"].items()} == {
        "prefill": "shared", "verify-7": "shared", "draft": "frozen", "context": "shared"}
    dec = glance_rt.Decoder.from_engine(tmp_path / "e", target, drafter)
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)


def test_frozen_packages_hold_folded_weights_and_share_the_caches(llama_engine):
    """The frozen flavor: every package carries folded weights of its own (names no
    module has), and takes the caches from the running model, so the packages see each other's
    writes (the lossless tests above would fail otherwise)."""
    m = json.loads((llama_engine / "manifest.json").read_text())
    assert m["flavor"] == "frozen" and m["prefill"] == "exact" and m["kernels"]["chosen_by"] == "user"
    for info in m["graphs"].values():
        fqns = torch._inductor.aoti_load_package(str(llama_engine / info["file"])).get_constant_fqns()
        assert any(k.startswith("_frozen_param") for k in fqns)
        assert any(".cache." in k for k in fqns)


def test_engine_refuses_what_it_was_not_built_for(llama_engine, tmp_path):
    target, _, _ = tiny_target("llama")
    with pytest.raises(glance_rt.GlanceError, match="drafter weights differ"):
        glance_rt.Decoder.from_engine(llama_engine, target, drafter_for(target, seed=2))
    with pytest.raises(glance_rt.GlanceError, match="tree budgets"):
        glance_rt.Decoder.from_engine(llama_engine, target, drafter_for(target), tree_budget=32)
    with pytest.raises(glance_rt.GlanceError, match="no one-row verify graph"):  # built without --tree-budget 0
        glance_rt.Decoder.from_engine(llama_engine, target, drafter_for(target), gate=True)
    with pytest.raises(glance_rt.GlanceError, match="lookup rounds of 7 rows"):  # no 7-row verify graph
        glance_rt.Decoder.from_engine(llama_engine, target, drafter_for(target), tree_budget=6, lookup_budget=7)
    dec = glance_rt.Decoder.from_engine(llama_engine, target, drafter_for(target), tree_budget=6)
    assert dec.lookup_budget == 6 and dec.budgets == [6]  # lookup rounds at the tree's shape
    ungated = glance_rt.Decoder.from_engine(llama_engine, target, drafter_for(target))
    assert ungated.gate is None and ungated.method_name == "tree-12+lookup+always@aoti"
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in llama_engine.iterdir():
        os.symlink(f, copy / f.name) if f.name != "manifest.json" else None
    m = json.loads((llama_engine / "manifest.json").read_text())
    m["versions"]["torch"] = "1.0.0"
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(glance_rt.GlanceError, match="torch .* engine built with 1.0.0"):
        glance_rt.Decoder.from_engine(copy, target, drafter_for(target))
    for bad, field in (([1], "must be a JSON object"), ({**m, "budgets": ["6"]}, "budgets must be a list of integers"),
                       ({**m, "max_len": "160"}, "max_len must be an integer"), ({**m, "graphs": []}, "graphs")):
        (copy / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(glance_rt.GlanceError, match=field):
            glance_rt.Decoder.from_engine(copy, target, drafter_for(target))
    (copy / "manifest.json").unlink()
    with pytest.raises(glance_rt.GlanceError, match="no finished engine"):
        glance_rt.Decoder.from_engine(copy, target, drafter_for(target))
    with pytest.raises(glance_rt.GlanceError, match="does not exist"):
        glance_rt.Decoder.from_engine(tmp_path / "nope", target, drafter_for(target))
    with pytest.raises(glance_rt.GlanceError, match="already holds an engine"):
        build_engine(target, drafter_for(target), llama_engine, budgets=(6,), progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(glance_rt.GlanceError, match="not empty"):
        build_engine(target, drafter_for(target), tmp_path / "busy", budgets=(6,), progress=False)


def test_interrupted_build_resumes(tmp_path):
    target, model, tok = tiny_target("llama")
    out = tmp_path / "e"
    build_engine(target, None, out, max_len=128, chunk=8, progress=False)
    (out / "manifest.json").unlink()  # as if killed before the last graph and the manifest
    (out / "verify-1.pt2").unlink()
    kept = (out / "prefill.pt2").stat().st_mtime_ns
    with pytest.raises(glance_rt.GlanceError, match="unfinished build of another engine"):
        build_engine(target, None, out, max_len=256, chunk=8, progress=False)
    build_engine(target, None, out, max_len=128, chunk=8, progress=False)
    assert (out / "prefill.pt2").stat().st_mtime_ns == kept and (out / "verify-1.pt2").exists()
    inputs = make_inputs("llama", tok)
    assert glance_rt.Decoder.from_engine(out, target).generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(
        model, inputs, NEW)


def assert_cli_generates_hf_text(target, engine) -> None:
    """`generate --engine` prints HF greedy's text (and its draft passes with --stats)."""
    inputs = target.encode_chat("Hello there.")
    want = target.decode(hf_greedy(target.hf_model, inputs, 12))
    result = CliRunner().invoke(main, ["generate", "--engine", str(engine), "--prompt", "Hello there.",
                                       "--max-new-tokens", "12", "--stats"])
    assert result.exit_code == 0, result.output
    assert want.strip() in result.stdout and "draft passes" in result.stderr


def test_cli_build_engine_then_generate(tmp_path_factory, tmp_path):
    path = model_folder("qwen3", str(tmp_path_factory.mktemp("models")))
    target = glance_rt.load_target(path)
    drafter_for(target).save(tmp_path / "drafter")
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["build-engine", "--target", path, "--drafter", str(tmp_path / "drafter"),
                                       "--tree-budget", "0", "--tree-budget", "4",
                                       "--max-length", "128", "--chunk", "16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    m = json.loads((out / "manifest.json").read_text())
    # 0: the draft gate's steps; 7 = max_depth(4): the lookup rounds' rows, which the CLI adds by default
    assert m["budgets"] == [0, 4, 7] and m["tree_budgets"] == [0, 4] and m["lookup_budget"] == 7
    assert_cli_generates_hf_text(target, out)
    result = CliRunner().invoke(main, ["generate", "--engine", str(out), "--prompt", "Hello there.",
                                       "--max-new-tokens", "12", "--compare"])
    assert result.exit_code == 0, result.output  # against eager autoregression
    assert "autoregressive (eager" in result.stdout and "tokens identical: yes" in result.stdout
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps({"prompt": p, "kind": "chat"}) + "\n" for p in ["Hi.", "Copy: a b."]))
    for budget in ([], ["--tree-budget", "7"]):  # audit runs the engine as generate does
        result = CliRunner().invoke(main, ["audit", "--engine", str(out), "--suite", str(suite), "--max-new-tokens",
                                           "12", *budget, "--json", str(tmp_path / "a.json")])
        assert result.exit_code == 0, result.output
        report = json.loads((tmp_path / "a.json").read_text())
        assert report["exact"] == report["total"] == 2 and report["backend"] == "aoti"
        # unset, the tree budget is the largest the engine was built for, not its lookup rounds' 7 rows
        tree = 7 if budget else 4
        assert report["tree_budget"] == tree and report["method"] == f"tree-{tree}+lookup@aoti"
    # sampled: against the same engine without its drafter, whose graphs it then leaves unloaded
    result = CliRunner().invoke(main, ["audit", "--engine", str(out), "--suite", str(suite), "--max-new-tokens", "12",
                                       "--temperature", "1.5", "--seed", "3", "--json", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["exact"] == report["total"] == 2
    assert report["reference"] == "the same engine's autoregressive sampling (same seed)"
