"""`glance-rt train`'s stage 3 (the loop: steps, checkpoints, held-out validation, history) and stage 4
(held-out tau with the real decoder). The loop is the same for both heads: an objective (`GlanceObjective`,
`Eagle3Objective`) gives the trained module, its loss over a step's picks, and how it is written, read
and drafted with."""

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from glance_rt.errors import GlanceError
from glance_rt.files import atomic_remove, atomic_write, open_images
from glance_rt.models.linear import swapped_linears
from glance_rt.round.loop import Decoder
from glance_rt.tools.training.config import TrainConfig
from glance_rt.tools.training.data import (
    Sequence,
    barrier,
    choose_draft_vocab,
    heldout_rows,
    load_sequences,
    progress,
    with_features,
)


def objective_class(head: str):
    """The objective of `TrainConfig.head`."""
    if head == "glance":
        from glance_rt.tools.training.glance import GlanceObjective

        return GlanceObjective
    if head == "eagle3":
        from glance_rt.tools.training.eagle3 import Eagle3Objective

        return Eagle3Objective
    raise GlanceError(f"head must be 'glance' or 'eagle3', got {head!r}")


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


def save_checkpoint(objective, opt, step: int, out: Path) -> None:
    """Write `checkpoints/step-N/` (the head's folder + optimizer state) via a temp folder and a
    rename; on failure (disk full) the previous checkpoints stay intact and nothing partial remains."""
    final = out / "checkpoints" / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".ckpt.", dir=out))
    try:
        objective.save(objective.model, tmp / "d", torch.float32)
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
    """Delete all checkpoints but the last `keep` and the best one, each renamed aside first
    (`atomic_remove`): a kill mid-delete leaves a hidden `.step-N.old`, cleared here next time, never a
    half-deleted checkpoint that `--resume` would read as complete."""
    folder = out / "checkpoints"
    for p in folder.glob(".step-*.old"):  # a killed prune's leftovers: hidden, so deleted in place
        shutil.rmtree(p, ignore_errors=True)
    for p in sorted(folder.glob("step-*"))[:-keep]:
        if int(p.name.split("-")[1]) != best:
            atomic_remove(p)


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


def plot_history(out: Path, history: list[dict], head: str = "glance") -> Path | None:
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
        if any("heldout_tau" in e for e in history):  # --eval-every's decoding tau
            at = [e for e in history if "heldout_tau" in e]
            tau.plot([e["step"] for e in at], [e["heldout_tau"] for e in at], "mo-", label="held-out tau")
            tau.plot([e["step"] for e in at], [e["heldout_tau_alone"] for e in at], "co-", label="... drafter alone")
        tau.set_ylabel("held-out tau (chain: per block; decoding: per round)")
        tau.legend(loc="upper center")
    best = best_step(history)
    ax.axvline(best, color="grey", linestyle=":", label=f"best (step {best})")
    ax.set_xlabel("step")
    ax.set_ylabel("weighted CE")
    ax.legend(loc="upper right")
    ax.set_title(f"{out.name}: {head} head training")
    fig.tight_layout()
    path = out / "history.png"
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- 3. training: the loop



