"""`glance-rt train --head eagle3`: the EAGLE-3 baseline head trained by the same loop and data as GLANCE
(checkpoints, resume, held-out tracking), written in the published format, drafting losslessly."""

from dataclasses import replace

import pytest
import torch

import glance_rt
from glance_rt import GlanceError
from glance_rt.models.eagle3 import Eagle3Drafter, is_eagle3, load_eagle3, read_eagle3
from glance_rt.tools.train import train
from glance_rt.tools.training.data import choose_draft_vocab
from glance_rt.tools.training.eagle3 import draft_columns, ttt_forward, ttt_loss
from tests.conftest import hf_greedy, tiny_target
from tests.test_eagle3_decode import case, eagle3
from tests.test_train import small_cfg, train_killed_at, weights
from tests.tiny_models import make_inputs


def eagle3_cfg(tmp_path, target, name="e", **kw):
    n = target.text_config.num_hidden_layers
    return small_cfg(tmp_path, name, **{"head": "eagle3", "target_layer_ids": (0, n // 2, n - 1), "ttt_steps": 3, **kw})


def test_eagle3_head_trains_resumes_reproduces_and_drafts_losslessly(tmp_path, monkeypatch):
    target, model, processor = tiny_target("llama")
    cfg = eagle3_cfg(tmp_path, target, "a", draft_vocab=40)
    drafter, result = train(target, cfg)
    out = tmp_path / "a"
    assert isinstance(drafter, Eagle3Drafter) and is_eagle3(out / "drafter")
    head = read_eagle3(out / "drafter")
    vocab = choose_draft_vocab(out, 1, 40, target.vocab_size)  # the 40 most frequent response tokens
    assert torch.equal(head.target_ids(torch.arange(40)), vocab) and int(head.t2d.sum()) == 40
    assert head.target_layer_ids == cfg.target_layer_ids
    history = [e["step"] for e in __import__("json").loads((out / "history.json").read_text())["steps"]]
    assert history == [3, 6] and (out / "eval.json").exists() and result["lookup"] == 0
    assert result["overall"]["draft_passes"] > 0
    init = target.parts.lm_head.weight[vocab].float()  # the lm_head starts at the target's rows and moves
    assert not torch.equal(head.lm_head.weight, init) and (head.lm_head.weight - init).abs().max() < 1

    inputs = make_inputs("llama", processor)
    loaded = load_eagle3(out / "drafter", target)
    for kw in ({"tree_budget": 8}, {"chain": True}):
        got = glance_rt.Decoder(target, loaded, max_length=256, gate=False, **kw).generate(max_new_tokens=16, **inputs)
        assert got.token_ids == hf_greedy(model, inputs, 16)

    train(target, replace(cfg, out=str(tmp_path / "b")))  # same seed: the same head, bit for bit
    wa, wb = weights(out / "drafter"), weights(tmp_path / "b" / "drafter")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    train_killed_at(monkeypatch, target, replace(cfg, out=str(tmp_path / "c")), step=4)
    with pytest.raises(GlanceError, match="different run"):  # a GLANCE run cannot resume an EAGLE-3 one
        train(target, replace(cfg, out=str(tmp_path / "c"), head="glance", target_layer_ids=None, resume=True))
    train(target, replace(cfg, out=str(tmp_path / "c"), resume=True))
    wc = weights(tmp_path / "c" / "drafter")
    assert all(torch.equal(wa[k], wc[k]) for k in wa)


def test_eagle3_head_trains_on_a_vlm_with_online_features(tmp_path):
    from tests.test_train import write_prompts

    target, _, _ = tiny_target("qwen2_5_vl")
    prompts = write_prompts(tmp_path / "p.jsonl", with_images=True)
    cfg = eagle3_cfg(tmp_path, target, prompts=str(prompts), images=str(tmp_path), features="online", steps=3,
                     eval_tokens=8)
    drafter, result = train(target, cfg)
    assert isinstance(drafter, Eagle3Drafter) and result["overall"]["rounds"] > 0


def test_refuses_eagle3_options_it_cannot_honour(tmp_path):
    target, _, _ = tiny_target("llama")
    with pytest.raises(GlanceError, match="3 target layers"):
        train(target, eagle3_cfg(tmp_path, target, "x", target_layer_ids=(0, 1)))
    with pytest.raises(GlanceError, match="learned_mask"):
        train(target, eagle3_cfg(tmp_path, target, "y", learned_mask=True))
    with pytest.raises(GlanceError, match="head must be"):
        train(target, small_cfg(tmp_path, "z", head="medusa"))


@pytest.mark.parametrize("loss_from, chosen", [(1, None), (6, None), (11, None), (30, None), (6, [4, 5, 9, 13])])
def test_ttt_loss_skips_only_rows_no_loss_reads(loss_from, chosen):
    """ttt_loss computes later steps and logits for the rows that reach the response only; its loss,
    weight and chains equal the whole unrolled pass's, masked."""
    target, _, inputs = case("llama")
    drafter = eagle3(target, depth=3, vocab=70, seed=2)
    head, steps, decay = drafter.head, 3, 0.8
    embed = target.parts.text_model.embed_tokens.weight
    ids = inputs["input_ids"][0][:16]
    with torch.no_grad():
        hidden = target.hf_model(input_ids=ids[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i + 1][0] for i in head.target_layer_ids], -1)
        picked = None if chosen is None else torch.tensor(chosen)
        loss, weight, accepted, chains = ttt_loss(head, embed, feats, ids, loss_from, steps, decay, rows=picked)
        keep = torch.ones(ids.shape[0] - 1, dtype=torch.bool) if chosen is None else torch.isin(
            torch.arange(ids.shape[0] - 1), picked)
        column, rows = draft_columns(head), ids.shape[0] - 1
        want_loss, want_weight, hits = 0.0, 0.0, []
        for k, state in enumerate(ttt_forward(head, embed, feats, ids, steps)):
            pos = torch.arange(rows) + 2 + k
            tgt = column[ids[pos.clamp(max=rows)]]
            valid = (pos <= rows) & (pos >= loss_from) & (tgt >= 0) & keep
            logits = head.lm_head(head.norm(state)).float()
            ce = torch.nn.functional.cross_entropy(logits, tgt.clamp(min=0), reduction="none")
            want_loss += decay**k * float((ce * valid).sum())
            want_weight += decay**k * float(valid.sum())
            hits.append((logits.argmax(-1) == tgt) & valid)
    first = max(loss_from - 2, 0)
    chain_rows = [t for t in range(first, rows - 1) if keep[t]]
    assert chains == len(chain_rows)
    want_accepted = sum(1 + int(torch.stack(hits)[:, t].long().cumprod(0).sum()) for t in chain_rows)
    assert accepted == want_accepted
    assert float(weight) == pytest.approx(want_weight) and float(loss) == pytest.approx(want_loss, rel=1e-5)
