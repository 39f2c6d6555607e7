"""`glance-rt audit`: exact vs greedy, or the first divergence with the target's margin there."""

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import glance_rt
from glance_rt.cli import main
from glance_rt.method import DEFAULT_LOOKUP
from glance_rt.tools.audit import AuditRow, audit_prompt, failures, first_divergence
from tests.conftest import hf_greedy, tiny_target
from tests.tiny_models import make_inputs, make_tiny


class Corrupting:
    """A decoder that flips one token: what audit must catch."""

    def __init__(self, decoder, at: int):
        self.decoder, self.at = decoder, at

    def generate(self, max_new_tokens, **inputs):
        res = self.decoder.generate(max_new_tokens=max_new_tokens, **inputs)
        ids = list(res.token_ids)
        ids[self.at] = (ids[self.at] + 1) % 50
        return SimpleNamespace(token_ids=ids)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_vl"])
def test_exact_and_divergent(arch):
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor)
    dec = glance_rt.Decoder(target, glance_rt.init_drafter(target, block_size=4), tree_budget=8)
    row = {"id": "x", "kind": "k"}
    ok = audit_prompt(target, dec, row, inputs, 16)
    assert ok.exact and ok.tokens == ok.reference_tokens == len(hf_greedy(model, inputs, 16))
    bad = audit_prompt(target, Corrupting(dec, 5), row, inputs, 16)
    assert not bad.exact and bad.divergence == 5
    assert bad.expected == hf_greedy(model, inputs, 16)[5] and bad.got != bad.expected
    assert bad.margin > 1e-3  # the tiny models have clear margins: this divergence is a bug
    assert failures([ok, bad], None) == [bad]
    assert failures([ok, bad], threshold=1e9) == []


def test_cli_audit_exit_status_and_report(tmp_path, monkeypatch):
    model, processor = make_tiny("llama")
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps({"prompt": p, "kind": k}) + "\n"
                             for p, k in [("Hi there.", "chat"), ("Copy: a b c.", "extraction")]))
    args = ["audit", "--target", str(tmp_path / "m"), "--suite", str(suite), "--max-new-tokens", "12",
            "--json", str(tmp_path / "a.json")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["schema"] == "glance-rt/audit/1" and report["exact"] == report["total"] == 2

    real = glance_rt.Decoder.generate

    def corrupt(self, max_new_tokens=128, **inputs):
        res = real(self, max_new_tokens=max_new_tokens, **inputs)
        res.token_ids[2] = (res.token_ids[2] + 1) % 50
        return res

    monkeypatch.setattr(glance_rt.Decoder, "generate", corrupt)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "DIVERGES at token 2" in r.output
    assert json.loads((tmp_path / "a.json").read_text())["exact"] == 0
    r = CliRunner().invoke(main, [*args, "--threshold", "1e9"])
    assert r.exit_code == 0  # divergences only at margins below the threshold are tolerated


def test_cli_audit_compiled_backend(tmp_path):
    """audit runs every way of running: here the torch.compile passes (engines: test_engines)."""
    import torch

    torch._dynamo.reset()
    model, processor = make_tiny("llama")
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    target = glance_rt.load_target(tmp_path / "m")
    glance_rt.init_drafter(target, block_size=4).save(tmp_path / "d")
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps({"prompt": p, "kind": "chat"}) + "\n" for p in ["Hi there.", "Copy: a b c."]))
    r = CliRunner().invoke(main, ["audit", "--target", str(tmp_path / "m"), "--drafter", str(tmp_path / "d"),
                                  "--suite", str(suite), "--max-new-tokens", "12", "--backend", "compile",
                                  "--json", str(tmp_path / "a.json")])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["exact"] == report["total"] == 2
    assert (report["method"], report["backend"]) == ("tree-8+lookup@compile", "compile")
    assert report["lookup"] == DEFAULT_LOOKUP


def test_unknown_suite():
    from glance_rt.tools.suites import suite_rows

    with pytest.raises(glance_rt.GlanceError, match="unknown suite"):
        suite_rows("nope")
    assert {r["kind"] for r in suite_rows("all", per_kind=2)} == {"extraction", "conversion", "grounded_qa", "code",
                                                                   "chat"}
    assert all(r["split"] == "heldout" for r in suite_rows("code", per_kind=3))


def test_row_is_json_serialisable():
    from dataclasses import asdict

    row = AuditRow(id="a", kind="b", exact=False, tokens=3, reference_tokens=4, divergence=2, margin=0.5, expected=7,
                   got=9)
    assert AuditRow(**json.loads(json.dumps(asdict(row)))) == row
