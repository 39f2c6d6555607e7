"""The EAGLE-3 head (`glance_rt.models.eagle3`) against an independent reference built from
transformers' Llama parts (`tests/eagle3_reference.py`): the same tensor names (a strict state-dict load)
and the same states and logits, step after step with the head's own states fed back."""

import json

import pytest
import torch
import torch.nn.functional as F

from glance_rt import GlanceError
from glance_rt.models.drafter import rope, rope_tables
from glance_rt.models.eagle3 import Eagle3Config, Eagle3Head, default_layer_ids, read_eagle3, save_eagle3
from tests.eagle3_reference import ReferenceEagle3, reference_config, reference_from_folder

CFG = Eagle3Config(hidden_size=32, target_hidden_size=48, vocab_size=100, draft_vocab_size=40,
                   target_layer_ids=(1, 3, 5), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=64, rope_theta=10000.0)


def random_head(c: Eagle3Config = CFG, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(c)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
        head.d2t.copy_(torch.randint(0, c.vocab_size - c.draft_vocab_size, (c.draft_vocab_size,)))
    return head


def causal_attend(q, k, v):
    """Plain causal attention over the rows of one pass (GQA by repeating K and V)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def glance_step(head: Eagle3Head, embeds, state, positions):
    inv_freq = 1.0 / (CFG.rope_theta ** (torch.arange(0, CFG.head_dim, 2).float() / CFG.head_dim))
    cos, sin = rope_tables(inv_freq, positions, embeds.dtype)
    return head(embeds, state, cos, sin, causal_attend)


def test_the_reference_loads_the_heads_tensors_by_name():
    head = random_head()
    ref = ReferenceEagle3(reference_config(CFG), CFG.target_hidden_size, CFG.draft_vocab_size)
    ref.load_state_dict(head.state_dict(), strict=True)  # every name, no more, no fewer
    assert "midlayer.self_attn.q_proj.weight" in head.state_dict() and "d2t" in head.state_dict()


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("steps", [1, 3])
def test_head_equals_the_reference_step_after_step(steps, norm_before_residual):
    """Step 0 reads fc of the target's features; each later step reads the head's own states (the
    training-time-test unroll), same tokens shifted: states and logits equal the reference's, with the
    state or (vLLM's norm_before_residual) hidden_norm(state) as the residual at every step."""
    c = Eagle3Config(**{**CFG.__dict__, "norm_before_residual": norm_before_residual})
    head = random_head(c, seed=1)
    ref = ReferenceEagle3(reference_config(c), CFG.target_hidden_size, CFG.draft_vocab_size)
    ref.load_state_dict(head.state_dict(), strict=True)
    torch.manual_seed(2)
    t = 7
    feats = torch.randn(1, t, 3 * CFG.target_hidden_size)
    embeds = torch.randn(1, t, CFG.hidden_size)
    positions = torch.arange(t)
    state = ref_state = head.fuse(feats)
    with torch.no_grad():
        for _ in range(steps):
            state, logits = glance_step(head, embeds, state, positions)
            ref_state, ref_logits = ref(embeds, ref_state, positions[None])
            # fp32 rounding apart (SDPA against the reference's softmax), compounded over the steps
            torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_draft_ids_map_to_target_ids():
    head = random_head()
    ids = torch.tensor([0, 5, CFG.draft_vocab_size - 1])
    assert torch.equal(head.target_ids(ids), ids + head.d2t[ids])


def test_default_layers_are_eagle3s():
    """Layer outputs 1, L//2 - 1 and L - 4: hidden_states 2, L//2 and L - 3 (hidden_states[0] is the
    embedding), the reference implementation's low, middle and high layers."""
    assert default_layer_ids(32) == (1, 15, 28)
    assert default_layer_ids(36) == (1, 17, 32)
    assert default_layer_ids(2) == (1, 0, 0)  # tiny targets: clamped into the layers there are


@pytest.mark.parametrize("bad,match", [(dict(target_layer_ids=(1, 2)), "3 target layers"),
                                       (dict(draft_vocab_size=0), "draft_vocab_size"),
                                       (dict(num_key_value_heads=3), "multiple")])
def test_bad_configs_are_refused(bad, match):
    fields = {**CFG.__dict__, **bad}
    with pytest.raises(GlanceError, match=match):
        Eagle3Head(Eagle3Config(**fields))


# ----------------------------------------------------------------------------- checkpoints


def edit(folder, fn) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def run_head(head: Eagle3Head, feats, embeds, positions):
    inv_freq, scaling = rope(head.config)
    cos, sin = rope_tables(inv_freq, positions, embeds.dtype, scaling)
    return head(embeds, head.fuse(feats), cos, sin, causal_attend)


LLAMA3_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
               ("original_max_position_embeddings", 64), ("rope_type", "llama3"))


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("rope_scaling", [(), LLAMA3_ROPE])
def test_written_folder_is_what_the_reference_loads(tmp_path, rope_scaling, norm_before_residual):
    """save_eagle3 writes what vLLM reads: transformers' LlamaConfig of config.json and a strict load of
    every tensor give a reference head that fuses the same layers and computes the same states and
    logits as glance's head read back from the folder (scaled RoPE through each side's own code; the
    residual as config.json's norm_before_residual says)."""
    c = Eagle3Config(**{**CFG.__dict__, "rope_scaling": rope_scaling, "max_position_embeddings": 256,
                        "norm_before_residual": norm_before_residual})
    head = random_head(c, seed=3)
    save_eagle3(head, tmp_path / "eagle3")
    got = read_eagle3(tmp_path / "eagle3")
    assert got.config == c
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), head.state_dict().values(), strict=True))
    ref, layers = reference_from_folder(tmp_path / "eagle3")
    assert tuple(layers) == c.target_layer_ids
    cfg = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(c.target_layer_ids)  # SGLang's reading
    assert cfg["norm_before_residual"] is norm_before_residual
    torch.manual_seed(4)
    t = 6
    feats, embeds = torch.randn(1, t, 3 * c.target_hidden_size), torch.randn(1, t, c.hidden_size)
    positions = torch.arange(40, 40 + t)  # past original_max_position_embeddings / factor: scaling matters
    with torch.no_grad():
        state, logits = run_head(got, feats, embeds, positions)
        ref_state, ref_logits = ref(embeds, ref.fc(feats), positions[None])
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_folders_as_specforge_writes_them(tmp_path):
    """SpecForge's config names the layers only in eagle_config (layer indices); a published folder may
    prefix names with `model.`, leave out t2d and d2t (the identity map) or carry its own embeddings."""
    from safetensors.torch import load_file, save_file

    head = random_head()
    save_eagle3(head, tmp_path / "h")
    edit(tmp_path / "h", lambda d: [d.pop("eagle_aux_hidden_state_layer_ids"), d.pop("norm_before_residual")])
    with pytest.raises(GlanceError, match="names no target layers"):
        read_eagle3(tmp_path / "h")  # no layers named and no target to take EAGLE-3's default from
    with pytest.raises(GlanceError, match="eagle_config.eagle_aux_hidden_state_layer_ids"):
        read_eagle3(tmp_path / "h", num_target_layers=12)  # vLLM would fuse the default layers, not (1, 3, 5)
    edit(tmp_path / "h", lambda d: d["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 5, 8]))
    assert read_eagle3(tmp_path / "h", num_target_layers=12).target_layer_ids == (1, 5, 8) == default_layer_ids(12)
    weights = tmp_path / "h" / "model.safetensors"
    state = {("model." + k if k.startswith("midlayer") else k): v for k, v in load_file(weights).items()
             if k not in ("d2t", "t2d")}
    state["embed_tokens.weight"] = torch.randn(CFG.vocab_size, CFG.hidden_size)
    save_file(state, weights)
    got = read_eagle3(tmp_path / "h", num_target_layers=12)
    assert got.config.own_embeddings and torch.equal(got.embed_tokens.weight, state["embed_tokens.weight"])
    assert torch.equal(got.target_ids(torch.arange(3)), torch.arange(3))  # no d2t: identity
    assert torch.equal(got.midlayer.hidden_norm.weight, head.midlayer.hidden_norm.weight)
    assert not got.config.norm_before_residual  # no key: the state is the residual (vLLM's default)


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 2), ("attention_bias", True), ("hidden_act", "gelu"),
                                         ("tie_word_embeddings", True), ("fc_norm", True), ("norm_output", False),
                                         ("eagle_config", {"use_aux_hidden_state": False}),
                                         ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0})])
