"""`glance-rt train`: self-distillation of a drafter for one target (DESIGN.md section 6), a GLANCE block
drafter or (`--head eagle3`) the EAGLE-3 baseline head, from the same data by the same loop.

Stages, each cached under `--out` and skipped when done:
  1. responses  the target's own greedy answers to the prompts        responses/part-*.jsonl
  2. features   one target forward per sequence, chosen layers' states  features/part-*.safetensors
                (`--features online`: no cache; the target computes them inside each training step)
  3. training   the head's loss (GLANCE: anchored blocks; EAGLE-3:      checkpoints/step-*/, drafter/
                training-time test); held-out loss and chain tau at      history.json, history.png
                every checkpoint, the best kept
  4. eval       mean accepted length tau per kind on held-out prompts    eval.json
The held-out prompts (the first `eval_per_kind` of each kind) get responses and features too
(responses/heldout.jsonl, features/heldout.safetensors): validation reads them at each checkpoint, and
the drafter written at the end is the checkpoint with the lowest held-out loss, so memorisation shows
in history.json and stops at its best point.
Every file is written to a temp name then renamed, so a killed run (even kill -9) leaves only
complete parts; `--resume` continues from them. Data parallel: run under
`torchrun --nproc_per_node N -m glance_rt.cli train ...` (gloo on CPU): prompts and batches are split
across ranks, gradients all-reduced, rank 0 writes checkpoints.

Modules: `config` (TrainConfig), `data` (stages 1-2 and the sequences), `glance` and `eagle3` (each
head's loss: an `Objective`), `loop` (stage 3: steps, checkpoints, history, validation; stage 4);
`glance_rt.tools.train.train` runs the whole job.
"""
