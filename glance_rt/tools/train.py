"""`glance-rt train`: self-distillation of a GLANCE drafter for one target (DESIGN.md section 6).

Stages, each cached under `--out` and skipped when done:
  1. responses  the target's own greedy answers to the prompts        responses/part-*.jsonl
  2. features   one target forward per sequence, chosen layers' states  features/part-*.safetensors
                (`--features online`: no cache; the target computes them inside each training step)
  3. training   anchored blocks, CE through the frozen lm_head           checkpoints/step-*/, drafter/
                held-out loss and chain tau at every checkpoint, the best kept  history.json, history.png
  4. eval       mean accepted length tau per kind on held-out prompts    eval.json
The held-out prompts (the first `eval_per_kind` of each kind) get responses and features too
(responses/heldout.jsonl, features/heldout.safetensors): validation reads them at each checkpoint, and
the drafter written at the end is the checkpoint with the lowest held-out loss, so memorisation shows
in history.json and stops at its best point.
Every file is written to a temp name then renamed, so a killed run (even kill -9) leaves only
complete parts; `--resume` continues from them. Data parallel: run under
`torchrun --nproc_per_node N -m glance_rt.cli train ...` (gloo on CPU): prompts and batches are split
across ranks, gradients all-reduced, rank 0 writes checkpoints.
"""

import copy
import functools
import itertools
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from glance_rt.errors import GlanceError
from glance_rt.files import atomic_write, open_images
from glance_rt.hf.arch import extend_inputs
from glance_rt.method import DEFAULT_LOOKUP
from glance_rt.models.drafter import (
    build_target_layer_ids,
    init_drafter,
    read_drafter,
    rope,
    rope_tables,
    save_drafter,
)
from glance_rt.models.kernels import KernelPlan, KernelTuner
from glance_rt.models.linear import swapped_linears
from glance_rt.round.loop import Decoder
from glance_rt.tools.suites import cap_per_kind, default_corpus_path, read_prompts

FEATURE_MODES = ("cached", "online")
STAGES = ("responses", "features", "train")  # in order; TrainConfig.until names the last one to run
PART_SIZE = 64  # prompts per response/feature part file
PACK_ROWS = 32  # the row class timed for the response and feature stages (and oneDNN's layout hint)


@dataclass(frozen=True)
class TrainConfig:
    out: str
    prompts: str | None = None  # JSONL; None = the corpus shipped for the default target
    images: str | None = None  # folder that the prompts' image paths are relative to
    num_layers: int = 1
    block_size: int = 8
    target_layer_ids: tuple[int, ...] | None = None  # None = DFlash's default for num_layers
    response_tokens: int = 128
    response_batch: int = 16
    max_seq_len: int = 768
    steps: int = 1000
    batch_size: int = 8  # sequences per optimizer step, over all ranks
    blocks_per_seq: int = 16
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0  # loss weight of depth k: exp(-(k-1)/gamma)
    bf16: bool | None = None  # bf16 autocast and a bf16 lm_head copy; None: where bf16 is measured faster (`use_bf16`)
    draft_vocab: int | None = None  # glance-only: the N most frequent response tokens form the draft vocabulary
    mask_token_id: int | None = None  # None: `default_mask_token_id(target)`
    learned_mask: bool = False  # glance-only: a learned mask embedding instead of a mask token's
    init_from: str | None = None  # a drafter folder to start from (its matching tensors), instead of a random init
    store: str | None = None  # a response store folder (glance_rt.tools.store): responses read from and added to it
    seed: int = 0
    save_every: int = 100
    eval_every: int = 0  # 0: evaluate at the end only
    eval_per_kind: int = 8
    eval_budget: int = 8  # `glance-rt generate`'s defaults: tree budget 8 with lookup chains of n-grams up to 8
    eval_lookup: int = DEFAULT_LOOKUP
    eval_tokens: int = 128
    limit: int | None = None  # use only the first N prompts (smoke runs)
    per_kind: int | None = None  # train on at most N prompts of each kind (held-out prompts are never trained on)
    features: str = "cached"  # "cached": stage 2 writes them to disk; "online": the target computes them in the step
    until: str = "train"  # the last stage to run: "responses" (fill a store), "features" or "train"
    resume: bool = False

    def identity(self) -> dict:
        """What must match for --resume to continue a run in the same folder."""
        keys = ("prompts", "images", "num_layers", "block_size", "target_layer_ids", "response_tokens",
                "max_seq_len", "seed", "limit", "per_kind", "draft_vocab", "mask_token_id", "learned_mask", "init_from")
        return {k: getattr(self, k) for k in keys}


