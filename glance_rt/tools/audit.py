"""`glance-rt audit`: is every output exactly the target's output?

Greedy (the default): per prompt, glance-rt's tokens vs Hugging Face `generate(do_sample=False)` in
the same dtype (with the same repetition penalty and stop strings). An exact match, or the first
divergence with the target's top-1/top-2 logit margin there (computed by the HF model on the
reference prefix). A divergence at a clear margin is a bug; in bf16/fp16 a divergence at a near-tie
is the known effect of batched vs one-token kernels.

Sampling: vs the same engine's autoregressive sampling with the same seed (HF samples with its own
RNG, so its tokens are not comparable); any divergence fails (no margin is reported).

Exact numerics (`--exact`): vs the same engine's autoregression in exact numerics, greedy or
sampled, in any dtype: the tokens must be identical, near ties included.
"""

from dataclasses import asdict, dataclass

import torch

from glance_rt.hf.arch import extend_inputs
from glance_rt.round.sample import GREEDY, Sampling


@dataclass(frozen=True)
class AuditRow:
    id: str
    kind: str
    exact: bool
    tokens: int  # glance-rt tokens
    reference_tokens: int
    divergence: int | None = None  # index of the first differing new token
    margin: float | None = None  # target's top-1 minus top-2 logit at that position
    expected: int | None = None  # HF's token there
    got: int | None = None  # glance-rt's token there


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def margin_at(target, inputs: dict, prefix: list[int]) -> float:
    """Top-1 minus top-2 logit of the HF model after prompt + prefix."""
    with torch.inference_mode():
        logits = target.hf_model(**extend_inputs(inputs, prefix)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def reference_tokens(target, inputs: dict, max_new_tokens: int, sampling: Sampling, ar=None) -> list[int]:
    """`ar`'s tokens (the same engine's autoregression: sampled with the same seed, or in exact
    numerics), else HF greedy (with the same penalty and stops)."""
    if ar is not None:
        return ar.generate(max_new_tokens=max_new_tokens, sampling=sampling, **inputs).token_ids
    from glance_rt.tools.bench import hf_sampling_kwargs

    with torch.inference_mode():
        gen = target.hf_model.generate(**inputs, max_new_tokens=max_new_tokens,
                                       eos_token_id=sorted(target.eos_token_ids) or None,
                                       **hf_sampling_kwargs(sampling, target))
    return gen[0, inputs["input_ids"].shape[1]:].tolist()


def audit_prompt(target, decoder, row: dict, inputs: dict, max_new_tokens: int, sampling: Sampling = GREEDY,
                 ar=None) -> AuditRow:
    ref = reference_tokens(target, inputs, max_new_tokens, sampling, ar)
    ours = decoder.generate(max_new_tokens=max_new_tokens, sampling=sampling, **inputs).token_ids
    i = first_divergence(ours, ref)
    base = dict(id=str(row.get("id", "")), kind=str(row.get("kind", "")), tokens=len(ours),
                reference_tokens=len(ref))
    if i is None:
        return AuditRow(exact=True, **base)
    margin = None if ar is not None else margin_at(target, inputs, ref[:i])
    return AuditRow(exact=False, divergence=i, margin=margin, expected=ref[i] if i < len(ref) else None,
                    got=ours[i] if i < len(ours) else None, **base)


def audit(target, decoder, rows: list[dict], encoded: list[dict], max_new_tokens: int, progress: bool = True,
          sampling: Sampling = GREEDY):
    """Audit every row (`encoded`: its processor inputs, `glance_rt.tools.suites.encode_rows`); yields
    AuditRow as it goes (so an interrupted audit keeps what it has). Sampling, and exact numerics:
    against the same engine without a drafter (same backend, caches, shapes and numerics)."""
    from tqdm.auto import tqdm

    from glance_rt.round.loop import Decoder

    ar = None
    if sampling.do_sample or decoder.numerics == "exact":
        ar = decoder if decoder.drafter is None else Decoder(target, None, max_length=decoder.max_length,
                                                              backend=decoder.backend, lookup=0,
                                                              numerics=decoder.numerics)
    for row, inputs in tqdm(list(zip(rows, encoded, strict=True)), desc="audit", disable=not progress,
                            dynamic_ncols=True):
        yield audit_prompt(target, decoder, row, inputs, max_new_tokens, sampling, ar)


def reference_name(decoder, sampling: Sampling) -> str:
    """What `audit` checks `decoder`'s outputs against."""
    if decoder.numerics == "exact":
        return "the same engine's autoregression in exact numerics" + (" (same seed)" if sampling.do_sample else "")
    return "the same engine's autoregressive sampling (same seed)" if sampling.do_sample else "HF greedy"


def failures(results: list[AuditRow], threshold: float | None) -> list[AuditRow]:
    """Divergences that count as failures: any (threshold None, the fp32 gate), else those whose
    margin exceeds the threshold."""
    bad = [r for r in results if not r.exact]
    return bad if threshold is None else [r for r in bad if r.margin is None or r.margin > threshold]


def to_json(results: list[AuditRow], meta: dict) -> dict:
    return {"schema": "glance-rt/audit/1", **meta, "exact": sum(r.exact for r in results),
            "total": len(results), "rows": [asdict(r) for r in results]}
