"""Magpie prompts (glance_rt/tools/magpie.py): the user-turn prefix is exactly the template before a
user's text; the filters drop unfinished, degenerate and duplicate samples; the split is a stable
hash; a run writes prompts `read_prompts` takes, resumes from its batch files without generating,
and refuses another run's batches."""

import json

import pytest

from glance_rt.errors import GlanceError
from glance_rt.hf.target import Target
from glance_rt.tools import magpie as M
from glance_rt.tools.suites import read_prompts
from tests.conftest import tiny_target


def test_user_prefix_is_the_template_up_to_the_users_text():
    target, _, _ = tiny_target("llama")
    prefix = M.user_prefix(target)
    text = target.processor.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert text.startswith(target.tokenizer.decode(prefix))
    assert text[len(target.tokenizer.decode(prefix)):].startswith("Hello there")


def test_filters_and_split():
    assert M.degenerate("How do I sort a list of tuples by the second item in Python?") is None
    assert M.degenerate("Hi") == "length"
    assert M.degenerate("1234 5678 9012 3456 7890 !!!!") == "not prose"
    assert M.degenerate("Tell me <|im_start|>user about cats") == "markup"
    assert M.degenerate("the cat sat on " * 6) == "repetition"
    seen = set()
    texts = ["Write a haiku about the sea in autumn.", None, "write a haiku about the SEA in autumn!",
             "Write a haiku about the sea in autumn, please make it sad.", "Explain how a heat pump works."]
    rows, dropped = M.keep(texts, seen, seed=0)
    assert [r["prompt"] for r in rows] == [texts[0], texts[4]]
    assert dropped == {"no end of turn": 1, "duplicate": 2}  # same text; same first 8 words
    assert all(r["kind"] == "chat" and r["source"] == "magpie" for r in rows)
    assert M.text_split("Some prompt.") == M.text_split("some   PROMPT") in ("train", "heldout")
    splits = [M.text_split(f"prompt number {i}") for i in range(2000)]
    assert 0.11 < splits.count("heldout") / len(splits) < 0.19


def test_run_writes_resumes_and_refuses_another_runs_batches(tmp_path, monkeypatch):
    target, _, _ = tiny_target("llama")
    # the tiny model's tokens are random: let every 5th token id end the turn, so samples end early
    target = Target(**{**target.__dict__, "eos_token_ids": frozenset(range(0, target.vocab_size, 5))})
    monkeypatch.setattr(M, "MIN_CHARS", 1)
    monkeypatch.setattr(M, "degenerate", lambda text: None if text else "length")
    cfg = M.MagpieConfig(count=6, batch=4, max_tokens=24, seed=3, max_batches=4)
    out = tmp_path / "magpie.jsonl"
    summary = M.make_prompts(target, out, cfg, progress=False)
    rows = read_prompts(out)
    assert 1 <= len(rows) == summary["prompts"] <= 6
    assert all(r["id"].startswith("magpie-3-") and r["split"] in ("train", "heldout") for r in rows)
    assert summary["samples"] == 4 * summary["batches"]
    first = out.read_text()

    def no_generation(*args):
        raise AssertionError("a finished batch was generated again")

    monkeypatch.setattr(M, "sample_batch", no_generation)
    out.unlink()
    M.make_prompts(target, out, cfg, progress=False)  # from the batch files alone
    assert out.read_text() == first
    other = M.MagpieConfig(count=6, batch=4, max_tokens=24, seed=4)
    with pytest.raises(GlanceError, match="another magpie run"):
        M.make_prompts(target, out, other, progress=False)
    assert json.loads((tmp_path / "magpie.jsonl.parts" / "run.json").read_text())["config"]["seed"] == 3


def test_sampling_is_seeded():
    target, _, _ = tiny_target("llama")
    target = Target(**{**target.__dict__, "eos_token_ids": frozenset(range(0, target.vocab_size, 5))})
    prefix = M.user_prefix(target)
    cfg = M.MagpieConfig(count=1, batch=3, max_tokens=16, seed=1)
    assert M.sample_batch(target, prefix, cfg, 0) == M.sample_batch(target, prefix, cfg, 0)
    assert M.sample_batch(target, prefix, cfg, 0) != M.sample_batch(target, prefix, cfg, 1)
