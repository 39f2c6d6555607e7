"""Lossless: Decoder output == Hugging Face greedy generate, token for token, fp32, on tiny random
models of every supported architecture, for AR, chains and trees, untrained/perfect/adversarial
drafters, with images (several, mid-prompt) where the model takes them."""

import functools

import pytest
import torch

import glance_rt
from glance_rt.round.tree import lookup_rows
from tests.conftest import OracleDrafter, extend_inputs, hf_greedy, tiny_target
from tests.tiny_models import ARCHS, VLM_ARCHS, make_inputs

NEW = 24

# (id, decoder kwargs, drafter: None | (layers, block_size))
CONFIGS = [
    ("ar", {}, None),
    ("chain-b4", {"chain": True}, (1, 4)),
    ("tree-n1-b3", {"tree_budget": 1}, (1, 3)),
    ("tree-n4-b2", {"tree_budget": 4}, (1, 2)),
    ("tree-n16-b8", {"tree_budget": 16}, (2, 8)),
    ("tree-n48-b5", {"tree_budget": 48}, (1, 5)),
]
VARIANTS = {"text": dict(n_images=0), "1img": dict(n_images=1), "2img": dict(n_images=2),
            "mid": dict(n_images=1, image_mid_prompt=True)}


@functools.cache
def case(arch: str, variant: str, new: int = NEW):
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, **VARIANTS[variant])
    return target, inputs, hf_greedy(model, inputs, new)


def run(target, inputs, drafter, new=NEW, **kw):
    """These tests' configuration: budget 32, the drafter's tree alone and every round drafting (no
    draft gate: its choices follow timings; tests/test_gate.py mixes both kinds of round) unless a
    test says otherwise."""
    kw = {"tree_budget": 32, "lookup": 0, "gate": False, **kw}
    return glance_rt.Decoder(target, drafter, **kw).generate(max_new_tokens=new, **inputs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg_id,kw,spec", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_untrained_drafter_is_lossless(arch, cfg_id, kw, spec):
    target, inputs, ref = case(arch, "1img" if arch in VLM_ARCHS else "text")
    drafter = None if spec is None else glance_rt.init_drafter(target, num_layers=spec[0], block_size=spec[1], seed=1)
    res = run(target, inputs, drafter, **kw)
    assert res.token_ids == ref
    assert sum(res.stats.accepted_lengths) + 1 == len(ref)  # +1: the prefill's token
    if drafter is not None:
        assert res.stats.draft_passes == res.stats.rounds


@pytest.mark.parametrize("arch", VLM_ARCHS)
@pytest.mark.parametrize("variant", ["2img", "mid", "text"])
def test_images_lossless(arch, variant):
    target, inputs, ref = case(arch, variant)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    assert run(target, inputs, drafter, tree_budget=12).token_ids == ref
    assert run(target, inputs, None).token_ids == ref


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block", [2, 5, 8])
def test_perfect_drafter_accepts_everything(arch, block):
    target, inputs, ref = case(arch, "1img" if arch in VLM_ARCHS else "text")
    p = inputs["input_ids"].shape[1]
    oracle = OracleDrafter(p, ref, target.vocab_size, block)
    for kw in ({"tree_budget": 8}, {"chain": True}):
        res = run(target, inputs, oracle, **kw)
        assert res.token_ids == ref
        lens = res.stats.accepted_lengths
        assert all(n == block for n in lens[:-1]), lens  # every draft accepted + the bonus
        assert lens[-1] <= block


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_5_vl", "smolvlm"])
@pytest.mark.parametrize("corrupt", [0.2, 0.6])
def test_adversarial_drafter_is_lossless(arch, corrupt):
    target, inputs, ref = case(arch, "1img" if arch in VLM_ARCHS else "text")
    p = inputs["input_ids"].shape[1]
    oracle = OracleDrafter(p, ref, target.vocab_size, 6, corrupt=corrupt, seed=3)
    res = run(target, inputs, oracle, tree_budget=10)
    assert res.token_ids == ref
    assert max(res.stats.accepted_lengths) > 1  # some drafts were right, some wrong


@pytest.mark.parametrize("arch", ["qwen2", "llava_onevision"])
def test_max_new_tokens_inside_a_run(arch):
    target, inputs, ref = case(arch, "1img" if arch in VLM_ARCHS else "text")
    p = inputs["input_ids"].shape[1]
    for new in (1, 2, 7, 10):
        res = run(target, inputs, OracleDrafter(p, ref, target.vocab_size, 8), new=new, tree_budget=8)
        assert res.token_ids == ref[:new]


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl", "idefics3"])
def test_eos_inside_an_accepted_run(arch):
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor)
    free = hf_greedy(model, inputs, NEW, eos_token_id=-1)  # (no token stops it)
    k = next(i for i in range(3, len(free)) if free[i] not in free[:i])  # first occurrence at depth k
    eos = free[k]
    ref = hf_greedy(model, inputs, NEW, eos_token_id=eos)
    assert ref == free[: k + 1]
    stopped = glance_rt.Target(**{**target.__dict__, "eos_token_ids": frozenset({eos})})
    p = inputs["input_ids"].shape[1]
    for drafter, kw in ((OracleDrafter(p, free, target.vocab_size, 8), {"tree_budget": 6}), (None, {})):
        res = run(stopped, inputs, drafter, **kw)
        assert res.token_ids == ref
    assert res.text is not None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_one_token_prompt(arch):
    target, model, processor = tiny_target(arch)
    inputs = {"input_ids": torch.tensor([[processor.bos_token_id or 1]]),
              "attention_mask": torch.ones(1, 1, dtype=torch.long)}
    ref = hf_greedy(model, inputs, NEW)
    for drafter, kw in ((None, {}), (glance_rt.init_drafter(target, block_size=4), {"tree_budget": 8}),
                        (OracleDrafter(1, ref, target.vocab_size, 4), {"chain": True})):
        assert run(target, inputs, drafter, **kw).token_ids == ref


