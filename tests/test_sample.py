"""Sampling parameters and draws (glance_rt/round/sample.py): processed scores equal Hugging Face's own
processor list; keyed Gumbel-max draws follow the processed distribution; bad values are refused."""

import math

import numpy as np
import pytest
import torch

from glance_rt.errors import GlanceError
from glance_rt.round.sample import Chooser, Sampling, draw_key, gumbel
from tests.conftest import tiny_target

SETTINGS = [
    dict(do_sample=True),
    dict(do_sample=True, temperature=0.7),
    dict(do_sample=True, temperature=1.3, top_k=5),
    dict(do_sample=True, top_k=0, top_p=0.8),
    dict(do_sample=True, top_k=None, min_p=0.1, temperature=0.5),
    dict(do_sample=True, repetition_penalty=1.3, top_p=0.9, top_k=20),
    dict(do_sample=False, repetition_penalty=1.2),
]


@pytest.mark.parametrize("kw", SETTINGS, ids=str)
def test_processed_scores_equal_hf_generate_processors(kw):
    """On random logits and histories, our scores equal the processor list HF's `generate` builds
    from the same GenerationConfig (same classes, same order, same defaults)."""
    from transformers import GenerationConfig

    _, model, _ = tiny_target("llama")
    cfg = GenerationConfig(**kw)
    for k, v in GenerationConfig._get_default_generation_params().items():
        if getattr(cfg, k, None) is None:
            setattr(cfg, k, v)
    hf = model._get_logits_processor(generation_config=cfg, input_ids_seq_length=10, device="cpu")
    mine = Chooser(Sampling(**kw))
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(model.config.vocab_size, generator=gen) * 4
        ids = torch.randint(0, model.config.vocab_size, (12,), generator=gen)
        want = hf(ids[None], logits[None].clone())[0]
        torch.testing.assert_close(mine.scores(logits, ids), want)


def test_draws_follow_the_processed_distribution():
    """Keyed Gumbel-max over 4000 positions: counts against the exact probabilities (chi-square; the
    seed is fixed, so the outcome is deterministic; a correct sampler fails this with probability
    1e-4 over seeds)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    sampler = Chooser(Sampling(do_sample=True, temperature=0.8, top_k=0, seed=1234))
    n = 4000
    counts = np.bincount([sampler.choose(logits, torch.zeros(1, dtype=torch.long), i) for i in range(n)],
                         minlength=6)
    p = torch.softmax(logits / 0.8, 0).double().numpy()
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 25.7  # chi-square, 5 degrees of freedom, upper 1e-4 quantile


def test_draws_are_keyed_by_seed_and_position_only():
    a = gumbel(7, 100, 50, "cpu")
    assert torch.equal(a, gumbel(7, 100, 50, "cpu"))
    assert not torch.equal(a, gumbel(7, 101, 50, "cpu")) and not torch.equal(a, gumbel(8, 100, 50, "cpu"))
    assert len({draw_key(s, p) for s in range(20) for p in range(200)}) == 4000


def test_filtered_tokens_are_never_drawn():
    logits = torch.tensor([5.0, 4.9, 0.0, -1.0, -2.0])
    sampler = Chooser(Sampling(do_sample=True, top_k=2, seed=3))
    assert {sampler.choose(logits, torch.zeros(1, dtype=torch.long), i) for i in range(300)} == {0, 1}


def test_greedy_default_is_argmax():
    assert Sampling().greedy_only and not Sampling(repetition_penalty=1.1).greedy_only
    logits = torch.randn(100)
    assert Chooser(Sampling()).choose(logits, torch.zeros(1, dtype=torch.long), 5) == int(logits.argmax())


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be > 0"),
    (dict(temperature=math.nan), "temperature must be > 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be a non-negative integer"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(seed=-3), "seed must be a non-negative integer"),
    (dict(stop="###"), "stop must be a tuple"),
    (dict(stop=("",)), "stop must be a tuple"),
])
def test_bad_values_are_refused(kw, match):
    with pytest.raises(GlanceError, match=match):
        Sampling(**kw)
