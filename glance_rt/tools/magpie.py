"""Prompts the target writes itself (Magpie: Xu et al., 2024). The chat template rendered up to the
start of a user turn, with nothing after it, is what the model sees before a user speaks, so
sampling from there makes it write a user's request, in the distribution it was tuned on. Each
batch starts from that one prefix, so no padding is needed, and each batch has its own seed, so a
run is deterministic and resumes batch by batch.

A sample is kept when it ended its turn (the end-of-turn token came before `max_tokens`), has
between `MIN_CHARS` and `MAX_CHARS` characters with mostly letters, does not repeat itself (no
word 4-gram three times), holds no template markup, and is new: its normalised text and its first
`PREFIX_WORDS` words are unseen. Each prompt gets kind "chat", source "magpie", and a held-out split
by a hash of its normalised text (`suites.split_of`, as the shipped corpus), so a held-out prompt
never has a training twin.

`glance-rt magpie --count N --out FILE.jsonl` writes FILE.jsonl (rows `read_prompts` and
`glance-rt train --prompts` take) after writing each finished batch to `FILE.jsonl.parts/`; a rerun
keeps those parts and continues.
"""

import json
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from glance_rt.errors import GlanceError
from glance_rt.files import atomic_write
from glance_rt.tools.suites import split_of

SENTINEL = "\u2063MAGPIE\u2063"  # stands for the user's text while the template renders
MIN_CHARS, MAX_CHARS = 12, 1200
PREFIX_WORDS = 8


@dataclass(frozen=True)
class MagpieConfig:
    count: int  # kept prompts wanted
    batch: int = 16  # samples per batch (one generate call)
    max_tokens: int = 128  # a sample still going at this length is dropped
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    max_batches: int | None = None  # stop after this many batches even if short (None: 20x count / batch)


def user_prefix(target) -> list[int]:
    """Token ids of the chat template up to where a user's text would start."""
    tok = target.tokenizer
    template = getattr(target.processor, "chat_template", None) or getattr(tok, "chat_template", None)
    if tok is None or not template:
        raise GlanceError(f"{target.name} has no chat template: magpie prompts need one to know where a user turn "
                          "starts")
    text = target.processor.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                                add_generation_prompt=False)
    if SENTINEL not in text:
        raise GlanceError(f"{target.name}'s chat template drops the user's text; it cannot make magpie prompts")
    return tok(text[: text.index(SENTINEL)], add_special_tokens=False)["input_ids"]


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def degenerate(text: str) -> str | None:
    """Why `text` is not a usable prompt, or None."""
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        return "length"
    if sum(c.isalpha() for c in text) < 0.5 * len(text):
        return "not prose"
    if re.search(r"<\|[^|>]*\|>|\[INST\]|<start_of_turn>", text):
        return "markup"
    words = normalise(text).split()
    grams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
    if grams and max(grams.count(g) for g in set(grams)) >= 3:
        return "repetition"
    return None


def text_split(text: str, seed: int = 0) -> str:
    """The held-out split of a prompt by its normalised text (`suites.split_of`)."""
    return split_of(f"{seed}:{normalise(text)}")


def sample_batch(target, prefix: list[int], cfg: MagpieConfig, index: int) -> list[str | None]:
    """One batch of samples from the user-turn prefix (seeded by cfg.seed and the batch index);
    None for a sample that did not end its turn."""
    eos = sorted(target.eos_token_ids)
    if not eos:
        raise GlanceError(f"{target.name} has no end-of-turn token: a written prompt would never end")
    ids = torch.tensor([prefix] * cfg.batch, device=target.device)
    torch.manual_seed(cfg.seed * 1_000_003 + index)
    with torch.no_grad():
        out = target.hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                       temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
                                       max_new_tokens=cfg.max_tokens, eos_token_id=eos, pad_token_id=eos[0])
    texts = []
    for row in out[:, len(prefix):].tolist():
        ended = next((i for i, t in enumerate(row) if t in target.eos_token_ids), None)
        texts.append(None if ended is None else target.tokenizer.decode(row[:ended], skip_special_tokens=True).strip())
    return texts


def keep(texts, seen: set, seed: int) -> tuple[list[dict], dict]:
    """The new, usable prompts of `texts` (updating `seen`), and a count of why the rest were dropped."""
    rows, dropped = [], Counter()
    for text in texts:
        why = "no end of turn" if text is None else degenerate(text)
        if why is None:
            norm = normalise(text)
            keys = (norm, "prefix:" + " ".join(norm.split()[:PREFIX_WORDS]))
            why = "duplicate" if any(k in seen for k in keys) else None
        if why is not None:
            dropped[why] += 1
            continue
        seen.update(keys)
        rows.append({"id": None, "kind": "chat", "split": text_split(text, seed), "prompt": text, "source": "magpie"})
    return rows, dropped


def make_prompts(target, out, cfg: MagpieConfig, progress: bool = True) -> dict:
    """Write cfg.count magpie prompts to `out` (JSONL) -> a summary. Finished batches are kept in
    `out`.parts/ (one file each, written then renamed), so a rerun continues where one stopped."""
    from tqdm import tqdm

    out = Path(out)
    parts = out.with_name(out.name + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    fixed = {k: v for k, v in cfg.__dict__.items() if k not in ("count", "max_batches")}  # what a batch depends on
    meta = {"target": Path(target.name).name, "config": fixed}
    meta_file = parts / "run.json"
    if meta_file.exists() and json.loads(meta_file.read_text()) != meta:
        raise GlanceError(f"{parts} holds batches of another magpie run ({meta_file.read_text().strip()}); "
                          "delete it or pick another --out")
    atomic_write(meta_file, lambda tmp: tmp.write_text(json.dumps(meta)))
    prefix = user_prefix(target)
    rows, seen, dropped, index = [], set(), Counter(), 0
    limit = cfg.max_batches if cfg.max_batches is not None else 20 * -(-cfg.count // cfg.batch)
    bar = tqdm(total=cfg.count, desc="magpie prompts", unit="prompt", disable=not progress)
    start = time.perf_counter()
    while len(rows) < cfg.count and index < limit:
        part = parts / f"batch-{index:06d}.json"
        if part.exists():
            texts = json.loads(part.read_text())["samples"]
        else:
            texts = sample_batch(target, prefix, cfg, index)
            record = json.dumps({"index": index, "samples": texts})
            atomic_write(part, lambda tmp, r=record: tmp.write_text(r))
        new, why = keep(texts, seen, cfg.seed)
        dropped += why
        new = new[: cfg.count - len(rows)]
        rows += new
        bar.update(len(new))
        bar.set_postfix(batches=index + 1, dropped=sum(dropped.values()))
        index += 1
    bar.close()
    if not rows:
        raise GlanceError(f"no usable prompt in {index} batches (dropped: {dict(dropped)}); raise --max-tokens or "
                          "--temperature")
    for i, row in enumerate(rows, 1):
        row["id"] = f"magpie-{cfg.seed}-{i:06d}"
    atomic_write(out, lambda tmp: tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)))
    return {"prompts": len(rows), "batches": index, "samples": index * cfg.batch, "dropped": dict(dropped),
            "heldout": sum(r["split"] == "heldout" for r in rows), "seconds": time.perf_counter() - start}