def test_stream_pieces_join_to_text():
    target, inputs, ref = case("qwen2", "text")
    dec = glance_rt.Decoder(target, OracleDrafter(inputs["input_ids"].shape[1], ref, target.vocab_size, 4))
    stream = dec.stream(max_new_tokens=NEW, **inputs)
    pieces = list(stream)
    assert stream.result.token_ids == ref
    assert "".join(pieces) == stream.result.text == target.decode(ref)
    assert len(pieces) > 1


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_vl", "qwen2_5_vl", "llava", "smolvlm"])
def test_logits_match_hf_at_prefill_and_verify(arch, monkeypatch):
    """Our decoder's logits == the HF model's, at prefill and at every verified tree row checked."""
    import glance_rt.round.loop as dmod

    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    ref = hf_greedy(model, inputs, NEW)
    calls, trees = [], []
    dec = glance_rt.Decoder(target, glance_rt.init_drafter(target, block_size=4, seed=5), tree_budget=6)
    verify = dec.verifier.forward

    def spy(*a, **k):
        out = verify(*a, **k)
        calls.append((a[2], out[0].clone()))
        return out

    real_build = dmod.build_tree
    monkeypatch.setattr(dec.verifier, "forward", spy)
    monkeypatch.setattr(dmod, "build_tree", lambda *a, **k: trees.append(real_build(*a, **k)) or trees[-1])
    res = dec.generate(max_new_tokens=NEW, **inputs)
    assert res.token_ids == ref
    p = inputs["input_ids"].shape[1]

    def hf_last_logits(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(**extend_inputs(inputs, seq)).logits[0, -1]

    torch.testing.assert_close(calls[0][1][-1], hf_last_logits([]), rtol=1e-5, atol=1e-3)
    assert len(calls) == len(trees) + 1 > 3
    for (start, logits), tree in zip(calls[1:], trees, strict=True):  # every verify pass
        committed = ref[: start + 1 - p]
        for row in sorted({0, min(1, tree.size - 1), tree.size - 1}):  # (a gate step: the root alone)
            path, i = [], row
            while i > 0:
                path.append(int(tree.tokens[i]))
                i = int(tree.parent[i])
            torch.testing.assert_close(logits[row], hf_last_logits(committed + path[::-1]), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_vl", "llava"])
def test_accepted_paths_off_rank0_are_compacted(arch):
    """Decoys outrank the right token at every depth, so accepted rows are scattered in the tree
    and their KV must be moved to the committed rows."""
    target, inputs, ref = case(arch, "1img" if arch in VLM_ARCHS else "text")
    p = inputs["input_ids"].shape[1]
    res = run(target, inputs, OracleDrafter(p, ref, target.vocab_size, 4, decoy=True), tree_budget=24)
    assert res.token_ids == ref
    assert max(res.stats.accepted_lengths) == 4


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_drafter_context_is_the_targets_features(arch):
    """The drafter's context cache holds exactly the projections of the target's hidden states of
    the committed rows (what training sees), whatever path each round accepted."""
    from glance_rt.models.drafter import rope_tables
    from glance_rt.models.target import apply_rope
    from glance_rt.round.draft import DraftPass

    target, inputs, ref = case(arch, "1img" if arch in VLM_ARCHS else "text")
    _, model, _ = tiny_target(arch)
    p = inputs["input_ids"].shape[1]
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=7)
    oracle = OracleDrafter(p, ref, target.vocab_size, 4, decoy=True)
    dp = DraftPass(drafter, target.parts.text_model.embed_tokens, target.parts.lm_head, 256)
    seen = []

    class Both:
        block_size, target_layer_ids = 4, drafter.target_layer_ids

        def __call__(self, feats, ctx_start, bonus, block_start):
            dp(feats, ctx_start, bonus, block_start)
            seen.append(block_start)
            return oracle(feats, ctx_start, bonus, block_start)

    res = run(target, inputs, Both(), tree_budget=24, max_length=256)
    assert res.token_ids == ref
    rows = seen[-1]  # context rows [0, rows) were projected by the last draft pass
    with torch.no_grad():
        hs = model(**extend_inputs(inputs, ref), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1][0, :rows] for i in drafter.target_layer_ids], -1)
        a = drafter.layers[0].self_attn
        c = drafter.config
        ctx = drafter.hidden_norm(drafter.fc(feats))
        k = a.k_norm(a.k_proj(ctx).view(1, rows, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        cos, sin = rope_tables(dp.inv_freq, torch.arange(rows), k.dtype)
        want = apply_rope(k, cos, sin)[0]
    torch.testing.assert_close(dp.cache.k0[0, :, :rows], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_5_vl"])
def test_bfloat16_runs_end_to_end(arch):
    """bf16 runs through the same passes (exactness in bf16 is audited, not asserted: near-ties can flip)."""
    from tests.tiny_models import make_tiny

    model, processor = make_tiny(arch)
    target = glance_rt.load_target(model, processor=processor, dtype="bfloat16")
    assert target.dtype == torch.bfloat16
    inputs = make_inputs(arch, processor)
    res = run(target, inputs, glance_rt.init_drafter(target, block_size=4), new=12, tree_budget=8)
    assert len(res.token_ids) == 12 and all(0 <= t < target.vocab_size for t in res.token_ids)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_5_vl", "llava"])
@pytest.mark.parametrize("budget", [2, 12])
def test_prompt_lookup_trees_are_lossless(arch, budget, monkeypatch):
    """Lookup chains grafted into the drafter's trees give the same tokens. Each round's lookup sees
    the prompt ids + every committed token; where the chain is the true continuation (an oracle in
    place of the n-gram match), the verify pass accepts it, deeper than the untrained drafter."""
    import glance_rt.round.loop as dm

    target, inputs, ref = case(arch, "1img" if arch in VLM_ARCHS else "text", 48)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=6, seed=3)
    plain = run(target, inputs, drafter, new=48, tree_budget=budget)
    assert plain.token_ids == ref
    assert run(target, inputs, drafter, new=48, tree_budget=budget, lookup=3).token_ids == ref
    prompt = inputs["input_ids"][0].tolist()
    seen = []

    def oracle(history, max_ngram, length):
        seen.append(history.tolist())
        done = len(history) - len(prompt)
        return max_ngram, ref[done : done + length]

    monkeypatch.setattr(dm, "lookup_match", oracle)
    looked = run(target, inputs, drafter, new=48, tree_budget=budget, lookup=3)
    assert looked.token_ids == ref
    assert all(h == prompt + ref[: len(h) - len(prompt)] for h in seen)
    assert len(seen) == looked.stats.rounds
    full = 1 + lookup_rows(6, budget, 3)  # the whole chain, then the bonus (deeper than the block at budget 12)
    assert all(n >= full for n in looked.stats.accepted_lengths[:-1])  # the last round stops at max_new_tokens
    assert looked.stats.mean_accepted > plain.stats.mean_accepted


def test_prompt_lookup_needs_a_drafter_tree():
    target, _, _ = case("llama", "text")
    drafter = glance_rt.init_drafter(target, block_size=4)
    for kw in ({"chain": True}, {"lookup": -1}):
        with pytest.raises(glance_rt.GlanceError, match="lookup"):
            glance_rt.Decoder(target, drafter if kw.get("chain") else drafter, lookup=kw.pop("lookup", 3), **kw)
    with pytest.raises(glance_rt.GlanceError, match="lookup"):
        glance_rt.Decoder(target, None, lookup=3)
