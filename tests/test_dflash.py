"""DFlash interoperability, both ways (README, "DFlash interoperability"): the folders glance-rt writes by
default are what DFlash's reference loads and drafts the same tokens with; DFlash folders are read exactly
(scaled RoPE, the default layer rule) or refused; glance-only extensions are declared and refused by
`check_dflash`. The reference here is `tests/dflash_reference.py`, an independent stand-in built from
transformers' Qwen3 parts."""

import json

import pytest
import torch
from click.testing import CliRunner

import glance_rt
from glance_rt import GlanceError
from glance_rt.cli import main
from glance_rt.hf.arch import extend_inputs
from glance_rt.models.drafter import (
    build_target_layer_ids,
    check_dflash,
    default_mask_token_id,
    read_drafter,
    rope,
    rope_tables,
)
from glance_rt.tools.training.data import Sequence, capture_features
from glance_rt.tools.training.glance import block_loss
from tests.conftest import hf_greedy, tiny_target, vocab_drafter
from tests.dflash_reference import load_reference, reference_chain
from tests.tiny_models import make_inputs

# the fields of config.json that DFlash's reference reads (its Qwen3Config, its model and dflash_generate)
REFERENCE_FIELDS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "rms_norm_eps", "rope_parameters", "vocab_size", "hidden_act",
                    "attention_bias", "block_size", "num_target_layers", "dflash_config", "model_type"}

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 1e6},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256, "rope_theta": 500000.0},
}


def rope_fields(params: dict) -> dict:
    rest = {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": params["rope_theta"], "rope_scaling": tuple(sorted(rest.items())),
            "max_position_embeddings": 2048}


def edit_config(folder, fn) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_default_folder_is_what_dflash_loads(tmp_path, arch):
    target, _, _ = tiny_target(arch)
    drafter = glance_rt.init_drafter(target, num_layers=2, block_size=5)
    drafter.save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert REFERENCE_FIELDS <= set(cfg)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 5
    assert cfg["dflash_config"]["mask_token_id"] == default_mask_token_id(target)
    assert isinstance(cfg["dflash_config"]["mask_token_id"], int)
    n_target = target.text_config.num_hidden_layers
    assert cfg["dflash_config"]["target_layer_ids"] == list(build_target_layer_ids(n_target, 2))
    assert cfg["glance"]["learned_mask"] is False and cfg["glance"]["draft_vocab_size"] is None
    ref = load_reference(tmp_path / "d")  # strict: exactly DFlash's tensor names and shapes
    assert ref.mask_token_id == drafter.config.mask_token_id and ref.block_size == 5
    assert list(ref.target_layer_ids) == list(drafter.target_layer_ids)
    check_dflash(tmp_path / "d")


def test_default_mask_token_is_a_row_no_text_uses():
    target, _, tok = tiny_target("llama")  # SmolLM2's tokenizer: vocabulary == tokenizer, no mask token
    assert default_mask_token_id(target) == 16 and tok.convert_ids_to_tokens(16) == "<empty_output>"

    class Wide:  # a Qwen-style target: embedding rows past the tokenizer
        tokenizer, vocab_size = tok, len(tok) + 64

    assert default_mask_token_id(Wide()) == len(tok)


def fit_drafter(arch: str, block_size: int, steps: int, **overrides):
    """A drafter fitted to the tiny target's greedy answer to the test prompt, so most drafts are accepted."""
    target, model, proc = tiny_target(arch)
    inputs = make_inputs(arch, proc)
    answer = hf_greedy(model, inputs, 40)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=block_size, seed=1, **overrides).float()
    full = extend_inputs(inputs, answer)
    p, ids = inputs["input_ids"].shape[1], full["input_ids"][0]
    seq = Sequence(capture_features(target, full, drafter.target_layer_ids), ids, p, "chat")
    embed = target.parts.text_model.embed_tokens.weight.detach().float()
    head = target.parts.lm_head.weight.detach().float()
    drafter.train().requires_grad_(True)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    anchors = torch.arange(p, len(ids) - 1)
    for _ in range(steps):
        loss, weight, _ = block_loss(drafter, embed, head, [(seq, anchors)], gamma=7.0)
        opt.zero_grad()
        (loss / weight).backward()
        opt.step()
    return drafter.eval().requires_grad_(False), inputs, answer


