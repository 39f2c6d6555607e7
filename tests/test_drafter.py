"""Drafter checkpoints: DFlash-style folders, round trips, atomic saves, corrupt files."""

import json

import pytest
import torch

import glance_rt
from glance_rt import GlanceError
from glance_rt.drafter import build_target_layer_ids, read_drafter
from tests.conftest import tiny_target
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
    r1 = glance_rt.Decoder(target, drafter, tree_budget=8).generate(max_new_tokens=12, **inputs)
    r2 = glance_rt.Decoder(target, again, tree_budget=8).generate(max_new_tokens=12, **inputs)
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
            "layers.1.mlp.gate_proj.weight", "mask_embedding"} <= keys
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
    elif damage == "missing_ids":
        del cfg["dflash_config"]["target_layer_ids"]
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
