"""Drafter checkpoints: DFlash-style folders, round trips, atomic saves, corrupt files."""

import json

import pytest
import torch

import glance_rt
from glance_rt import GlanceError
from glance_rt.models.drafter import build_target_layer_ids, read_drafter
from tests.conftest import tiny_target, vocab_drafter
from tests.tiny_models import make_inputs


def test_round_trip_same_drafts(tmp_path):
    target, _, tok = tiny_target("qwen3")
    drafter = glance_rt.init_drafter(target, num_layers=2, block_size=6, seed=4)
    drafter.save(tmp_path / "d")
    again = glance_rt.load_drafter(tmp_path / "d", target)
    assert again.config == drafter.config
    for (k, a), (_, b) in zip(drafter.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    inputs = make_inputs("qwen3", tok)
    r1 = glance_rt.Decoder(target, drafter, tree_budget=8, gate=False).generate(max_new_tokens=12, **inputs)
    r2 = glance_rt.Decoder(target, again, tree_budget=8, gate=False).generate(max_new_tokens=12, **inputs)
    assert r1.token_ids == r2.token_ids and r1.stats.accepted_lengths == r2.stats.accepted_lengths


def test_folder_is_dflash_format(tmp_path):
    target, _, _ = tiny_target("llama")
    glance_rt.init_drafter(target, num_layers=2, block_size=5).save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 5 and cfg["num_target_layers"] == target.text_config.num_hidden_layers
    assert cfg["dflash_config"]["target_layer_ids"] == list(build_target_layer_ids(cfg["num_target_layers"], 2))
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "d" / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.1.mlp.gate_proj.weight"} <= keys
    assert "mask_embedding" not in keys and "draft_vocab" not in keys  # glance-only extensions are opt-in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temp folders left behind


def test_loads_a_dflash_config_with_mask_token(tmp_path):
    """A published-DFlash-style folder (mask_token_id, no glance keys) loads and decodes."""
    target, model, tok = tiny_target("llama")
    d = glance_rt.init_drafter(target, block_size=4, learned_mask=False, mask_token_id=3)
    d.save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    del cfg["glance"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    again = glance_rt.load_drafter(tmp_path / "d", target)
    assert again.config.mask_token_id == 3 and not again.config.learned_mask
    inputs = make_inputs("llama", tok)
    ref = model.generate(**inputs, do_sample=False, max_new_tokens=10)[0, inputs["input_ids"].shape[1]:].tolist()
    assert glance_rt.Decoder(target, again).generate(max_new_tokens=10, **inputs).token_ids == ref


def test_save_over_existing_replaces_it(tmp_path):
    target, _, _ = tiny_target("llama")
    glance_rt.init_drafter(target, block_size=4, seed=0).save(tmp_path / "d")
    glance_rt.init_drafter(target, block_size=6, seed=1).save(tmp_path / "d")
    assert read_drafter(tmp_path / "d").config.block_size == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


@pytest.mark.parametrize("damage", ["no_config", "no_weights", "bad_json", "bad_weights", "wrong_keys", "missing_ids"])
def test_corrupt_or_missing_checkpoint(tmp_path, damage):
    target, _, _ = tiny_target("llama")
    path = tmp_path / "d"
    glance_rt.init_drafter(target, block_size=4).save(path)
    cfg = json.loads((path / "config.json").read_text())
    if damage == "no_config":
        (path / "config.json").unlink()
    elif damage == "no_weights":
        (path / "model.safetensors").unlink()
    elif damage == "bad_json":
        (path / "config.json").write_text("{not json")
    elif damage == "bad_weights":
        (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    elif damage == "wrong_keys":
        cfg["num_hidden_layers"] = 3
        (path / "config.json").write_text(json.dumps(cfg))
    elif damage == "missing_ids":  # neither the ids nor what DFlash's default rule needs
        del cfg["dflash_config"]["target_layer_ids"], cfg["num_target_layers"]
        (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GlanceError, match="drafter|corrupt|config"):
        glance_rt.load_drafter(path, target)


def test_load_drafter_needs_target(tmp_path):
    with pytest.raises(GlanceError, match="target"):
        glance_rt.load_drafter(tmp_path)


def test_default_drafter_only_for_default_target():
    target, _, _ = tiny_target("llama")
    with pytest.raises(GlanceError, match="no drafter ships"):
        glance_rt.load_drafter(None, target)


def test_draft_vocab_columns_are_the_full_heads_columns(tmp_path):
    """With a draft vocabulary, column j of the draft logits is token vocab[j] of the same drafter's
    full-vocabulary logits, and the tree is the one the full logits give outside-vocab tokens masked."""
    from dataclasses import replace

    from glance_rt.models.drafter import GlanceDrafter
    from glance_rt.round.draft import DraftPass
    from glance_rt.round.tree import build_tree

    target, _, _ = tiny_target("qwen3")
    sub = vocab_drafter(target, 37, num_layers=2, block_size=6)
    full = GlanceDrafter(replace(sub.config, draft_vocab_size=None))
    full.load_state_dict({k: v for k, v in sub.state_dict().items() if k != "draft_vocab"})
    emb, head = target.parts.text_model.embed_tokens, target.parts.lm_head
    feats = torch.randn(9, len(sub.target_layer_ids) * sub.config.hidden_size)
    with torch.no_grad():
        a = DraftPass(sub, emb, head, 64)(feats, 0, 11, 9)  # [B-1, Vd]
        b = DraftPass(full, emb, head, 64)(feats, 0, 11, 9)  # [B-1, V]
    vocab = sub.draft_vocab
    assert a.shape == (5, 37)
    torch.testing.assert_close(a, b[:, vocab], rtol=1e-5, atol=1e-5)
    masked = torch.full_like(b, float("-inf"))
    masked[:, vocab] = b[:, vocab]
    for budget in (1, 8, 30):
        t1 = build_tree(a, 11, budget, vocab=vocab.numpy())
        t2 = build_tree(masked, 11, budget)
        assert (t1.tokens == t2.tokens).all() and (t1.parent == t2.parent).all()
        assert set(t1.tokens[1:].tolist()) <= set(vocab.tolist())
    # the buffer survives a save (int64, not cast to the weights' dtype) and the config records it
    sub.save(tmp_path / "d")
    again = glance_rt.load_drafter(tmp_path / "d", target)
    assert again.config.draft_vocab_size == 37 and torch.equal(again.draft_vocab, vocab)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["glance"]["draft_vocab_size"] == 37


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_draft_vocab_drafter_is_lossless(arch):
    from tests.conftest import hf_greedy

    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor)
    ref = hf_greedy(model, inputs, 20)
    d = vocab_drafter(target, 25, block_size=5)
    for kw in ({"tree_budget": 12}, {"chain": True}):
        assert glance_rt.Decoder(target, d, **kw).generate(max_new_tokens=20, **inputs).token_ids == ref


def test_bad_draft_vocab_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    target, _, _ = tiny_target("llama")
    d = vocab_drafter(target, 10)
    d.save(tmp_path / "d")
    state = load_file(tmp_path / "d" / "model.safetensors")
    state["draft_vocab"] = state["draft_vocab"].flip(0)  # not sorted
    save_file(state, tmp_path / "d" / "model.safetensors")
    with pytest.raises(GlanceError, match="draft_vocab must hold sorted, distinct token ids"):
        glance_rt.load_drafter(tmp_path / "d", target)
    with pytest.raises(GlanceError, match="draft_vocab_size must be in"):
        glance_rt.init_drafter(target, draft_vocab_size=target.vocab_size + 1)


def copy_drafter(target, block_size=5, seed=7, span=False):
    """A random drafter with a copy head that trusts its pointer about half the time."""
    return glance_rt.init_drafter(target, block_size=block_size, seed=seed, copy_head=True, copy_span=span)


@pytest.mark.parametrize(("arch", "span"), [("llama", False), ("qwen2_5_vl", False), ("llama", True)])
def test_copy_head_drafter_is_lossless(arch, span):
    """A copy head's drafts (the pointer mixed in) change acceptance, never the output: trees with and
    without lookup, chains, and two sequences batched, all give HF greedy's tokens."""
    from tests.conftest import hf_greedy

    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor)
    ref = hf_greedy(model, inputs, 20)
    d = copy_drafter(target, span=span)
    for kw in ({"tree_budget": 12, "lookup": 0}, {"tree_budget": 8}, {"chain": True}):
        dec = glance_rt.Decoder(target, d, gate=False, **kw)
        out = dec.generate(max_new_tokens=20, **inputs)
        assert out.token_ids == ref and out.stats.draft_passes > 0, kw
        # the pointer's next token of each prompt row: the token after it (the last one's: the first answer token)
        prompt = inputs["input_ids"][0].tolist()
        assert dec.drafter.copy_next[0, : len(prompt)].tolist() == prompt[1:] + ref[:1]
    batch = glance_rt.Batch(glance_rt.Decoder(target, d, gate=False, lookup=0, max_batch=2))
    assert [r.token_ids for r in batch.run([{**inputs, "max_new_tokens": 20}] * 2)] == [ref, ref]


def test_copy_span_reads_the_span_forward():
    """The span form points once (the first draft row's query) and depth q copies the q-th token after the
    pointed row's next token; a row whose copied token is not yet committed is not visible to that depth.
    The per-row form proposes each row's next token at every depth."""
    target, _, _ = tiny_target("llama")
    d = copy_drafter(target, block_size=6, span=True).float()
    next_ids = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18, 19, 20])  # [m] the token after each context row
    ids, visible = d.copy_targets(next_ids, torch.tensor(8), 5)
    assert ids[:, 3].tolist() == [14, 15, 16, 17, 18] and visible[:, 3].tolist() == [True] * 5
    assert visible[:, 5].tolist() == [True, True, True, False, False]  # rows 5 + q < 8 only
    hidden = torch.randn(5, d.config.hidden_size)  # [Q, H]
    keys = torch.zeros(10, d.config.head_dim)
    keys[3] = 50 * d.copy_q(hidden[0]) / d.copy_q(hidden[0]).norm()  # every depth points at row 3 ...
    with torch.no_grad():
        d.copy_gate.weight.zero_()
        d.copy_gate.bias.fill_(30.0)  # ... and trusts the pointer
        logp = d.copy_mix(hidden, torch.zeros(5, target.vocab_size), keys, ids, visible)
    assert logp.argmax(-1).tolist() == [14, 15, 16, 17, 18]  # the span after row 3, read forward
    rows = copy_drafter(target, block_size=6)
    ids, visible = rows.copy_targets(next_ids, torch.tensor(8), 5)
    assert (ids == next_ids[:, None].T).all() and visible[:, :8].all() and not visible[:, 8:].any()