# ----------------------------------------------------------------------------- small utilities


def _dist():
    """(rank, world) under torchrun, else (0, 1); initialises gloo once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), world


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _bar(total: int, desc: str, rank: int, initial: int = 0):
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


def _parts(rows: list, size: int = PART_SIZE) -> list[list]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


# ----------------------------------------------------------------------------- 1. responses


def _generate_batch(target, rows: list[dict], cfg: TrainConfig) -> list[dict]:
    """Greedy answers through the chat template / processor. Text models: left-padded batches;
    VLMs: one prompt at a time (their processors expand images per prompt)."""
    model, out = target.hf_model, []
    eos = target.eos_token_ids
    encoded = [target.encode_chat(r["prompt"], open_images(r, cfg.images)) for r in rows]
    order = sorted(range(len(encoded)), key=lambda i: encoded[i]["input_ids"].shape[1])  # less padding
    groups = [[encoded[i]] for i in order] if target.is_vlm else _parts([encoded[i] for i in order], cfg.response_batch)
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
    parts = _parts(rows)
    done = sum((out / "responses" / f"part-{i:05d}.jsonl").exists() for i in range(len(parts)))
    bar = _bar(len(rows), "responses", rank, initial=min(done * PART_SIZE, len(rows)))
    for i in range(rank, len(parts), world):
        path = out / "responses" / f"part-{i:05d}.jsonl"
        if path.exists():
            continue
        result = answer(target, parts[i], cfg)
        atomic_write(path, lambda p, r=result: p.write_text("".join(json.dumps(x) + "\n" for x in r)))
        bar.update(len(parts[i]) * world)
    bar.close()
    _barrier(world)


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


def capture_features(target, inputs: dict, layer_ids: tuple[int, ...]) -> Tensor:
    """Hidden states of `layer_ids` (HF `hidden_states[i + 1]` convention) for every row of one
    full-sequence forward, stopping after the deepest layer needed. -> [L, len(ids) * H]."""
    text_model = target.parts.text_model
    last = len(text_model.layers) - 1
    seen, hooks = {}, []

    class Done(Exception):
        pass

    def grab(i):
        def hook(module, args, output):
            seen[i] = output[0] if isinstance(output, tuple) else output
            if len(seen) == len(layer_ids):
                raise Done

        return hook

    for i in layer_ids:
        module = text_model.norm if i == last else text_model.layers[i]
        hooks.append(module.register_forward_hook(grab(i)))
    try:
        with torch.inference_mode():
            target.hf_model(**inputs)
    except Done:
        pass
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([seen[i][0] for i in layer_ids], -1)  # [L, F]


def stage_features(target, cfg: TrainConfig, out: Path, layer_ids, rank: int, world: int, n_parts: int) -> None:
    held = out / "features" / "heldout.safetensors"
    if rank == 0 and (out / "responses" / "heldout.jsonl").exists() and not held.exists():
        _write_features(target, cfg, out / "responses" / "heldout.jsonl", held, layer_ids)
    done = sum((out / "features" / f"part-{i:05d}.safetensors").exists() for i in range(n_parts))
    bar = _bar(n_parts, "features", rank, initial=done)
    for i in range(rank, n_parts, world):
        path = out / "features" / f"part-{i:05d}.safetensors"
        if not path.exists():
            _write_features(target, cfg, out / "responses" / f"part-{i:05d}.jsonl", path, layer_ids)
            bar.update(world)
    bar.close()
    _barrier(world)


def _write_features(target, cfg: TrainConfig, responses: Path, path: Path, layer_ids) -> None:
    """One part: a full-sequence forward per response, its layers' states as bf16 safetensors."""
    from safetensors.torch import save_file


    tensors, meta = {}, []
    for j, seq in enumerate(read_sequences(responses, cfg)):
        tensors[f"{j}.features"] = sequence_features(target, cfg, seq, layer_ids)
        tensors[f"{j}.ids"] = seq.ids
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