@pytest.mark.parametrize("arch,block_size,rope_kind", [("llama", 4, "default"), ("qwen3", 6, "yarn")])
def test_fitted_drafter_accepts_the_same_in_dflash_chain(tmp_path, arch, block_size, rope_kind):
    """A drafter fitted for a few dozen steps (many drafts accepted, some rejected) commits the same tokens per round in
    DFlash's chain decoding (the reference, reading the saved folder) as in glance-rt's chain decoder."""
    target, model, _ = tiny_target(arch)
    drafter, inputs, answer = fit_drafter(arch, block_size, 40, **rope_fields(ROPES[rope_kind]))
    drafter.save(tmp_path / "d")
    ref_tokens, ref_lengths = reference_chain(load_reference(tmp_path / "d"), model, inputs["input_ids"], 32)
    ours = glance_rt.Decoder(target, glance_rt.load_drafter(tmp_path / "d", target), chain=True, prepack=False,
                             gate=False)
    res = ours.generate(max_new_tokens=32, **inputs)
    assert ref_tokens == answer[:32] and res.token_ids == answer[:32]
    got = res.stats.accepted_lengths
    assert sum(got) / len(got) > 1.5 and max(got) == block_size, "the fitted drafter should have many drafts accepted"
    assert got[:-1] == ref_lengths[:len(got) - 1]  # the last round is cut at max_new_tokens


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rope_equals_transformers_rotary_embedding(tmp_path, kind):
    """Scaled RoPE read from a DFlash folder == transformers' Qwen3RotaryEmbedding for that config (the
    class DFlash's reference rotates with), legacy `rope_scaling` spelling included."""
    target, _, _ = tiny_target("llama")
    glance_rt.init_drafter(target, **rope_fields(ROPES[kind])).save(tmp_path / "d")
    if kind != "default":  # as older transformers wrote it
        def legacy(cfg):
            params = cfg.pop("rope_parameters")
            cfg["rope_theta"] = params.pop("rope_theta")
            cfg["rope_scaling"] = {"type": params.pop("rope_type"), **params}

        edit_config(tmp_path / "d", legacy)
    drafter = read_drafter(tmp_path / "d")
    ref = load_reference(tmp_path / "d").rotary_emb
    positions = torch.arange(0, 3000, 7)
    want_cos, want_sin = ref(torch.zeros(1, dtype=torch.float32), positions[None])
    inv_freq, scaling = rope(drafter.config)
    cos, sin = rope_tables(inv_freq, positions, torch.float32, scaling)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=0)
    if kind == "yarn":
        assert scaling != 1.0  # yarn's attention scaling is applied, not dropped


def test_missing_target_layer_ids_take_dflash_default_rule(tmp_path):
    target, _, _ = tiny_target("llama")
    for layers, n_target in [(1, 2), (2, 30), (3, 36)]:
        glance_rt.init_drafter(target, num_layers=layers, target_layer_ids=(0,) * layers).save(tmp_path / "d")

        def edit(c, n=n_target):
            c["dflash_config"].pop("target_layer_ids")
            c["num_target_layers"] = n

        edit_config(tmp_path / "d", edit)
        want = list(load_reference(tmp_path / "d").target_layer_ids)
        assert list(read_drafter(tmp_path / "d").target_layer_ids) == want
    assert want == [1, 17, 33]
    edit_config(tmp_path / "d", lambda c: c.update(num_target_layers=4))  # DFlash's rule gives [1, 0, 1]: refused
    with pytest.raises(GlanceError, match="target_layer_ids"):
        read_drafter(tmp_path / "d")
    edit_config(tmp_path / "d", lambda c: c.pop("num_target_layers"))
    with pytest.raises(GlanceError, match="num_target_layers"):
        read_drafter(tmp_path / "d")


@pytest.mark.parametrize("field,edit", [
    ("rope_type", lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})),
    ("rope_type", lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                      "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})),
    ("attention_bias", lambda c: c.update(attention_bias=True)),
    ("hidden_act", lambda c: c.update(hidden_act="gelu")),
    ("use_sliding_window", lambda c: c.update(use_sliding_window=True, sliding_window=64,
                                              layer_types=["sliding_attention"])),
    ("partial_rotary_factor", lambda c: c.update(partial_rotary_factor=0.5)),
    ("dflash_config.block_size", lambda c: c["dflash_config"].update(block_size=16)),
])
def test_what_would_draft_differently_is_refused(tmp_path, field, edit):
    target, _, _ = tiny_target("llama")
    glance_rt.init_drafter(target, head_dim=16).save(tmp_path / "d")
    edit_config(tmp_path / "d", edit)
    with pytest.raises(GlanceError, match=field):
        glance_rt.load_drafter(tmp_path / "d", target)


def test_glance_only_extensions_are_declared_and_refused_for_dflash(tmp_path):
    target, _, _ = tiny_target("llama")
    for name, drafter in [("mask", glance_rt.init_drafter(target, learned_mask=True)),
                          ("vocab", vocab_drafter(target, 64))]:
        drafter.save(tmp_path / name)
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["architectures"] == ["GlanceDraftModel"]  # a DFlash loader keyed on it refuses the folder
        with pytest.raises(GlanceError, match="glance-rt only"):
            check_dflash(tmp_path / name)
        result = CliRunner().invoke(main, ["check-drafter", str(tmp_path / name), "--dflash"])
        assert result.exit_code == 1 and "glance-rt only" in result.output
    assert "learned mask" in CliRunner().invoke(main, ["check-drafter", str(tmp_path / "mask")]).output
    # an undeclared extension tensor is refused, not silently used
    edit_config(tmp_path / "mask", lambda c: (c.pop("glance"), c["dflash_config"].update(mask_token_id=5)))
    with pytest.raises(GlanceError, match="mask_embedding"):
        read_drafter(tmp_path / "mask")
    glance_rt.init_drafter(target).save(tmp_path / "plain")
    result = CliRunner().invoke(main, ["check-drafter", str(tmp_path / "plain"), "--dflash"])
    assert result.exit_code == 0 and "DFlash-compatible: yes" in result.output