def test_copy_head_saves_glance_only_and_runs_eager_only(tmp_path):
    from glance_rt.models.drafter import check_dflash

    target, _, _ = tiny_target("llama")
    d = copy_drafter(target, span=True)
    d.save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["glance"]["copy_head"] is True and cfg["glance"]["copy_span"] is True
    assert cfg["architectures"] == ["GlanceDraftModel"]
    loaded = glance_rt.load_drafter(tmp_path / "d", target)
    assert loaded.config.copy_span and torch.equal(loaded.copy_q.weight, d.copy_q.weight)
    with pytest.raises(GlanceError, match="copy head"):
        check_dflash(tmp_path / "d")
    with pytest.raises(GlanceError, match="eager backend only"):
        glance_rt.Decoder(target, loaded, backend="compile")
    with pytest.raises(GlanceError, match="whole vocabulary"):
        glance_rt.init_drafter(target, copy_head=True, draft_vocab_size=10)
    with pytest.raises(GlanceError, match="needs copy_head"):
        glance_rt.init_drafter(target, copy_span=True)


@pytest.mark.parametrize("edit, field", [
    (lambda c: [], "JSON object"), (lambda c: None, "JSON object"),
    (lambda c: {**c, "hidden_size": "64"}, "hidden_size"), (lambda c: {**c, "num_attention_heads": 2.5},
                                                            "num_attention_heads"),
    (lambda c: {**c, "block_size": True}, "block_size"), (lambda c: {**c, "rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    (lambda c: {**c, "dflash_config": [1]}, "dflash_config"),
    (lambda c: {**c, "dflash_config": {**c["dflash_config"], "target_layer_ids": [0, "1"]}}, "target_layer_ids"),
    (lambda c: {**c, "glance": {**c["glance"], "copy_head": "yes"}}, "glance.copy_head"),
])
def test_config_of_the_wrong_type_names_the_field(tmp_path, edit, field):
    """Valid JSON of the wrong shape or types is a GlanceError saying which field to fix, not an
    AttributeError or a transformers validation error."""
    target, _, _ = tiny_target("llama")
    path = tmp_path / "d"
    glance_rt.init_drafter(target, block_size=4).save(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(GlanceError, match=field):
        glance_rt.load_drafter(path, target)
