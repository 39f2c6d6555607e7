"""The response store: responses reused across runs, only missing ones generated, parts checked on load."""

import json
from dataclasses import replace

import pytest

from glance_rt import GlanceError
from glance_rt.tools.store import ResponseStore, store_key
from glance_rt.tools.training import data as T
from tests.conftest import tiny_target
from tests.test_train import small_cfg


def responses(out):
    return [json.loads(x) for p in sorted((out / "responses").iterdir()) for x in p.read_text().splitlines()]


def run_responses(target, cfg, name, tmp_path):
    out = tmp_path / name
    out.mkdir()
    T.stage_responses(target, T.training_rows(T.load_rows(cfg), None), [], cfg, out, 0, 1, T.open_store(target, cfg))
    return responses(out)


def test_store_reuses_answers_and_generates_only_what_it_lacks(tmp_path, monkeypatch):
    target, _, _ = tiny_target("llama")
    store = tmp_path / "store"
    cfg = small_cfg(tmp_path, store=str(store))
    first = run_responses(target, replace(cfg, limit=4), "a", tmp_path)  # 4 of the 7 training prompts
    assert len(first) == 4 and len(ResponseStore(store, store_key(target, cfg.response_tokens))) == 4
    plain = run_responses(target, replace(cfg, store=None), "plain", tmp_path)  # no store: all generated

    asked = []
    generate = T._generate_batch
    monkeypatch.setattr(T, "_generate_batch", lambda t, rows, c: asked.extend(rows) or generate(t, rows, c))
    again = run_responses(target, cfg, "b", tmp_path)
    stored = {r["id"] for r in first}
    assert [r["id"] for r in asked] == [r["id"] for r in plain if r["id"] not in stored]  # only the 3 it lacked
    assert again == plain  # the same rows and answers as generating them all
    parts = sorted(p.name for p in store.iterdir())
    assert len(parts) == 2 and all(p.startswith("part-") and p.endswith(".npz") for p in parts)  # no temp files

    asked.clear()
    assert run_responses(target, cfg, "c", tmp_path) == plain and not asked  # everything from the store


def test_corrupt_or_foreign_parts_are_refused(tmp_path):
    target, _, _ = tiny_target("llama")
    store = tmp_path / "store"
    cfg = small_cfg(tmp_path, store=str(store), limit=3)
    run_responses(target, cfg, "a", tmp_path)
    with pytest.raises(GlanceError, match="another target or settings.*response_tokens"):
        ResponseStore(store, store_key(target, cfg.response_tokens + 1))
    (part,) = store.iterdir()
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(GlanceError, match="corrupt"):
        ResponseStore(store, store_key(target, cfg.response_tokens))
