"""`glance-rt train`'s data: the run folder, the prompts, stage 1 (the target's own answers, through the
response store) and stage 2 (its hidden states at the drafter's layers), and the sequences both heads
train on. Nothing here depends on which head is trained."""

import itertools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from glance_rt.errors import GlanceError
from glance_rt.files import atomic_write, open_images
from glance_rt.hf.arch import extend_inputs
from glance_rt.tools.suites import cap_per_kind, default_corpus_path, read_prompts
from glance_rt.tools.training.config import PART_SIZE, TrainConfig

# ----------------------------------------------------------------------------- small utilities


def dist_info():
    """(rank, world) under torchrun, else (0, 1); initialises gloo once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), world


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def progress(total: int, desc: str, rank: int, initial: int = 0):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=rank != 0, dynamic_ncols=True, smoothing=0.1)


# ----------------------------------------------------------------------------- run folder


def prepare_out(cfg: TrainConfig, target, rank: int) -> Path:
    """Create or check the run folder: refuse one that holds another run."""
    out = Path(cfg.out)
    meta = {"target": target.name, "vocab": target.vocab_size, "hidden": target.text_config.hidden_size,
            "config": json.loads(json.dumps(cfg.identity()))}
    run_file = out / "run.json"
    if rank != 0:  # rank 0 checks and creates the folder; the others wait at the barrier
        return out
    if run_file.exists():
        try:
            old = json.loads(run_file.read_text())
        except ValueError as e:
            raise GlanceError(f"{run_file} is corrupt ({e}); use a fresh --out folder") from e
        if not cfg.resume:
            raise GlanceError(
                f"{out} already holds a training run: pass --resume to continue it, or pick another --out"
            )
        if old != meta:
            raise GlanceError(f"{out} holds a different run ({old} != {meta}); pick another --out")
    elif out.exists() and any(out.iterdir()):
        raise GlanceError(f"{out} is not empty and holds no glance-rt run: pick an empty or new --out folder")
    else:
        atomic_write(run_file, lambda p: p.write_text(json.dumps(meta, indent=2)))
    return out


def load_rows(cfg: TrainConfig) -> list[dict]:
    rows = read_prompts(cfg.prompts or default_corpus_path())
    for i, row in enumerate(rows):
        row.setdefault("id", f"p{i:06d}")
        row.setdefault("kind", "default")
        row.setdefault("split", "train")
    return rows[: cfg.limit] if cfg.limit else rows


def training_rows(rows: list[dict], per_kind: int | None) -> list[dict]:
    """The prompts responses and features are made for: the train split, at most `per_kind` of each kind,
    the kinds taken in turn (so a run stopped part way, or a store filled part way, is balanced)."""
    by_kind: dict[str, list[dict]] = {}
    for r in cap_per_kind([r for r in rows if r["split"] == "train"], per_kind):
        by_kind.setdefault(r["kind"], []).append(r)
    turns = itertools.zip_longest(*by_kind.values())
    return [r for turn in turns for r in turn if r is not None]


def parts_of(rows: list, size: int = PART_SIZE) -> list[list]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


# ----------------------------------------------------------------------------- 1. responses


def _generate_batch(target, rows: list[dict], cfg: TrainConfig) -> list[dict]:
    """Greedy answers through the chat template / processor. Text models: left-padded batches;
    VLMs: one prompt at a time (their processors expand images per prompt)."""
    model, out = target.hf_model, []
    eos = target.eos_token_ids
    encoded = [target.encode_chat(r["prompt"], open_images(r, cfg.images)) for r in rows]
    order = sorted(range(len(encoded)), key=lambda i: encoded[i]["input_ids"].shape[1])  # less padding
    ordered = [encoded[i] for i in order]
    groups = [[e] for e in ordered] if target.is_vlm else parts_of(ordered, cfg.response_batch)
    answers = {}
    slot = iter(order)
    for group in groups:
        if target.is_vlm:
            inputs = group[0]
        else:
            pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else min(eos or {0})
            width = max(e["input_ids"].shape[1] for e in group)
            ids = torch.full((len(group), width), pad, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for i, e in enumerate(group):
                n = e["input_ids"].shape[1]
                ids[i, width - n :], mask[i, width - n :] = e["input_ids"][0], 1
            inputs = {"input_ids": ids, "attention_mask": mask}
        with torch.inference_mode():
            gen = model.generate(**inputs, do_sample=False, max_new_tokens=cfg.response_tokens,
                                 eos_token_id=sorted(eos) or None, pad_token_id=target.tokenizer.pad_token_id)
        for row in gen[:, inputs["input_ids"].shape[1] :].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            answers[next(slot)] = row[:cut]
    for k, (r, e) in enumerate(zip(rows, encoded, strict=True)):
        out.append({**r, "prompt_ids": e["input_ids"][0].tolist(), "response_ids": answers[k]})
    return out


def open_store(target, cfg: TrainConfig):
    """The run's response store, or None (call it before the linears are swapped: the key hashes the plain weights)."""
    if not cfg.store:
        return None
    from glance_rt.tools.store import ResponseStore, store_key

    return ResponseStore(cfg.store, store_key(target, cfg.response_tokens))


