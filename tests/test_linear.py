"""Prepacked linears (glance_rt.models.linear): the same product as nn.Linear, used only where they
apply (eager, fp32, CPU with oneDNN), never touching the HF modules."""

import pytest
import torch
from torch import nn

import glance_rt
from glance_rt import GlanceError
from glance_rt.models.linear import PackedLinear, can_pack, pack_module, packed, swapped_linears
from tests.conftest import tiny_target

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="needs a CPU build with oneDNN (mkldnn)")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (1, 17, 64), (8, 64), (1, 300, 64)])
def test_packed_linear_is_linear(bias, shape):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias)
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(PackedLinear(lin.weight, lin.bias, 17)(x), lin(x), rtol=1e-5, atol=1e-5)


def test_pack_module_replaces_every_linear_in_a_copy_only():
    target, _, _ = tiny_target("qwen3")
    d = glance_rt.init_drafter(target, num_layers=2)
    import copy

    p = pack_module(copy.deepcopy(d), 8)
    assert not any(isinstance(m, nn.Linear) for m in p.modules())
    assert sum(isinstance(m, nn.Linear) for m in d.modules()) == 1 + 2 * 7  # fc + q,k,v,o,gate,up,down


def test_decoder_prepacks_only_where_it_applies():
    target, _, _ = tiny_target("llama")
    d = glance_rt.init_drafter(target, block_size=4)
    dec = glance_rt.Decoder(target, d, tree_budget=6, prepack=True)
    assert dec.prepack and isinstance(dec.verifier.stacks[0][0].self_attn.q_proj, PackedLinear)
    assert isinstance(dec.drafter.head, PackedLinear)
    assert isinstance(target.parts.text_model.layers[0].self_attn.q_proj, nn.Linear)  # HF modules untouched
    assert not glance_rt.Decoder(target, d, tree_budget=6, prepack=False).prepack
    assert glance_rt.Decoder(target, d, tree_budget=6).prepack  # "auto": kernels chosen per layer
    assert glance_rt.Decoder(target, d, tree_budget=6, backend="compile").prepack
    assert not can_pack(torch.zeros(1, dtype=torch.bfloat16))  # fp32 only (bf16 targets keep nn.Linear)
    bf16 = type("T", (), {"parts": type("P", (), {"lm_head": nn.Linear(2, 2).bfloat16()}),
                          "device": torch.device("cpu")})()  # the default backend is the target device's
    with pytest.raises(GlanceError, match="prepack=True needs fp32 weights"):
        glance_rt.Decoder(bf16, None, prepack=True)


def test_swapped_linears_runs_hf_generate_packed_and_puts_the_modules_back():
    target, _, _ = tiny_target("llama")
    model = target.hf_model
    before = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.inference_mode():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        with swapped_linears(model, lambda lin: packed(lin, 32)):
            assert not any(isinstance(m, nn.Linear) for m in model.modules())
            got = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    assert torch.equal(got, want)
    assert {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)} == before  # the same objects
    with pytest.raises(RuntimeError, match="boom"), swapped_linears(model, lambda lin: packed(lin, 32)):
        raise RuntimeError("boom")
    assert {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)} == before
