"""The response store: a target's greedy responses kept as compact token ids, so a drafter can be
retrained, or its corpus grown, without generating them again, on any machine.

A store is a folder of parts. Each part is `part-<sha256>.npz`, named by the SHA-256 of its own bytes,
and holds N responses:
- `ids` int32 [sum of lengths]: each row's prompt ids then response ids, rows back to back;
- `prompt_lens`, `response_lens` int32 [N];
- `meta`: JSON with the store key (what the responses depend on: the target's name and weights, the
  response length, greedy decoding) and, per row, its prompt key (SHA-256 of the prompt text and of
  its images' bytes), kind, source and split.

Parts are only ever added, each written to a temp name and renamed, so a run killed at any point leaves
complete parts. Every part is checked on load: one whose bytes do not match its name (corrupt) or whose
key is another target's or settings' (foreign) is refused, never used. A row present in two parts (two
machines answered the same prompt) is the same greedy answer: the first one read is used.
"""

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glance_rt.errors import GlanceError
from glance_rt.files import atomic_write

FORMAT = "glance-rt/responses/1"


def store_key(target, response_tokens: int) -> dict:
    """What a stored response depends on: the same key, the same greedy answer."""
    from glance_rt.export.manifest import weights_hash

    return {"format": FORMAT, "target": target.name, "target_weights": weights_hash(target.hf_model),
            "dtype": str(target.dtype).removeprefix("torch."), "response_tokens": int(response_tokens),
            "decoding": "greedy"}


def prompt_key(row: dict, images_dir=None) -> str:
    """SHA-256 of a prompt row's text and its images' bytes (the same text with other images is another prompt)."""
    h = hashlib.sha256(row["prompt"].encode())
    for rel in row.get("images") or []:
        h.update(b"\0" + hashlib.sha256((Path(images_dir or ".") / rel).read_bytes()).digest())
    return h.hexdigest()


@dataclass(frozen=True)
class Stored:
    prompt_ids: list[int]
    response_ids: list[int]
    kind: str
    source: str
    split: str


class ResponseStore:
    """The parts under `path` for one store key. `get(prompt_key)` -> Stored or None; `add(rows)` writes
    one new part."""

    def __init__(self, path, key: dict):
        self.path, self.key = Path(path), key
        self.rows: dict[str, Stored] = {}
        for part in sorted(self.path.glob("part-*.npz")) if self.path.is_dir() else []:
            self._read(part)

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, key: str) -> Stored | None:
        return self.rows.get(key)

    def _read(self, part: Path) -> None:
        data = part.read_bytes()
        if part.name != f"part-{hashlib.sha256(data).hexdigest()}.npz":
            raise GlanceError(f"response store part {part} is corrupt (its bytes do not match its name): "
                              "delete it, and rerun to regenerate its responses")
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            ids, plens, rlens = z["ids"], z["prompt_lens"], z["response_lens"]
        if meta["key"] != self.key:
            differ = sorted(k for k in set(meta["key"]) | set(self.key) if meta["key"].get(k) != self.key.get(k))
            raise GlanceError(f"response store part {part} was made for another target or settings "
                              f"({', '.join(differ)} differ): use a store folder of this target's, or move the "
                              f"part out of {self.path}")
        at = 0
        for row, p, r in zip(meta["rows"], plens.tolist(), rlens.tolist(), strict=True):
            seq = ids[at:at + p + r].tolist()
            at += p + r
            self.rows.setdefault(row["key"], Stored(seq[:p], seq[p:], row["kind"], row["source"], row["split"]))

    def add(self, rows: list[tuple[str, Stored]]) -> Path | None:
        """Write `rows` [(prompt key, Stored)] not yet in the store as one new part; -> its path."""
        new = [(k, s) for k, s in rows if k not in self.rows]
        if not new:
            return None
        ids = np.array([t for _, s in new for t in s.prompt_ids + s.response_ids], dtype=np.int32)
        meta = {"key": self.key, "rows": [{"key": k, "kind": s.kind, "source": s.source, "split": s.split}
                                          for k, s in new]}
        buf = io.BytesIO()
        np.savez_compressed(buf, ids=ids, meta=np.array(json.dumps(meta)),
                            prompt_lens=np.array([len(s.prompt_ids) for _, s in new], dtype=np.int32),
                            response_lens=np.array([len(s.response_ids) for _, s in new], dtype=np.int32))
        data = buf.getvalue()
        path = self.path / f"part-{hashlib.sha256(data).hexdigest()}.npz"
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda p: p.write_bytes(data))
        self.rows.update(new)
        return path