class Trainer:
    """One training run's objective (head, loss), optimizer and feature source."""

    def __init__(self, target, cfg: TrainConfig, out: Path, layer_ids, n_parts: int, linear):
        self.target, self.cfg, self.out, self.layer_ids, self.linear = target, cfg, out, layer_ids, linear
        self.seqs, self.held = load_sequences(out, cfg, n_parts)
        if not self.seqs:
            raise GlanceError("no training sequences: every response was shorter than 2 tokens or all prompts are "
                              "held out")
        self.held_picks = validation_picks(self.held, cfg)
        vocab = choose_draft_vocab(out, n_parts, cfg.draft_vocab, target.vocab_size)
        head_rows = target.vocab_size if vocab is None else len(vocab)
        hidden = target.text_config.hidden_size
        self.bf16 = use_bf16(target.device, hidden, head_rows) if cfg.bf16 is None else cfg.bf16
        self.objective = objective_class(cfg.head)(target, cfg, layer_ids, vocab, self.bf16, self.seqs)
        self.model = self.objective.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     betas=(0.9, 0.95))

    def autocast(self):
        return torch.autocast(str(self.target.device.type), dtype=torch.bfloat16, enabled=self.bf16)

    def resume(self) -> int:
        """Load the last checkpoint, if any -> the step it ends."""
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            return 0
        self.model.load_state_dict(self.objective.read(ckpt.path, self.target).state_dict())
        self.opt.load_state_dict(torch.load(ckpt.path / "trainer.pt", weights_only=True)["optimizer"])
        return ckpt.step

    def featured(self, seq: Sequence) -> Sequence:
        """`seq` with its features: cached ones, or (online) the target's, computed now by the same
        modules the feature stage runs, so online and cached training are the same computation."""
        if seq.features is not None:
            return seq
        with swapped_linears(self.target.hf_model, self.linear):
            return with_features(self.target, self.cfg, seq, self.layer_ids)

    def loss(self, seqs: list[Sequence], picks: list[tuple[int, Tensor]], training: bool = True):
        """(weighted CE sum, weight sum, chain accepted-length sum, chains) of the picks."""
        with self.autocast():
            return self.objective.loss([(self.featured(seqs[i]), a) for i, a in picks], training)

    def validate(self) -> dict:
        """Held-out loss and chain tau (accepted length of the head's own chain, +1) on the fixed picks."""
        self.held = [self.featured(s) for s in self.held]  # online: the target's features, computed once
        loss_sum, weight_sum, accepted, chains = 0.0, 0.0, 0, 0
        self.model.eval()
        with torch.no_grad():
            for i in range(0, len(self.held_picks), self.cfg.batch_size):
                ls, ws, acc, n = self.loss(self.held, self.held_picks[i : i + self.cfg.batch_size], training=False)
                loss_sum, weight_sum = loss_sum + float(ls), weight_sum + float(ws)
                accepted, chains = accepted + acc, chains + n
        self.model.train()
        return {"heldout_loss": loss_sum / weight_sum, "heldout_tau_chain": accepted / max(chains, 1)}

    def drafter(self):
        """The head as it is now, as `Decoder` drafts with it (a copy)."""
        return self.objective.drafter(self.model, self.target)


def reopen_finished(out: Path, steps: int, rank: int) -> None:
    """A finished run (drafter/ written) resumed with more --steps continues from its last checkpoint:
    its drafter/ and eval.json are removed (both are written again at the new end). Fewer --steps than
    the run has done are refused by name. The learning-rate schedule is a function of --steps, so the
    continued steps follow the cosine of a `steps`-long run from where the last checkpoint stands."""
    last = latest_checkpoint(out)
    if last is None or not (out / "drafter" / "model.safetensors").exists():
        return
    if steps < last.step:
        raise GlanceError(f"{out} has trained {last.step} steps; --steps {steps} is fewer: pass --steps above "
                          f"{last.step} to continue it, or pick another --out for a shorter run")
    if steps > last.step and rank == 0:
        print(f"[train] {out} finished at step {last.step}; continuing it to step {steps} (drafter/ and eval.json "
              "are written again at the end)")
        for name in ("eval.json", "drafter"):
            atomic_remove(out / name)


def curve_point(evaluate, drafter) -> dict:
    """--eval-every's point of the tau-against-steps curve: train's end-of-run eval (the same prompts, so the
    last point is eval.json's), the default method and the drafter alone, per kind."""
    point, default = {}, evaluate(drafter, quiet=True)
    alone = evaluate(drafter, quiet=True, alone=True) if default["lookup"] else default  # no lookup: it is alone
    for key, res in (("heldout_tau", default), ("heldout_tau_alone", alone)):
        point[key] = res["overall"]["tau"]
        point[f"{key}_kinds"] = {k: v["tau"] for k, v in res["kinds"].items()}
    return point


