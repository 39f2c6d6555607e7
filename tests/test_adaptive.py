"""The adaptive budget: picks the bucket the entropy law predicts is fastest; stays lossless."""

import pytest

import glance_rt
from glance_rt.round.adaptive import AdaptiveBudget, Bucket, calibrate
from tests.conftest import OracleDrafter, hf_greedy, tiny_target
from tests.tiny_models import make_inputs


def test_choice_follows_the_law():
    # wide tree: long accepts at low entropy but costly; small tree: cheap, flat
    policy = AdaptiveBudget((Bucket(64, intercept=6.0, slope=-2.0, seconds_per_round=2.0),
                             Bucket(8, intercept=2.0, slope=-0.2, seconds_per_round=1.0)))
    assert policy.choose(0.0) == 64 and policy.choose(3.0) == 8
    assert policy.max_budget == 64


def test_calibrate_fits_each_bucket():
    samples = {8: [(0.0, 3, 0.1), (1.0, 2, 0.1), (2.0, 1, 0.1)], 32: [(0.0, 5, 0.3), (2.0, 1, 0.3), (1.0, 3, 0.2)]}
    p = calibrate(samples)
    b8, b32 = p.buckets
    assert (b8.budget, b32.budget) == (8, 32)
    assert b8.slope == pytest.approx(-1.0) and b32.slope == pytest.approx(-2.0) and b32.seconds_per_round == 0.3
    with pytest.raises(glance_rt.GlanceError):
        calibrate({8: [(0.0, 1, 0.1)]})


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_adaptive_decoder_is_lossless_and_switches_buckets(arch):
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor)
    ref = hf_greedy(model, inputs, 24)
    oracle = OracleDrafter(inputs["input_ids"].shape[1], ref, target.vocab_size, 5, corrupt=0.3, seed=1)
    res = glance_rt.Decoder(target, oracle, tree_budget=32).generate(max_new_tokens=24, **inputs)
    mid = sorted(res.stats.prior_entropy)[len(res.stats.prior_entropy) // 2]
    # a law whose choice flips at the median observed entropy
    policy = AdaptiveBudget((Bucket(24, intercept=4.0 + 2 * mid, slope=-2.0, seconds_per_round=2.0),
                             Bucket(4, intercept=2.0, slope=0.0, seconds_per_round=1.0)))
    oracle = OracleDrafter(inputs["input_ids"].shape[1], ref, target.vocab_size, 5, corrupt=0.3, seed=1)
    res = glance_rt.Decoder(target, oracle, tree_budget=policy, gate=False).generate(max_new_tokens=24, **inputs)
    assert res.token_ids == ref
    assert set(res.stats.budgets) == {4, 24}
    with pytest.raises(glance_rt.GlanceError, match="chain"):
        glance_rt.Decoder(target, oracle, tree_budget=policy, chain=True)