def heldout_rows(rows: list[dict], per_kind: int) -> list[dict]:
    """The held-out prompts that validation and the tau eval use: the first `per_kind` of each kind."""
    held: dict[str, list[dict]] = {}
    for r in rows:
        if r["split"] == "heldout" and len(held.setdefault(r["kind"], [])) < per_kind:
            held[r["kind"]].append(r)
    return [r for kind in held.values() for r in kind]


def stage_responses(target, rows: list[dict], held: list[dict], cfg: TrainConfig, out: Path, rank: int,
                    world: int, store=None) -> None:
    """responses/part-*.jsonl for the training `rows` and responses/heldout.jsonl for the `held` ones;
    with a response store (`open_store`), its answers are reused and new ones added to it."""
    answer = _generate_batch if store is None else (lambda t, r, c: _stored_batch(store, r, c, t))
    path = out / "responses" / "heldout.jsonl"
    if rank == 0 and held and not path.exists():
        result = answer(target, held, cfg)
        atomic_write(path, lambda p, r=result: p.write_text("".join(json.dumps(x) + "\n" for x in r)))
    parts = parts_of(rows)
    done = sum((out / "responses" / f"part-{i:05d}.jsonl").exists() for i in range(len(parts)))
    bar = progress(len(rows), "responses", rank, initial=min(done * PART_SIZE, len(rows)))
    for i in range(rank, len(parts), world):
        path = out / "responses" / f"part-{i:05d}.jsonl"
        if path.exists():
            continue
        result = answer(target, parts[i], cfg)
        atomic_write(path, lambda p, r=result: p.write_text("".join(json.dumps(x) + "\n" for x in r)))
        bar.update(len(parts[i]) * world)
    bar.close()
    barrier(world)


def _stored_batch(store, rows: list[dict], cfg: TrainConfig, target) -> list[dict]:
    """`_generate_batch` through the store: only prompts it lacks are generated, and then added to it."""
    from glance_rt.tools.store import Stored, prompt_key

    keys = [prompt_key(r, cfg.images) for r in rows]
    missing = [r for r, k in zip(rows, keys, strict=True) if store.get(k) is None]
    if missing:
        made = _generate_batch(target, missing, cfg)
        store.add([(prompt_key(r, cfg.images), Stored(r["prompt_ids"], r["response_ids"], r["kind"],
                                                      r.get("source", ""), r["split"])) for r in made])
    return [{**r, "prompt_ids": store.get(k).prompt_ids, "response_ids": store.get(k).response_ids}
            for r, k in zip(rows, keys, strict=True)]


# ----------------------------------------------------------------------------- 2. features