def stage_train(target, cfg: TrainConfig, out: Path, layer_ids, rank: int, world: int, n_parts: int, evaluate,
                linear):
    """Train from the last checkpoint; at each one, score the held-out set and keep the best
    checkpoint; write it as drafter/ (bf16) at the end. -> the head as `Decoder` drafts with it."""
    objective = objective_class(cfg.head)
    reopen_finished(out, cfg.steps, rank)
    barrier(world)
    if (out / "drafter" / "model.safetensors").exists():  # trained already: skip loading the features
        if rank == 0:
            print(f"[train] {out} is trained ({cfg.steps} steps): pass a larger --steps with --resume to continue it")
        return objective.drafter(objective.read(out / "drafter", target), target)
    tr = Trainer(target, cfg, out, layer_ids, n_parts, linear)
    start = tr.resume()
    history = read_history(out, start)
    if rank == 0:
        print(f"[train] {cfg.head} head; {'bf16 autocast' if tr.bf16 else 'fp32'} "
              f"({'measured' if cfg.bf16 is None else 'as asked'}); "
              f"{len(tr.seqs)} training and {len(tr.held)} held-out sequences; features {cfg.features}")
        if start and not any(e["step"] == start for e in history):  # killed between its checkpoint and its entry
            history.append({"step": start, "train_loss": None, **(tr.validate() if tr.held else {})})
    bar = progress(cfg.steps, "train", rank, initial=start)
    losses = []
    for step in range(start, cfg.steps):
        picks = sample_step(tr.seqs, cfg, step)[rank::world]
        for group in tr.opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss_sum, weight_sum, accepted, chains = tr.loss(tr.seqs, picks)
        stats = torch.tensor([float(weight_sum), float(accepted), float(chains)])
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(stats)
        loss = loss_sum / stats[0]
        tr.opt.zero_grad(set_to_none=True)
        loss.backward()
        loss_val = torch.tensor([loss.item()])
        if world > 1:
            for p in tr.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
            dist.all_reduce(loss_val)
        torch.nn.utils.clip_grad_norm_(tr.model.parameters(), cfg.grad_clip)
        tr.opt.step()
        losses.append(loss_val.item())
        bar.set_postfix(loss=f"{loss_val.item():.3f}", tau_chain=f"{stats[1] / max(float(stats[2]), 1.0):.2f}",
                        lr=f"{lr_at(step, cfg):.1e}")
        bar.update(1)
        done = step + 1
        if rank == 0 and (done % cfg.save_every == 0 or done == cfg.steps):
            save_checkpoint(tr.objective, tr.opt, done, out)
            entry = {"step": done, "train_loss": sum(losses) / len(losses), **(tr.validate() if tr.held else {})}
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                entry.update(curve_point(evaluate, tr.drafter()))
            history.append(entry)
            write_history(out, history)
            prune_checkpoints(out, best_step(history))
            bar.write(f"step {done}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()
                                                   if isinstance(v, float)))
            losses = []
        barrier(world)
    bar.close()
    if rank == 0:
        best = best_step(history)
        plot_history(out, history, cfg.head)
        chosen = objective.read(out / "checkpoints" / f"step-{best:06d}", target)
        objective.save(chosen, out / "drafter", torch.bfloat16)
        print(f"[train] drafter/ is the checkpoint of step {best} (lowest held-out loss; history.json)")
    barrier(world)
    return objective.drafter(objective.read(out / "drafter", target), target)


# ----------------------------------------------------------------------------- 4. evaluation


def evaluate_tau(target, drafter, rows: list[dict], cfg: TrainConfig, per_kind: int, quiet: bool = False,
                 lookup: int = 0) -> dict:
    """Mean accepted length (tokens committed per round) on held-out prompts, per kind, with the
    real decoder and the given tree budget (`lookup` > 0: with prompt-lookup chains grafted in).
    `drafter`: what `Decoder` drafts with (`Trainer.drafter`), a GLANCE drafter or an EAGLE-3 head's."""
    held: dict[str, list] = {}
    for r in heldout_rows(rows, per_kind):
        held.setdefault(r["kind"], []).append(r)
    # every round drafts (gate=False): tau measures the drafter, not this machine's draft gate
    dec = Decoder(target, drafter, tree_budget=cfg.eval_budget, max_length=4096, lookup=lookup, gate=False)
    kinds, all_lens, passes = {}, [], 0
    bar = progress(sum(len(v) for v in held.values()), "eval", 0 if not quiet else 1)
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
