"""`glance-rt train`: the whole job, stage by stage (glance_rt/tools/training/ holds the stages: its
__init__ describes them and the run folder)."""

import functools
import json
from dataclasses import asdict, replace

import torch

from glance_rt.errors import GlanceError
from glance_rt.files import atomic_write
from glance_rt.models.drafter import build_target_layer_ids
from glance_rt.models.eagle3 import default_layer_ids
from glance_rt.models.kernels import KernelPlan, KernelTuner
from glance_rt.models.linear import swapped_linears
from glance_rt.tools.training.config import FEATURE_MODES, HEADS, PACK_ROWS, STAGES, TTT_POSITIONS, TrainConfig
from glance_rt.tools.training.data import (
    barrier,
    dist_info,
    heldout_rows,
    load_rows,
    open_store,
    parts_of,
    prepare_out,
    stage_features,
    stage_responses,
    training_rows,
)
from glance_rt.tools.training.loop import evaluate_tau, stage_train

__all__ = ["TrainConfig", "train"]


def check(cfg: TrainConfig) -> None:
    if cfg.head not in HEADS:
        raise GlanceError(f"head must be one of {', '.join(HEADS)}, got {cfg.head!r}")
    if not 2 <= cfg.block_size <= 64:
        raise GlanceError(f"block_size must be in [2, 64], got {cfg.block_size}")
    if cfg.until not in STAGES:
        raise GlanceError(f"until must be one of {', '.join(STAGES)}, got {cfg.until!r}")
    if cfg.features not in FEATURE_MODES:
        raise GlanceError(f"features must be one of {', '.join(FEATURE_MODES)}, got {cfg.features!r}")
    if cfg.ttt_positions not in TTT_POSITIONS:
        raise GlanceError(f"ttt_positions must be one of {', '.join(TTT_POSITIONS)}, got {cfg.ttt_positions!r}")
    if cfg.ttt_steps < 1:
        raise GlanceError(f"ttt_steps must be >= 1, got {cfg.ttt_steps}")
    if cfg.head == "eagle3" and cfg.learned_mask:
        raise GlanceError("learned_mask is a GLANCE drafter's option: an EAGLE-3 head has no mask")
    if cfg.head == "eagle3" and (cfg.distill or cfg.init_layers or cfg.copy_head):
        raise GlanceError("--distill, --init-layers and --copy-head are GLANCE drafter options; drop them for "
                          "--head eagle3")
    if cfg.copy_span and not cfg.copy_head:
        raise GlanceError("copy_span is a form of the copy head: set copy_head too (the CLI's --copy-span does)")
    if cfg.copy_head and cfg.draft_vocab:
        raise GlanceError("--copy-head proposes any context token: it needs the whole vocabulary (drop --draft-vocab)")
    if cfg.distill < 0:
        raise GlanceError(f"distill must be 0 (CE on the greedy token) or K > 0 (top-K distill), got {cfg.distill}")
    if cfg.distill and cfg.draft_vocab:
        raise GlanceError("--distill needs the whole vocabulary: drop --draft-vocab")


def layers_for(cfg: TrainConfig, n_target: int) -> tuple[int, ...]:
    """The target layers the head reads: as given, else the head's own default (DFlash's spread over
    num_layers for GLANCE, EAGLE-3's low, middle and high)."""
    if cfg.target_layer_ids:
        ids = tuple(cfg.target_layer_ids)
    else:
        ids = default_layer_ids(n_target) if cfg.head == "eagle3" else tuple(
            build_target_layer_ids(n_target, cfg.num_layers))
    if cfg.head == "eagle3" and len(ids) != 3:
        raise GlanceError(f"an EAGLE-3 head fuses 3 target layers (low, middle, high), got target_layer_ids {ids}: "
                          "pass three, or none for EAGLE-3's default")
    if any(not 0 <= i < n_target for i in ids):
        raise GlanceError(f"target_layer_ids {ids} outside the target's {n_target} layers")
    return ids


def train(target, cfg: TrainConfig):
    """Run (or resume) every stage up to cfg.until; returns (drafter, eval results), (None, None) when
    it stops before training. The drafter is what `Decoder` takes: a GLANCE drafter, or for
    `head="eagle3"` an `Eagle3Drafter`."""
    check(cfg)
    rank, world = dist_info()
    torch.manual_seed(cfg.seed)
    layer_ids = layers_for(cfg, target.text_config.num_hidden_layers)
    cfg = replace(cfg, target_layer_ids=layer_ids)
    rows = load_rows(cfg)
    train_rows = training_rows(rows, cfg.per_kind)
    out = prepare_out(cfg, target, rank)
    barrier(world)
    n_parts = len(parts_of(train_rows))
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
    lookup = cfg.eval_lookup if cfg.head == "glance" else 0  # EAGLE-3's trees take no lookup chains

    def evaluate(drafter, quiet=False, alone=False):  # alone: no lookup chains (EAGLE-3's default already)
        return evaluate_tau(target, drafter, rows, cfg, cfg.eval_per_kind, quiet, lookup=0 if alone else lookup)

    drafter = stage_train(target, cfg, out, layer_ids, rank, world, n_parts, evaluate, linear)
    result = None
    if rank == 0:
        eval_file = out / "eval.json"
        if eval_file.exists():
            result = json.loads(eval_file.read_text())
        else:
            result = evaluate(drafter)
            if lookup:  # what the drafter proposes by itself, every round drafting, beside the default method
                alone = evaluate(drafter, alone=True)
                result["drafter_alone"] = {"overall": alone["overall"], "kinds": alone["kinds"], "lookup": 0}
            result["config"] = {k: v for k, v in asdict(cfg).items() if k != "resume"}
            atomic_write(eval_file, lambda p: p.write_text(json.dumps(result, indent=2)))
    barrier(world)
    return drafter, result