def capture_features(target, inputs: dict, layer_ids: tuple[int, ...], final: bool = False) -> Tensor | tuple:
    """Hidden states of `layer_ids` (HF `hidden_states[i + 1]` convention) for every row of one
    full-sequence forward, stopping after the deepest layer needed. -> [L, len(ids) * H]; with
    `final`, the forward runs to the end and (features, final normed hidden [L, H]) is returned."""
    text_model = target.parts.text_model
    last = len(text_model.layers) - 1
    seen, hooks = {}, []
    wanted = len(layer_ids) + final

    class Done(Exception):
        pass

    def grab(i):
        def hook(module, args, output):
            seen[i] = output[0] if isinstance(output, tuple) else output
            if len(seen) == wanted:
                raise Done

        return hook

    for i in layer_ids:
        module = text_model.norm if i == last else text_model.layers[i]
        hooks.append(module.register_forward_hook(grab(i)))
    if final:
        hooks.append(text_model.norm.register_forward_hook(grab("final")))
    try:
        with torch.inference_mode():
            target.hf_model(**inputs)
    except Done:
        pass
    finally:
        for h in hooks:
            h.remove()
    feats = torch.cat([seen[i][0] for i in layer_ids], -1)  # [L, F]
    return (feats, seen["final"][0]) if final else feats


def teacher_topk(target, final: Tensor, prompt_len: int, k: int) -> tuple[Tensor, Tensor]:
    """The target's distribution over each response token, as distillation reads it: its `k` most
    likely tokens and their log-probs (renormalised over those k) at rows prompt_len-1 .. L-2 (row j
    predicts token j+1). final [L, H] -> (ids [R, k] int32, log-probs [R, k] fp32), R = L - prompt_len."""
    with torch.inference_mode():
        logits = F.linear(final[prompt_len - 1 : -1], target.parts.lm_head.weight).float()  # [R, V]
        top = logits.topk(k, -1)
        return top.indices.to(torch.int32), top.values.log_softmax(-1)


def stage_features(target, cfg: TrainConfig, out: Path, layer_ids, rank: int, world: int, n_parts: int) -> None:
    held = out / "features" / "heldout.safetensors"
    if rank == 0 and (out / "responses" / "heldout.jsonl").exists() and not held.exists():
        _write_features(target, cfg, out / "responses" / "heldout.jsonl", held, layer_ids)
    done = sum((out / "features" / f"part-{i:05d}.safetensors").exists() for i in range(n_parts))
    bar = progress(n_parts, "features", rank, initial=done)
    for i in range(rank, n_parts, world):
        path = out / "features" / f"part-{i:05d}.safetensors"
        if not path.exists():
            _write_features(target, cfg, out / "responses" / f"part-{i:05d}.jsonl", path, layer_ids)
            bar.update(world)
    bar.close()
    barrier(world)


def _write_features(target, cfg: TrainConfig, responses: Path, path: Path, layer_ids) -> None:
    """One part: a full-sequence forward per response, its layers' states as bf16 safetensors (and,
    with --distill K, the target's top-K per response token)."""
    from safetensors.torch import save_file

    tensors, meta = {}, []
    for j, seq in enumerate(read_sequences(responses, cfg)):
        seq = with_features(target, cfg, seq, layer_ids)
        tensors[f"{j}.features"] = seq.features
        tensors[f"{j}.ids"] = seq.ids
        if seq.teacher is not None:
            tensors[f"{j}.teacher_ids"], tensors[f"{j}.teacher_logp"] = seq.teacher
        meta.append({"key": str(j), "id": seq.row["id"], "kind": seq.kind, "split": seq.row["split"],
                     "prompt_len": seq.prompt_len})
    atomic_write(path, lambda p: save_file(tensors, p, metadata={"rows": json.dumps(meta)}))


@dataclass
class Sequence:
    features: Tensor | None  # [L, F] bf16; None until the target computes them (online mode)
    ids: Tensor  # [L] prompt then response ids
    prompt_len: int
    kind: str
    row: dict | None = None  # its response row (what the target re-encodes for online features)
    teacher: tuple[Tensor, Tensor] | None = None  # --distill K: the target's top-K (ids, log-probs) [L - prompt_len, K]


