"""Prompt suites for bench and audit: built-in held-out suites per task kind, or a user's JSONL."""

from pathlib import Path

from glance_rt.errors import GlanceError


def cap_per_kind(rows: list[dict], per_kind: int | None) -> list[dict]:
    """The first `per_kind` rows of each kind, in order (all rows when per_kind is None)."""
    if per_kind is None:
        return rows
    seen: dict[str, int] = {}
    kept = []
    for r in rows:
        if seen.get(r["kind"], 0) < per_kind:
            seen[r["kind"]] = seen.get(r["kind"], 0) + 1
            kept.append(r)
    return kept


def suite_rows(suite: str | None, per_kind: int | None = None) -> list[dict]:
    """`suite`: None or "all" (held-out prompts of every kind in the shipped corpus), a kind name
    (held-out prompts of that kind), or a JSONL file. At most `per_kind` prompts of each kind."""
    from glance_rt.corpus import KINDS, default_corpus_path, read_prompts

    if suite in (None, "all") or suite in KINDS:
        rows = [r for r in read_prompts(default_corpus_path()) if r.get("split") == "heldout"]
        if suite in KINDS:
            rows = [r for r in rows if r.get("kind") == suite]
    elif Path(suite).is_file():
        rows = read_prompts(suite)
    else:
        raise GlanceError(f"unknown suite {suite!r}: use 'all', one of {', '.join(KINDS)}, or a JSONL file")
    for i, r in enumerate(rows):
        r.setdefault("id", f"p{i:05d}")
        r.setdefault("kind", "default")
    rows = cap_per_kind(rows, per_kind)
    if not rows:
        raise GlanceError(f"suite {suite!r} has no prompts")
    return rows
