"""The pass-level kernel check: a pass keeps the kernels chosen layer by layer only at the
row classes where the whole pass runs faster with them than with torch's own linear everywhere.

Each linear layer's kernel is chosen by timing that layer alone (`glance_rt.models.kernels`), and the
sum of those choices can mispredict the pass: measured on the 2-core Intel Xeon (2026-12-02), a
prefill with the per-layer choices (oneDNN won each layer alone at 64-256 rows) took 181 ms against
172 ms with torch's own linear everywhere. So `checked_plans` times each pass at each of its row
classes both ways, on scratch copies of the pass (a short cache of their own, the weights shared):
the plan's module set against the plain modules, interleaved (`KernelTuner.pass_times`, cached per
machine with the layer timings, so it is paid once per machine and model). A class where the plan
is not faster by the tuner's `pass_margin` runs torch's own linear (`KernelPlan.made_plain`).

How a class is timed (`probe`): a decode class of T rows as a causal block of T rows after
`PROBE_CONTEXT` committed rows (the verify pass; the draft pass's context rows then its block); the
class a `PROBE_PROMPT`-row prompt falls in as that prefill (the target's, or the drafter's context
projection of it), with logits for its last row only.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from glance_rt.models.drafter import GlanceDrafter
from glance_rt.models.eagle3 import Eagle3Drafter
from glance_rt.models.kernels import KernelPlan, kernel_of, nearest_class, pass_key
from glance_rt.models.target import TargetDecoder
from glance_rt.round.draft import DraftPass
from glance_rt.round.eagle3 import Eagle3Pass

PROBE_CONTEXT = 128  # committed rows before a timed decode pass
PROBE_PROMPT = 128  # rows of the timed prefill (a typical chat prompt)


def checked_plans(target, drafter, plans: tuple, feature_layers: tuple[int, ...], check_verify: bool = True) -> tuple:
    """(verify plan, draft plan) with the classes where a pass ran no faster than plain made plain.
    Plans without a tuner (oneDNN forced everywhere, or none) are returned as they are, and the verify
    plan when not `check_verify` (exact numerics: the check times fast passes, and two decoders whose
    timings cannot be cached could decide it differently)."""
    verify, draft = plans
    if check_verify and verify is not None and verify.tuner is not None:
        verify = check_pass("verify", verify, lambda plan, n: TargetDecoder(target.parts, n, feature_layers, plan=plan),
                            probe_verify)
    embed = target.parts.text_model.embed_tokens
    if draft is not None and draft.tuner is not None and isinstance(drafter, GlanceDrafter):
        draft = check_pass("draft", draft, lambda plan, n: DraftPass(drafter, embed, target.parts.lm_head, n,
                                                                     plan=plan), probe_draft)
    elif draft is not None and draft.tuner is not None and isinstance(drafter, Eagle3Drafter):
        draft = check_pass("eagle3", draft, lambda plan, n: Eagle3Pass(drafter, embed, n, plan=plan), probe_eagle3)
    return verify, draft


def check_pass(name: str, plan: KernelPlan, build: Callable, probe: Callable) -> KernelPlan:
    """`plan`, made plain at each row class where the pass (`build(plan, cache rows)`) ran no faster
    than its plain twin (`build(None, ...)`), timed by `probe(pass, rows, T, start)`."""
    classes = plan.row_classes()
    rows_needed = PROBE_CONTEXT + max(*classes, PROBE_PROMPT)
    planned, plain = build(plan, rows_needed), build(None, rows_needed)
    slow = []
    for rows, modules in planned.kernel_modules().items():
        if all(kernel_of(m) in (None, "mkl") for top in modules for m in top.modules()):
            continue  # torch's own linear already: nothing to check
        t, start = probe_shape(rows, classes)
        key = pass_key(f"{name}@{rows}:{t}+{start}", modules)
        times = plan.tuner.pass_times(key, {"plan": probe(planned, rows, t, start),
                                            "plain": probe(plain, rows, t, start)})
        if not plan.tuner.keeps_plan(times):
            slow.append(rows)
    return plan.made_plain(slow) if slow else plan


def probe_shape(rows: int, classes: tuple[int, ...]) -> tuple[int, int]:
    """(rows T, start row) a row class is timed at: a `PROBE_PROMPT`-row prefill for the class such a
    prompt runs, else T = the class's rows after `PROBE_CONTEXT` committed ones."""
    return (PROBE_PROMPT, 0) if nearest_class(PROBE_PROMPT, classes) == rows else (rows, PROBE_CONTEXT)


def probe_verify(dec: TargetDecoder, rows: int, t: int, start: int) -> Callable[[], object]:
    """One target pass of `t` causal rows from cache row `start` (a prefill: logits of the last row)."""
    dev = dec.embed_tokens.weight.device
    ids = torch.arange(t, device=dev) % dec.embed_tokens.weight.shape[0]
    embeds = dec.embed_tokens(ids)[None]  # [1, T, H]
    pos = torch.arange(start, start + t, device=dev)[None]  # [1, T]
    pos = pos[None].expand(3, 1, -1) if dec.mrope else pos
    mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril()  # [T, T]
    start_t = torch.tensor(start, device=dev)
    last = torch.tensor([t - 1], device=dev) if start == 0 else None
    return lambda: dec(embeds, pos, start_t, mask, start + t, last)


def probe_draft(dp: DraftPass, rows: int, t: int, start: int) -> Callable[[], object]:
    """The draft pass: at the prefill class, the drafter's context projection of a `t`-row prompt; at
    the block's class, a round's draft (t // 2 context rows, then the block)."""
    w = dp.embed_tokens.weight
    feats = torch.randn(t, w.shape[1] * len(dp.target_layer_ids), generator=torch.Generator().manual_seed(0))
    feats = feats.to(w.device, w.dtype)  # [T, F]
    tokens = torch.ones(t, dtype=torch.long, device=w.device) if dp.copies else None  # a copy head's next tokens
    if start == 0:
        start_t = torch.tensor(0, device=w.device)
        return lambda: dp.context(feats, start_t, ctx_tokens=tokens)
    ctx: Tensor = feats[: max(t // 2, 1)]  # [m, F]
    m = ctx.shape[0]
    return lambda: dp(ctx, start, 1, start + m, ctx_tokens=None if tokens is None else tokens[:m])


def probe_eagle3(p: Eagle3Pass, rows: int, t: int, start: int) -> Callable[[], object]:
    """The EAGLE-3 draft pass: at the prefill class, the context pass over a `t`-row prompt; at a depth's
    class, one depth pass of `t` rows after `start` committed ones, each seeing them and itself."""
    w = p.head.norm.weight
    feats = torch.randn(t, p.head.fc.in_features, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    tokens = torch.arange(t, device=w.device) % p.embed_tokens.weight.shape[0]
    if start == 0:
        return lambda: p.context(feats, tokens, 0)
    states = feats[:, : w.shape[0]].contiguous()  # [T, H]
    rows_t = start + torch.arange(t, device=w.device)
    visible = torch.zeros(t, start + t, dtype=torch.bool, device=w.device)
    visible[:, :start] = True
    visible[:, start:] = torch.eye(t, dtype=torch.bool, device=w.device)
    position = torch.full((t,), start, device=w.device)
    return lambda: p.rows(tokens, states, position, rows_t, visible)
