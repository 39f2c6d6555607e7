"""The draft gate (`glance_rt.round.gate`): its choices from injected rounds (deterministic), and
decoding that mixes drafted rounds with autoregressive steps stays lossless (greedy == HF, sampling ==
the same engine's autoregressive sampling), eager and compiled, with trees, lookup and chains."""

import pytest
import torch

import glance_rt
from glance_rt.errors import GlanceError
from glance_rt.method import DEFAULT_LOOKUP, Method
from glance_rt.round.gate import DraftGate, GateConfig
from tests.conftest import OracleDrafter, hf_greedy, tiny_target
from tests.test_sample import HOT
from tests.tiny_models import VLM_ARCHS, make_inputs

NEW = 40
# skips every draft it may: after 2 drafted rounds and 1 measured step, only exploring rounds (each 2nd, 3rd,
# then 4th step) and rounds whose pending context is full draft; the choices do not depend on timings
SKIPPY = GateConfig(min_drafted=2, min_steps=1, explore=2, max_explore=4, margin=1e9)


def feed(gate: DraftGate, rounds):
    """Record rounds (drafted?, entropy, ngram, tokens, seconds); return the gate's choices before each."""
    choices = []
    for drafted, h, n, tokens, seconds in rounds:
        choices.append(gate.draft(h, n))
        gate.record(drafted, h, n, tokens, seconds)
    return choices


def test_gate_learns_then_skips_where_drafting_loses():
    gate = DraftGate(GateConfig(min_drafted=4, min_steps=2, explore=3, max_explore=6, margin=1.0))
    assert gate.predict(0.5, 0) is None and gate.cost_ratio() is None
    # drafted rounds: 5 tokens at entropy 0 after a 3-gram match, 1 token at entropy 4 with no match
    drafted = [(True, 0.0, 3, 5, 0.2), (True, 4.0, 0, 1, 0.2)] * 4
    assert feed(gate, drafted) == [True] * 4 + [False] * 4  # learning the model, then wanting a step timed
    assert gate.predict(0.0, 3) == pytest.approx(5.0) and gate.predict(4.0, 0) == pytest.approx(1.0)
    assert feed(gate, [(False, 4.0, 0, 1, 0.1)] * 2) == [False, False]  # measuring steps: a round costs 2 steps
    assert gate.cost_ratio() == pytest.approx(2.0)
    assert gate.draft(0.0, 3) and not gate.draft(4.0, 0)
    assert gate.draft(4.0, 0, must=True) and gate.exploring  # a forced draft counts as exploring
    # a run of steps, then an exploring round; one that does not pay doubles the run, one that pays resets it
    gate.start()
    assert feed(gate, [(False, 4.0, 0, 1, 0.1)] * 3) == [False] * 3
    assert gate.draft(4.0, 0) and gate.exploring
    gate.record(True, 4.0, 0, 1, 0.2)
    assert gate.run == 6
    assert feed(gate, [(False, 4.0, 0, 1, 0.1)] * 6) == [False] * 6 and gate.draft(4.0, 0)
    gate.record(True, 4.0, 0, 4, 0.2)
    assert gate.run == 3 and gate.skipped == 0


def test_request_residuals_correct_the_shared_model():
    """A request whose rounds commit less than the shared model predicts stops drafting sooner than
    the shared model alone would (shrink so large that residuals never count)."""
    choices = {}
    for shrink in (2.0, 1e9):
        gate = DraftGate(GateConfig(min_drafted=4, min_steps=1, margin=1.0, shrink=shrink))
        for _ in range(3):  # requests the features explain: 5 tokens after a 3-gram match, 2 without
            gate.start()
            feed(gate, [(True, 1.0, 3, 5, 0.25), (True, 1.0, 0, 2, 0.25)] * 3)
        feed(gate, [(False, 1.0, 0, 1, 0.1)])
        assert gate.cost_ratio() == pytest.approx(2.5) and gate.predict(1.0, 3) == pytest.approx(5.0)
        gate.start()  # a request whose 3-gram rounds commit 1 token each
        choices[shrink] = feed(gate, [(True, 1.0, 3, 1, 0.25)] * 6)
        gate.start()  # the next request starts from the shared model again
        assert gate.residual == (0.0, 0) and gate.draft(1.0, 3)
    assert choices[2.0] == [True] * 2 + [False] * 4
    assert choices[1e9] == [True] * 4 + [False] * 2


