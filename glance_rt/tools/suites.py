"""Prompt suites for train, bench and audit: the shipped corpus (`glance_rt/data/prompts.jsonl`,
built by `scripts/build_corpus.py`) and its reader, held-out suites per task kind, or a user's JSONL."""

import gzip
import hashlib
import json
import os
from pathlib import Path

from glance_rt.errors import GlanceError
from glance_rt.files import open_images

KINDS = ("extraction", "conversion", "grounded_qa", "code", "chat")  # decreasing grounding
SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.15


def split_of(key: str) -> str:
    """'heldout' for about HELDOUT_FRACTION of keys (by the SHA-256 of `key`), else 'train': the held-out
    split of the shipped corpus (keyed by source document) and of magpie prompts (keyed by text)."""
    digest = hashlib.sha256(key.encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") / 2**64 < HELDOUT_FRACTION else "train"


def default_corpus_path() -> Path:
    """The shipped prompt corpus (``glance_rt/data/prompts.jsonl``)."""
    return Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"


def read_prompts(path: str | os.PathLike) -> list[dict]:
    """Load and validate a prompts JSONL file (gzip-compressed when its name ends in .gz): one object
    per line with a non-empty ``prompt``.

    Optional fields: ``kind`` (str), ``images`` (list of paths), ``id`` (str; defaults to ``line-N``) and
    ``split`` ("train" or "heldout"); other fields are kept. Blank lines are skipped. Raises GlanceError
    naming the 1-based line for an empty file, malformed JSON or a missing/empty/ill-typed field.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
        text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
    except FileNotFoundError:
        raise GlanceError(f"{path}: no such prompts file") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise GlanceError(f"{path}: cannot read prompts file as UTF-8 text ({exc})") from None
    rows, ids = [], set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            row = _check_row(line, path, lineno)
            if row["id"] in ids:
                raise GlanceError(f"{path}, line {lineno}: duplicate id {row['id']!r}; ids must be unique")
            ids.add(row["id"])
            rows.append(row)
    if not rows:
        raise GlanceError(f'{path}, line 1: the prompts file is empty; write one JSON object per line, e.g. '
                          '{"prompt": "Describe the image."}')
    return rows


def _check_row(line: str, path: Path, lineno: int) -> dict:
    """One validated JSONL row (raises GlanceError naming the line)."""
    where = f"{path}, line {lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise GlanceError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno}); each line must be one JSON "
                          'object such as {"prompt": "..."}') from None
    if not isinstance(row, dict):
        raise GlanceError(f'{where}: expected a JSON object such as {{"prompt": "..."}}, got {type(row).__name__}')
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise GlanceError(f'{where}: missing or empty "prompt"; every line needs a non-empty "prompt" string')
    for key in ("kind", "id"):
        if key in row and (not isinstance(row[key], str) or not row[key]):
            raise GlanceError(f'{where}: "{key}" must be a non-empty string')
    if "split" in row and row["split"] not in SPLITS:
        raise GlanceError(f'{where}: "split" must be "train" or "heldout", got {row["split"]!r}')
    images = row.get("images", [])
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise GlanceError(f'{where}: "images" must be a list of image file paths')
    return {**row, "id": row.get("id", f"line-{lineno}")}




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


def encode_rows(target, rows: list[dict], images_dir=None) -> list[dict]:
    """Each row's prompt (and images, relative to `images_dir`) through the target's chat template
    and processor."""
    return [target.encode_chat(r["prompt"], open_images(r, images_dir)) for r in rows]