def read_sequences(responses: Path, cfg: TrainConfig) -> list[Sequence]:
    """The sequences of a responses file, without features: each response cut to fit max_seq_len,
    and those left with fewer than 2 tokens dropped (no anchor with a target)."""
    seqs = []
    for line in responses.read_text().splitlines():
        if line:
            r = json.loads(line)
            resp = r["response_ids"][: max(cfg.max_seq_len - len(r["prompt_ids"]), 0)]
            if len(resp) >= 2:
                seqs.append(Sequence(None, torch.tensor(r["prompt_ids"] + resp), len(r["prompt_ids"]), r["kind"],
                                     {**r, "response_ids": resp}))
    return seqs


def sequence_inputs(target, seq: Sequence, images: str | None) -> dict:
    """The target's inputs for `seq` whole: its prompt (and images, relative to `images`) through the chat
    template, then its response."""
    return extend_inputs(target.encode_chat(seq.row["prompt"], open_images(seq.row, images)), seq.row["response_ids"])


def with_features(target, cfg: TrainConfig, seq: Sequence, layer_ids) -> Sequence:
    """`seq` with the target's features as training stores them ([L, F] bf16, one full-sequence
    forward) and, with --distill K, its top-K distribution over each response token."""
    inputs = sequence_inputs(target, seq, cfg.images)
    if not cfg.distill:
        feats, teacher = capture_features(target, inputs, layer_ids), None
    else:
        feats, final = capture_features(target, inputs, layer_ids, final=True)
        teacher = teacher_topk(target, final, seq.prompt_len, cfg.distill)
    assert feats.shape[0] == seq.ids.shape[0], "features must cover every row"
    return replace(seq, features=feats.to(torch.bfloat16).contiguous(), teacher=teacher)


def load_features(files: list[Path]) -> list[Sequence]:
    from safetensors import safe_open

    seqs = []
    for path in files:
        with safe_open(path, "pt") as f:
            names = set(f.keys())
            for m in json.loads(f.metadata()["rows"]):
                key = m["key"]
                teacher = ((f.get_tensor(f"{key}.teacher_ids"), f.get_tensor(f"{key}.teacher_logp"))
                           if f"{key}.teacher_ids" in names else None)
                seqs.append(Sequence(f.get_tensor(f"{key}.features"), f.get_tensor(f"{key}.ids"),
                                     m["prompt_len"], m["kind"], teacher=teacher))
    return seqs


def load_sequences(out: Path, cfg: TrainConfig, n_parts: int) -> tuple[list[Sequence], list[Sequence]]:
    """(training, held-out) sequences: with their cached features, or (online) without them."""
    held = out / ("features/heldout.safetensors" if cfg.features == "cached" else "responses/heldout.jsonl")
    if cfg.features == "cached":
        train_seqs = load_features([out / "features" / f"part-{i:05d}.safetensors" for i in range(n_parts)])
        return train_seqs, load_features([held]) if held.exists() else []
    train_seqs = [s for i in range(n_parts) for s in read_sequences(out / "responses" / f"part-{i:05d}.jsonl", cfg)]
    return train_seqs, read_sequences(held, cfg) if held.exists() else []


# ----------------------------------------------------------------------------- 3. training: the loss


def choose_draft_vocab(out: Path, n_parts: int, size: int | None, vocab_size: int) -> Tensor | None:
    """The `size` most frequent token ids of the training responses (ties by id), sorted; None when
    that would be the whole vocabulary."""
    if size is None or size >= vocab_size:
        return None
    ids = [t for i in range(n_parts)
           for line in (out / "responses" / f"part-{i:05d}.jsonl").read_text().splitlines() if line
           for t in json.loads(line)["response_ids"]]
    counts = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)  # [V]
    order = torch.sort(-counts, stable=True).indices  # most frequent first, ties by the smaller id
    return order[:size].sort().values