def sequence_features(target, cfg: TrainConfig, seq: Sequence, layer_ids) -> Tensor:
    """The target's features of `seq` as training stores them: [L, F] bf16 (one full-sequence forward)."""
    inputs = target.encode_chat(seq.row["prompt"], open_images(seq.row, cfg.images))
    feats = capture_features(target, extend_inputs(inputs, seq.row["response_ids"]), layer_ids)
    assert feats.shape[0] == seq.ids.shape[0], "features must cover every row"
    return feats.to(torch.bfloat16).contiguous()


def load_features(files: list[Path]) -> list[Sequence]:
    from safetensors import safe_open

    seqs = []
    for path in files:
        with safe_open(path, "pt") as f:
            for m in json.loads(f.metadata()["rows"]):
                seqs.append(Sequence(f.get_tensor(f"{m['key']}.features"), f.get_tensor(f"{m['key']}.ids"),
                                     m["prompt_len"], m["kind"]))
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


def block_forward(drafter, embed: Tensor, features: Tensor, ids: Tensor, anchors: Tensor) -> Tensor:
    """The training pass for one sequence: K blocks `[x_a, M, ..., M]` at anchors a [K], all in one
    drafter forward (`GlanceDrafter.forward`, the inference pass's too). Each block sees the context
    rows strictly before its anchor and its own rows (a block-sparse mask), exactly what `DraftPass`
    sees at inference. features [L, F], ids [L] -> normed hidden of depths 1..B-1 [K, B-1, H]."""
    c = drafter.config
    b, k_blocks, length = c.block_size, anchors.shape[0], ids.shape[0]
    w = drafter.fc.weight
    pos = anchors[:, None] + torch.arange(b)  # [K, B] token index of each block row
    ctx = drafter.context(features)[None]  # [1, L, H]
    first = embed[ids[anchors]][:, None]  # [K, 1, H]
    mask_vec = drafter.mask_embedding if c.learned_mask else embed[c.mask_token_id]
    h = torch.cat([first, mask_vec.expand(k_blocks, b - 1, -1)], 1)  # [K, B, H]
    h = h.reshape(1, k_blocks * b, -1).to(w.dtype)  # [1, KB, H]
    q_block = torch.arange(k_blocks).repeat_interleave(b)  # [KB] block of each query row
    ctx_vis = torch.arange(length)[None, :] < anchors[q_block][:, None]  # [KB, L]
    blk_vis = q_block[:, None] == q_block[None, :]  # [KB, KB]
    mask = torch.cat([ctx_vis, blk_vis], 1)[None, None]  # [1, 1, KB, L+KB]
    inv_freq, scaling = rope(c)
    cos, sin = rope_tables(inv_freq, torch.cat([torch.arange(length), pos.flatten()]), w.dtype, scaling)
    groups = c.num_attention_heads // c.num_key_value_heads

    def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # keys: the whole context, then the blocks
        k_ctx, v_ctx = drafter.context_kv(i, ctx, cos[:, :length], sin[:, :length])
        k = torch.cat([k_ctx, k], 2).repeat_interleave(groups, 1)  # [1, nh, L+KB, D]
        v = torch.cat([v_ctx, v], 2).repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c.head_dim**-0.5)

    out = drafter(h, cos[:, length:], sin[:, length:], attend)  # [1, KB, H]
    return out.view(k_blocks, b, -1)[:, 1:]  # [K, B-1, H]


