"""The prompt corpus: counts, split hygiene, determinism, JSONL validation, shipped file, image prompts."""

import json
from collections import Counter

import pytest

from glance_rt.errors import GlanceError
from glance_rt.tools.suites import KINDS, default_corpus_path, read_prompts
from tests.conftest import corpus_builder

corpus = corpus_builder()

PER_KIND = 500


@pytest.fixture(scope="module")
def rows():
    """The full default corpus, built once for this module."""
    return corpus.build_corpus(seed=0, per_kind=PER_KIND)


def _units(source: str) -> list[str]:
    """The documents a source names (group sources join several with '+')."""
    prefix, _, rest = source.partition(":")
    return [f"{prefix}:{part}" for part in rest.split("+")] if source else []


def test_counts_per_kind_and_split(rows):
    counts = Counter((r["kind"], r["split"]) for r in rows)
    held = corpus.heldout_count(PER_KIND)
    assert KINDS == ("extraction", "conversion", "grounded_qa", "code", "chat")
    assert len(rows) == PER_KIND * len(KINDS) >= 2000
    for kind in KINDS:
        assert counts[(kind, "train")] == PER_KIND - held >= 400
        assert counts[(kind, "heldout")] == held >= 0.1 * PER_KIND


def test_rows_are_well_formed(rows):
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({r["prompt"] for r in rows}) == len(rows)
    for r in rows:
        assert list(r) == ["id", "kind", "split", "prompt", "source"]
        assert r["id"].startswith(r["kind"] + "-")
        assert 0 < len(r["prompt"]) <= corpus.MAX_PROMPT_CHARS
        assert corpus.approx_tokens(r["prompt"]) <= corpus.MAX_PROMPT_TOKENS
        assert corpus.is_clean(r["prompt"])
        assert (r["source"] == "") == (r["kind"] == "chat") or r["kind"] == "code"
    grounded = [len(r["prompt"]) for r in rows if r["kind"] in ("extraction", "conversion", "grounded_qa")]
    assert sum(300 <= n <= 900 for n in grounded) > 0.5 * len(grounded)


def test_heldout_sources_never_used_for_training(rows):
    train = {u for r in rows if r["split"] == "train" for u in _units(r["source"])}
    held = {u for r in rows if r["split"] == "heldout" for u in _units(r["source"])}
    assert held and not train & held


def test_build_is_deterministic(rows):
    assert corpus.build_corpus(seed=0, per_kind=PER_KIND) == rows
    other = corpus.build_corpus(seed=1, per_kind=40)
    assert [r["prompt"] for r in other] != [r["prompt"] for r in rows[:200]]


def test_write_then_read_round_trip(rows, tmp_path):
    path = corpus.write_corpus(tmp_path / "sub" / "prompts.jsonl", rows[:50])
    assert read_prompts(path) == rows[:50]
    assert [p.name for p in path.parent.iterdir()] == ["prompts.jsonl"]  # no temp file left behind
    gz = corpus.write_corpus(tmp_path / "sub" / "prompts.jsonl.gz", rows[:50])  # compressed, no timestamp
    again = corpus.write_corpus(tmp_path / "x.gz", rows[:50])
    assert read_prompts(gz) == rows[:50] and gz.read_bytes() == again.read_bytes()
    gz.write_bytes(gz.read_bytes()[:-9])  # truncated
    with pytest.raises(GlanceError, match="cannot read prompts file"):
        read_prompts(gz)


def test_larger_corpus_keeps_the_shipped_prompts_and_splits():
    """data/prompts/corpus-3000.jsonl.gz holds every shipped prompt with its split (so its train split
    never holds a shipped held-out prompt)."""
    big = read_prompts(default_corpus_path().parents[2] / "data" / "prompts" / "corpus-3000.jsonl.gz")
    split = {r["prompt"]: r["split"] for r in big}
    shipped = read_prompts(default_corpus_path())
    assert len(big) == 15000 and all(split.get(r["prompt"]) == r["split"] for r in shipped)


def _write(tmp_path, text: str):
    path = tmp_path / "p.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