def test_gate_config_is_checked():
    for bad in ({"window": 1}, {"min_drafted": 0}, {"explore": 5, "max_explore": 4}, {"margin": 0.0},
                {"shrink": 0.0}):
        with pytest.raises(GlanceError, match="need"):
            GateConfig(**bad)


def test_method_names_say_always_draft():
    m = Method.parse("tree-8+lookup+always@compile")
    assert (m.kind, m.tree_budget, m.lookup, m.backend, m.gate) == ("tree", 8, DEFAULT_LOOKUP, "compile", False)
    assert m.name == "tree-8+lookup+always@compile" and Method.parse("chain+always").name == "chain+always"
    assert Method.parse("tree-8").gate and Method.parse("ar").name == "ar"
    target, _, _ = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, block_size=4)
    assert glance_rt.Decoder(target, drafter, gate=False).method_name == "tree-8+lookup+always"
    assert glance_rt.Decoder(target, drafter).method_name == "tree-8+lookup"
    assert glance_rt.Decoder(target, drafter).budgets == [0, 8]  # the steps' one-row verify shape


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_5_vl", "smolvlm"])
@pytest.mark.parametrize("kw", [{"tree_budget": 8}, {"tree_budget": 12, "lookup": 3}, {"chain": True}],
                         ids=["tree", "lookup", "chain"])
def test_mixed_rounds_are_lossless(arch, kw):
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    ref = hf_greedy(model, inputs, NEW)
    p = inputs["input_ids"].shape[1]
    for drafter in (glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2),
                    OracleDrafter(p, ref, target.vocab_size, 5, corrupt=0.3, seed=1)):
        res = glance_rt.Decoder(target, drafter, gate=SKIPPY, **kw).generate(max_new_tokens=NEW, **inputs)
        assert res.token_ids == ref
        s = res.stats
        assert 0 < s.draft_passes < s.rounds and s.draft_passes + s.lookup_rounds == sum(b > 0 for b in s.budgets)
        assert sum(s.accepted_lengths) + 1 == len(ref)


def test_mixed_rounds_sampling_equals_autoregressive_sampling():
    target, _, processor = tiny_target("qwen3")
    inputs = make_inputs("qwen3", processor)
    # the tiny models' logits spread ~100: a temperature this high makes the draws really random
    sampling = glance_rt.Sampling(do_sample=True, temperature=HOT, top_k=20, seed=5)
    ar = glance_rt.Decoder(target, None)
    ref = ar.generate(max_new_tokens=NEW, sampling=sampling, **inputs).token_ids
    assert ref != ar.generate(max_new_tokens=NEW, **inputs).token_ids  # not the greedy tokens
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    res = glance_rt.Decoder(target, drafter, tree_budget=6, gate=SKIPPY).generate(
        max_new_tokens=NEW, sampling=sampling, **inputs)
    assert res.token_ids == ref and 0 < res.stats.draft_passes < res.stats.rounds


def test_compiled_mixed_rounds_are_lossless_and_never_recompile():
    """warmup() compiles the one-row verify graph with the tree's: steps and drafted rounds then
    alternate without compiling anything."""
    from tests.test_passes import unique_graphs

    torch._dynamo.reset()
    target, model, processor = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=3)
    dec = glance_rt.Decoder(target, drafter, tree_budget=8, max_length=256, backend="compile", chunk=8, gate=SKIPPY)
    before = unique_graphs()
    dec.warmup()
    warm = unique_graphs()
    assert warm - before == 4  # verify at 1 and 9 rows, draft, context
    for prompt, new in (("Hi", NEW), ("Name three colours, one by one.", 30)):
        inputs = make_inputs("llama", processor, prompt=prompt)
        res = dec.generate(max_new_tokens=new, **inputs)
        assert res.token_ids == hf_greedy(model, inputs, new) and 0 < res.stats.draft_passes < res.stats.rounds
    assert unique_graphs() == warm