def block_loss(drafter, embed: Tensor, head: Tensor, picks: list[tuple[Sequence, Tensor]], gamma: float,
               column: Tensor | None = None):
    """CE of depth k predicting x_{a+k} through the frozen lm_head rows `head` [Vd, H], weighted
    exp(-(k-1)/gamma), for every (sequence, anchors [K]) pick. The drafter runs once per sequence; the
    head and the softmax run once over all picks' rows (one large GEMM: over the whole vocabulary the
    head is most of a step's cost, and 8 small GEMMs ran ~3x slower than one). `column` [V] maps a
    token id to its row of `head` (-1: not in the draft vocabulary, which the drafter cannot propose:
    no loss, and a chain stops there); None: row = id.
    Returns (weighted CE sum, weight sum, chain accepted-length sum over the blocks)."""
    b = drafter.config.block_size
    outs, targets, valid = [], [], []
    for seq, anchors in picks:
        length = seq.ids.shape[0]
        outs.append(block_forward(drafter, embed, seq.features, seq.ids, anchors))  # [K, B-1, H]
        tgt_pos = anchors[:, None] + torch.arange(1, b)  # [K, B-1]
        targets.append(seq.ids[tgt_pos.clamp(max=length - 1)])
        valid.append(tgt_pos < length)
    out, targets, valid = torch.cat(outs), torch.cat(targets), torch.cat(valid)  # [N, B-1, ...]
    logits = F.linear(out.to(head.dtype), head).float()  # [N, B-1, Vd]
    if column is not None:
        targets = column[targets]
    valid = valid & (targets >= 0)
    targets = targets.clamp(min=0)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    weight = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / gamma)[None].expand_as(ce) * valid
    correct = (logits.argmax(-1) == targets) & valid
    accepted = 1 + correct.long().cumprod(1).sum(1)  # chain acceptance of each block (+1 bonus)
    return (ce * weight).sum(), weight.sum(), accepted.sum().item()


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


def start_from(drafter, path) -> None:
    """Copy the weights of drafter folder `path` into `drafter` (same architecture and target layers);
    a tensor the other drafter lacks (a mask embedding, a draft vocabulary) keeps its new value."""
    src = read_drafter(path)
    a, b = src.config, drafter.config
    keys = ("hidden_size", "vocab_size", "target_layer_ids", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta", "rope_scaling")
    differ = [k for k in keys if getattr(a, k) != getattr(b, k)]
    if differ:
        raise GlanceError(f"--init-from {path}: its {', '.join(differ)} differ from this run's; "
                          "pick a drafter of the same shape and target layers")
    own = drafter.state_dict()
    with torch.no_grad():
        for k, v in src.state_dict().items():
            if k in own and k != "draft_vocab":
                own[k].copy_(v)


def use_bf16(device: torch.device, hidden: int, vocab: int, rows: int = 896, timer=None) -> bool:
    """Whether bf16 autocast pays for training here. On a GPU: where it supports bf16. On a CPU,
    measured: the head's GEMM shape (rows x hidden -> vocab, forward and input gradient, the
    bulk of a step) in bf16 against fp32; bf16 is ~6x slower on a CPU without AVX512-BF16 / AMX
    (docs/training.md) and faster with them. `timer(dtype)` -> seconds (tests inject one)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    if timer is None:
        def timer(dtype):
            g = torch.Generator().manual_seed(0)
            w = torch.randn(min(vocab, 8192), hidden, generator=g).to(dtype)
            x = torch.randn(rows, hidden, generator=g).to(dtype)
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                y = x @ w.T  # forward
                y @ w  # input gradient
                times.append(time.perf_counter() - t0)
            return sorted(times)[1]  # the fastest but one (the first call warms up)
    return timer(torch.bfloat16) < timer(torch.float32)


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = max(int(cfg.steps * cfg.warmup), 1)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(cfg.steps - warm, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def sample_step(seqs: list[Sequence], cfg: TrainConfig, step: int) -> list[tuple[int, Tensor]]:
    """The step's (sequence index, anchors) pairs: a pure function of (seed, step), so a resumed
    run draws exactly what an uninterrupted one would."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    return [(i, draw_anchors(seqs[i], cfg.blocks_per_seq, g))
            for i in torch.randint(len(seqs), (cfg.batch_size,), generator=g).tolist()]