def test_read_prompts_empty_file(tmp_path):
    with pytest.raises(GlanceError, match="line 1.*empty"):
        read_prompts(_write(tmp_path, "\n  \n"))


def test_read_prompts_bad_json_names_line(tmp_path):
    text = '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"\n'
    with pytest.raises(GlanceError, match="line 3.*malformed JSON"):
        read_prompts(_write(tmp_path, text))


@pytest.mark.parametrize("row", [{"kind": "chat"}, {"prompt": ""}, {"prompt": "   "}, {"prompt": 3}])
def test_read_prompts_missing_prompt(tmp_path, row):
    text = '{"prompt": "ok"}\n' + json.dumps(row) + "\n"
    with pytest.raises(GlanceError, match='line 2.*"prompt"'):
        read_prompts(_write(tmp_path, text))


@pytest.mark.parametrize("row, field", [
    ({"prompt": "x", "images": "a.png"}, "images"),
    ({"prompt": "x", "split": "test"}, "split"),
    ({"prompt": "x", "kind": 1}, "kind"),
    (["prompt"], "JSON object"),
])
def test_read_prompts_bad_fields(tmp_path, row, field):
    with pytest.raises(GlanceError, match=f"line 1.*{field}"):
        read_prompts(_write(tmp_path, json.dumps(row) + "\n"))


def test_read_prompts_defaults_and_extras(tmp_path):
    text = '{"prompt": "Describe.", "images": ["a.png"], "kind": "extraction", "extra": 1}\n\n{"prompt": "Hi"}\n'
    got = read_prompts(_write(tmp_path, text))
    assert got == [
        {"prompt": "Describe.", "images": ["a.png"], "kind": "extraction", "extra": 1, "id": "line-1"},
        {"prompt": "Hi", "id": "line-3"},
    ]


def test_read_prompts_missing_file(tmp_path):
    with pytest.raises(GlanceError, match="no such prompts file"):
        read_prompts(tmp_path / "absent.jsonl")


def test_shipped_corpus_loads():
    path = default_corpus_path()
    shipped = read_prompts(path)
    assert len(shipped) >= 2000
    counts = Counter((r["kind"], r["split"]) for r in shipped)
    for kind in KINDS:
        assert counts[(kind, "train")] >= 400
        assert counts[(kind, "heldout")] >= 0.1 * (counts[(kind, "train")] + counts[(kind, "heldout")])
    train = {u for r in shipped if r["split"] == "train" for u in _units(r["source"])}
    held = {u for r in shipped if r["split"] == "heldout" for u in _units(r["source"])}
    assert not train & held


def test_image_prompts():
    items = corpus.make_image_prompts(56, seed=0)
    assert len(items) == 56
    kinds = Counter(row["kind"] for row, _ in items)
    assert set(kinds) == {"extraction", "conversion", "grounded_qa"}
    assert sum(row["split"] == "heldout" for row, _ in items) >= 0.1 * len(items)
    for row, image in items:
        assert image.size == corpus.IMAGE_SIZE and image.mode == "RGB"
        assert "images" not in row and row["prompt"] and row["id"].startswith("image-")
        assert image.getextrema() != ((255, 255),) * 3  # something was drawn
    again = corpus.make_image_prompts(8, seed=0)
    assert [r for r, _ in again] == [r for r, _ in items[:8]]
    assert all(a.tobytes() == b.tobytes() for (_, a), (_, b) in zip(again, items[:8], strict=True))


def test_text_helpers():
    assert corpus.sentences("It works, e.g. here. Second one! Third?") == ["It works, e.g. here.", "Second one!",
                                                                            "Third?"]
    assert corpus.clean_text("a\tb  \r\n\n\n\nc\x00") == "a   b\n\nc"
    assert corpus.is_license("Permission is hereby granted, free of charge")
    assert not corpus.is_clean("bad \ufffd byte")
    text = "pkg (1.0-1) unstable; urgency=low\n\n  * Fix a thing\n    more.\n\n -- A B <a@b.c>  Mon, 01 Jan 2024 10:00"
    (entry,) = corpus.changelog_entries(text)
    assert entry["version"] == "1.0-1" and entry["changes"] == ["Fix a thing more."] and entry["email"] == "a@b.c"