def test_fields_that_draft_differently_are_refused(tmp_path, field, value):
    save_eagle3(random_head(), tmp_path / "h")
    edit(tmp_path / "h", lambda d: d.update({field: value}))
    with pytest.raises(GlanceError, match=field):
        read_eagle3(tmp_path / "h")


@pytest.mark.parametrize("change,field", [(None, "must be a JSON object"),
                                          (lambda d: d.update(hidden_size="64"), "hidden_size"),
                                          (lambda d: d.update(num_attention_heads=2.5), "num_attention_heads"),
                                          (lambda d: d.update(rms_norm_eps="1e-6"), "rms_norm_eps"),
                                          (lambda d: d.update(norm_before_residual="yes"), "norm_before_residual"),
                                          (lambda d: d.update(eagle_config=[1]), "eagle_config"),
                                          (lambda d: d.update(eagle_aux_hidden_state_layer_ids=[2, "5"]),
                                           "eagle_aux_hidden_state_layer_ids")])
def test_config_of_the_wrong_type_names_the_field(tmp_path, change, field):
    """Valid JSON of the wrong shape or types is a GlanceError naming the field to fix (a list for the
    whole config: saying it must be an object), not a TypeError from deep in the reader."""
    save_eagle3(random_head(), tmp_path / "h")
    if change is None:
        (tmp_path / "h" / "config.json").write_text("[1, 2]")
    else:
        edit(tmp_path / "h", change)
    with pytest.raises(GlanceError, match=field):
        read_eagle3(tmp_path / "h")


def test_bad_folders_say_what_is_wrong(tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(GlanceError, match="not an EAGLE-3 folder"):
        read_eagle3(tmp_path)
    save_eagle3(random_head(), tmp_path / "h")
    weights = tmp_path / "h" / "model.safetensors"
    state = load_file(weights)
    save_file({**state, "d2t": state["d2t"] + CFG.vocab_size}, weights)
    with pytest.raises(GlanceError, match="outside the target"):
        read_eagle3(tmp_path / "h")
    save_file({k: v for k, v in state.items() if k != "fc.weight"}, weights)
    with pytest.raises(GlanceError, match="missing"):
        read_eagle3(tmp_path / "h")
    edit(tmp_path / "h", lambda d: d.update(architectures=["DFlashDraftModel"]))
    with pytest.raises(GlanceError, match="not an EAGLE-3 head"):
        read_eagle3(tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text("{")
    with pytest.raises(GlanceError, match="corrupt"):
        read_eagle3(tmp_path / "h")