def draw_anchors(seq: Sequence, count: int, g: torch.Generator) -> Tensor:
    """Up to `count` distinct anchors in `seq`'s response, sorted, each with >= 1 target after it."""
    lo, hi = seq.prompt_len, seq.ids.shape[0] - 1
    return lo + torch.randperm(hi - lo, generator=g)[:count].sort().values


@dataclass
class Checkpoint:
    step: int
    path: Path


def latest_checkpoint(out: Path) -> Checkpoint | None:
    best = None
    for p in (out / "checkpoints").glob("step-*"):
        if (p / "trainer.pt").is_file() and (p / "model.safetensors").is_file():
            step = int(p.name.split("-")[1])
            if best is None or step > best.step:
                best = Checkpoint(step, p)
    return best


def save_checkpoint(drafter, opt, step: int, out: Path) -> None:
    """Write `checkpoints/step-N/` (drafter folder + optimizer state) via a temp folder and a
    rename; on failure (disk full) the previous checkpoints stay intact and nothing partial remains."""
    final = out / "checkpoints" / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt.", dir=out))
    try:
        save_drafter(drafter, tmp / "d", dtype=torch.float32)
        torch.save({"step": step, "optimizer": opt.state_dict()}, tmp / "d" / "trainer.pt")
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / "d", final)
    except OSError as e:
        last = latest_checkpoint(out)
        raise GlanceError(
            f"could not write checkpoint {final} ({e}); the last complete checkpoint "
            f"({last.path if last else 'none'}) is intact: free space and rerun with --resume"
        ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prune_checkpoints(out: Path, best: int | None, keep: int = 2) -> None:
    """Delete all checkpoints but the last `keep` and the best one."""
    for p in sorted((out / "checkpoints").glob("step-*"))[:-keep]:
        if int(p.name.split("-")[1]) != best:
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------- held-out validation


def validation_picks(seqs: list[Sequence], cfg: TrainConfig) -> list[tuple[int, Tensor]]:
    """Fixed (sequence, anchors) pairs for validation: up to blocks_per_seq anchors per held-out
    sequence, drawn once from the seed, so every checkpoint is scored on the same blocks."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 - 1)
    return [(i, draw_anchors(s, cfg.blocks_per_seq, g)) for i, s in enumerate(seqs)]


def read_history(out: Path, upto: int) -> list[dict]:
    """history.json's entries for steps up to `upto` (a resumed run rewrites what follows)."""
    path = out / "history.json"
    return [e for e in json.loads(path.read_text())["steps"] if e["step"] <= upto] if path.exists() else []


def best_step(history: list[dict]) -> int | None:
    """The step with the lowest held-out loss (the last step when there is no held-out set)."""
    scored = [e for e in history if e.get("heldout_loss") is not None]
    if scored:
        return min(scored, key=lambda e: (e["heldout_loss"], e["step"]))["step"]
    return history[-1]["step"] if history else None


def write_history(out: Path, history: list[dict]) -> None:
    doc = {"best_step": best_step(history), "criterion": "lowest held-out loss", "steps": history}
    atomic_write(out / "history.json", lambda p: p.write_text(json.dumps(doc, indent=1)))


def plot_history(out: Path, history: list[dict]) -> Path | None:
    """history.png: training and held-out loss, and held-out chain tau, per checkpoint (None without
    matplotlib, which the 'plot' extra installs)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None or not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    nan = float("nan")
    train_loss = [nan if e["train_loss"] is None else e["train_loss"] for e in history]
    ax.plot(steps, train_loss, label="training loss (mean since the last checkpoint)")
    if any(e.get("heldout_loss") is not None for e in history):
        ax.plot(steps, [e.get("heldout_loss", nan) for e in history], label="held-out loss")
        tau = ax.twinx()
        tau.plot(steps, [e.get("heldout_tau_chain", nan) for e in history], "g--", label="held-out chain tau")
        tau.set_ylabel("held-out chain tau (tokens per block)")
        tau.legend(loc="upper center")
    best = best_step(history)
    ax.axvline(best, color="grey", linestyle=":", label=f"best (step {best})")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted CE")
    ax.legend(loc="upper right")
    ax.set_title(f"{out.name}: drafter training")
    fig.tight_layout()
    path = out / "history.png"
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- 3. training: the loop


class Trainer:
    """One training run's drafter, optimizer, frozen head and feature source."""

    def __init__(self, target, cfg: TrainConfig, out: Path, layer_ids, n_parts: int, linear):
        self.target, self.cfg, self.out, self.layer_ids, self.linear = target, cfg, out, layer_ids, linear
        self.seqs, self.held = load_sequences(out, cfg, n_parts)
        if not self.seqs:
            raise GlanceError("no training sequences: every response was shorter than 2 tokens or all prompts are "
                              "held out")
        self.held_picks = validation_picks(self.held, cfg)
        vocab = choose_draft_vocab(out, n_parts, cfg.draft_vocab, target.vocab_size)
        drafter = init_drafter(target, cfg.num_layers, cfg.block_size, seed=cfg.seed, target_layer_ids=layer_ids,
                               draft_vocab_size=None if vocab is None else len(vocab),
                               mask_token_id=cfg.mask_token_id, learned_mask=cfg.learned_mask)
        if vocab is not None:
            drafter.draft_vocab.copy_(vocab)
        if cfg.init_from:
            start_from(drafter, cfg.init_from)
        self.drafter = drafter.float().train().requires_grad_(True)
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     betas=(0.9, 0.95))
        self.embed = target.parts.text_model.embed_tokens.weight.detach().float()
        head = target.parts.lm_head.weight.detach()
        self.column = None
        if vocab is not None:  # token id -> row of the draft head, -1 outside the draft vocabulary
            head = head[vocab]
            self.column = torch.full((target.vocab_size,), -1, dtype=torch.long)
            self.column[vocab] = torch.arange(len(vocab))
        self.bf16 = use_bf16(target.device, head.shape[1], head.shape[0]) if cfg.bf16 is None else cfg.bf16
        self.head = head.to(torch.bfloat16 if self.bf16 else torch.float32).contiguous()  # [Vd, H]

    def autocast(self):
        return torch.autocast(str(self.target.device.type), dtype=torch.bfloat16, enabled=self.bf16)

    def resume(self) -> int:
        """Load the last checkpoint, if any -> the step it ends."""
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            return 0
        self.drafter.load_state_dict(read_drafter(ckpt.path, dtype=torch.float32).state_dict())
        self.opt.load_state_dict(torch.load(ckpt.path / "trainer.pt", weights_only=True)["optimizer"])
        return ckpt.step

    def featured(self, seq: Sequence) -> Sequence:
        """`seq` with its features: cached ones, or (online) the target's, computed now by the same
        modules the feature stage runs, so online and cached training are the same computation."""
        if seq.features is not None:
            return seq
        with swapped_linears(self.target.hf_model, self.linear):
            return replace(seq, features=sequence_features(self.target, self.cfg, seq, self.layer_ids))

    def loss(self, seqs: list[Sequence], picks: list[tuple[int, Tensor]]):
        with self.autocast():
            return block_loss(self.drafter, self.embed, self.head, [(self.featured(seqs[i]), a) for i, a in picks],
                              self.cfg.gamma, self.column)

    def validate(self) -> dict:
        """Held-out loss and chain tau (accepted length of the block's own chain, +1) on the fixed picks."""
        self.held = [self.featured(s) for s in self.held]  # online: the target's features, computed once
        loss_sum, weight_sum, accepted = 0.0, 0.0, 0
        self.drafter.eval()
        with torch.no_grad():
            for i in range(0, len(self.held_picks), self.cfg.batch_size):
                ls, ws, acc = self.loss(self.held, self.held_picks[i : i + self.cfg.batch_size])
                loss_sum, weight_sum, accepted = loss_sum + float(ls), weight_sum + float(ws), accepted + acc
        self.drafter.train()
        blocks = sum(len(a) for _, a in self.held_picks)
        return {"heldout_loss": loss_sum / weight_sum, "heldout_tau_chain": accepted / blocks}


def stage_train(target, cfg: TrainConfig, out: Path, layer_ids, rank: int, world: int, n_parts: int, evaluate,
                linear):
    """Train from the last checkpoint; at each one, score the held-out set and keep the best
    checkpoint; write it as drafter/ (bf16) at the end."""
    if (out / "drafter" / "model.safetensors").exists():  # trained already: skip loading the features
        return read_drafter(out / "drafter")
    tr = Trainer(target, cfg, out, layer_ids, n_parts, linear)
    start = tr.resume()
    history = read_history(out, start)
    if rank == 0:
        print(f"[train] {'bf16 autocast' if tr.bf16 else 'fp32'} ({'measured' if cfg.bf16 is None else 'as asked'}); "
              f"{len(tr.seqs)} training and {len(tr.held)} held-out sequences; features {cfg.features}")
        if start and not any(e["step"] == start for e in history):  # killed between its checkpoint and its entry
            history.append({"step": start, "train_loss": None, **(tr.validate() if tr.held else {})})
    bar = _bar(cfg.steps, "train", rank, initial=start)
    losses = []
    for step in range(start, cfg.steps):
        picks = sample_step(tr.seqs, cfg, step)[rank::world]
        for group in tr.opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss_sum, weight_sum, accepted = tr.loss(tr.seqs, picks)
        stats = torch.tensor([float(weight_sum), float(accepted), float(sum(len(a) for _, a in picks))])
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(stats)
        loss = loss_sum / stats[0]
        tr.opt.zero_grad(set_to_none=True)
        loss.backward()
        loss_val = torch.tensor([loss.item()])
        if world > 1:
            for p in tr.drafter.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
            dist.all_reduce(loss_val)
        torch.nn.utils.clip_grad_norm_(tr.drafter.parameters(), cfg.grad_clip)
        tr.opt.step()
        losses.append(loss_val.item())
        bar.set_postfix(loss=f"{loss_val.item():.3f}", tau_chain=f"{stats[1] / stats[2]:.2f}",
                        lr=f"{lr_at(step, cfg):.1e}")
        bar.update(1)
        done = step + 1
        if rank == 0 and (done % cfg.save_every == 0 or done == cfg.steps):
            save_checkpoint(tr.drafter, tr.opt, done, out)
            entry = {"step": done, "train_loss": sum(losses) / len(losses), **(tr.validate() if tr.held else {})}
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                tr.drafter.eval()
                res = evaluate(tr.drafter, per_kind=max(cfg.eval_per_kind // 4, 1), quiet=True)
                tr.drafter.train()
                entry["heldout_tau"] = res["overall"]["tau"]
                entry["heldout_tau_kinds"] = {k: v["tau"] for k, v in res["kinds"].items()}
            history.append(entry)
            write_history(out, history)
            prune_checkpoints(out, best_step(history))
            bar.write(f"step {done}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()
                                                   if isinstance(v, float)))
            losses = []
        _barrier(world)
    bar.close()
    if rank == 0:
        best = best_step(history)
        plot_history(out, history)
        chosen = read_drafter(out / "checkpoints" / f"step-{best:06d}", dtype=torch.float32)
        save_drafter(chosen, out / "drafter", dtype=torch.bfloat16)
        print(f"[train] drafter/ is the checkpoint of step {best} (lowest held-out loss; history.json)")
    _barrier(world)
    return read_drafter(out / "drafter")


# ----------------------------------------------------------------------------- 4. evaluation


def evaluate_tau(target, drafter, rows: list[dict], cfg: TrainConfig, per_kind: int, quiet: bool = False,
                 lookup: int = 0) -> dict:
    """Mean accepted length (tokens committed per round) on held-out prompts, per kind, with the
    real decoder and the given tree budget (`lookup` > 0: with prompt-lookup chains grafted in)."""
    drafter = copy.deepcopy(drafter).to(target.dtype).eval().requires_grad_(False)  # never touch the trained one
    held: dict[str, list] = {}
    for r in heldout_rows(rows, per_kind):
        held.setdefault(r["kind"], []).append(r)
    # every round drafts (gate=False): tau measures the drafter, not this machine's draft gate
    dec = Decoder(target, drafter, tree_budget=cfg.eval_budget, max_length=4096, lookup=lookup, gate=False)
    kinds, all_lens, passes = {}, [], 0
    bar = _bar(sum(len(v) for v in held.values()), "eval", 0 if not quiet else 1)
    for kind, items in held.items():
        lens, kind_passes = [], 0
        for r in items:
            inputs = target.encode_chat(r["prompt"], open_images(r, cfg.images))
            stats = dec.generate(max_new_tokens=cfg.eval_tokens, **inputs).stats
            lens += stats.accepted_lengths
            kind_passes += stats.draft_passes
            bar.update(1)
        kinds[kind] = {"tau": sum(lens) / max(len(lens), 1), "rounds": len(lens), "draft_passes": kind_passes,
                       "prompts": len(items)}
        all_lens += lens
        passes += kind_passes
    bar.close()
    return {"overall": {"tau": sum(all_lens) / max(len(all_lens), 1), "rounds": len(all_lens), "draft_passes": passes},
            "kinds": kinds, "tree_budget": cfg.eval_budget, "max_new_tokens": cfg.eval_tokens, "lookup": lookup}


# ----------------------------------------------------------------------------- the whole job


def train(target, cfg: TrainConfig):
    """Run (or resume) every stage up to cfg.until; returns (drafter, eval results), (None, None) when
    it stops before training."""
    if not 2 <= cfg.block_size <= 64:
        raise GlanceError(f"block_size must be in [2, 64], got {cfg.block_size}")
    if cfg.until not in STAGES:
        raise GlanceError(f"until must be one of {', '.join(STAGES)}, got {cfg.until!r}")
    if cfg.features not in FEATURE_MODES:
        raise GlanceError(f"features must be one of {', '.join(FEATURE_MODES)}, got {cfg.features!r}")
    rank, world = _dist()
    torch.manual_seed(cfg.seed)
    n_target = target.text_config.num_hidden_layers
    layer_ids = tuple(cfg.target_layer_ids or build_target_layer_ids(n_target, cfg.num_layers))
    if any(not 0 <= i < n_target for i in layer_ids):
        raise GlanceError(f"target_layer_ids {layer_ids} outside the target's {n_target} layers")
    cfg = replace(cfg, target_layer_ids=layer_ids)
    rows = load_rows(cfg)
    train_rows = training_rows(rows, cfg.per_kind)
    out = prepare_out(cfg, target, rank)
    _barrier(world)
    n_parts = len(_parts(train_rows))
    store = open_store(target, cfg)
    kernels = KernelPlan(PACK_ROWS, (PACK_ROWS,), KernelTuner())  # each layer's faster kernel on this CPU
    linear = functools.partial(kernels.linear, rows=PACK_ROWS)  # one module per weight, however often swapped in
    with swapped_linears(target.hf_model, linear):  # stages 1-2 run the HF model; modules put back
        stage_responses(target, train_rows, heldout_rows(rows, cfg.eval_per_kind), cfg, out, rank, world, store)
        if cfg.until == "responses":
            return None, None
        if cfg.features == "cached":
            stage_features(target, cfg, out, layer_ids, rank, world, n_parts)
    if cfg.until == "features":
        return None, None

    def evaluate(drafter, per_kind=cfg.eval_per_kind, quiet=False):
        return evaluate_tau(target, drafter, rows, cfg, per_kind, quiet, lookup=cfg.eval_lookup)

    drafter = stage_train(target, cfg, out, layer_ids, rank, world, n_parts, evaluate, linear)
    result = None
    if rank == 0:
        eval_file = out / "eval.json"
        if eval_file.exists():
            result = json.loads(eval_file.read_text())
        else:
            result = evaluate(drafter)
            result["config"] = {k: v for k, v in asdict(cfg).items() if k != "resume"}
            atomic_write(eval_file, lambda p: p.write_text(json.dumps(result, indent=2)))
    _barrier(world)
    return drafter, result
