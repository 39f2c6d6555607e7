"""Fused projections (`glance_rt.models.fused`, on by default on a GPU): each layer's q, k, v and gate, up
as one GEMM over weights laid out back to back, the HF parameters views of them. The decoder's tokens
stay HF greedy's; the HF model computes what it did, bit for bit; no weight is copied twice."""

import pytest
import torch
from torch import nn

import glance_rt
from glance_rt.models.fused import FusedLinear, fusable, stack_rows
from glance_rt.models.target import TargetDecoder
from glance_rt.round.verify import Backend, EagerPasses
from tests.conftest import OracleDrafter, hf_greedy
from tests.test_passes import static_decoder
from tests.tiny_models import ARCHS, VLM_ARCHS, make_inputs, make_tiny

NEW = 20


def fresh_target(arch: str):
    """A tiny target of its own (fusing lays out its weights; the shared `tiny_target`s stay as built)."""
    model, processor = make_tiny(arch)
    return glance_rt.load_target(model, processor=processor), model, processor


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_stack_rows_makes_the_parameters_views_once():
    torch.manual_seed(0)
    layers = [nn.Linear(8, n) for n in (8, 4, 4)]
    before = [m.weight.detach().clone() for m in layers]
    ids = [id(m.weight) for m in layers]
    stacked = stack_rows([m.weight for m in layers])  # [16, 8]
    assert stacked.shape == (16, 8) and torch.equal(stacked, torch.cat(before))
    assert [id(m.weight) for m in layers] == ids  # the same Parameter objects, now views of the stack
    assert all(storage(m.weight) == storage(stacked) for m in layers)
    assert all(torch.equal(m.weight, w) for m, w in zip(layers, before, strict=True))
    again = stack_rows([m.weight for m in layers])  # laid out already: a view, no copy
    assert storage(again) == storage(stacked) and again.storage_offset() == stacked.storage_offset()
    with torch.no_grad():
        layers[1].weight.add_(1.0)  # the stack sees a change made through the module
    assert torch.equal(stacked[8:12], layers[1].weight)


def test_fused_linear_equals_its_layers():
    torch.manual_seed(1)
    layers = [nn.Linear(16, n) for n in (16, 4, 4)]
    x = torch.randn(3, 5, 16)
    want = [m(x) for m in layers]
    got = FusedLinear(layers)(x)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_only_like_plain_linears_fuse():
    a, b = nn.Linear(8, 4), nn.Linear(8, 4, bias=False)
    assert fusable([nn.Linear(8, 4), nn.Linear(8, 2)])
    assert not fusable([a, b])  # a bias on one only
    assert not fusable([nn.Linear(8, 4), nn.Linear(6, 4)])  # other inputs
    assert not fusable([nn.Linear(8, 4), nn.Linear(8, 4).double()])

    class Quantized(nn.Linear):
        pass

    assert not fusable([nn.Linear(8, 4), Quantized(8, 4)])


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_decoder_computes_the_plain_one(arch):
    """Every architecture's text decoder with fused projections: the same greedy tokens and logits to
    fp32 rounding as the unfused one, and the HF model's own logits unchanged bit for bit."""
    target, model, processor = fresh_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    with torch.no_grad():
        hf_before = model(**inputs).logits
    plain = TargetDecoder(target.parts, 64, (0,))
    fused = TargetDecoder(target.parts, 64, (0,), fuse=True)
    layer = fused.stacks[0][0]
    assert layer.self_attn.qkv is not None and layer.mlp.gate_up is not None
    attn = target.parts.text_model.layers[0].self_attn
    assert storage(attn.q_proj.weight) == storage(attn.v_proj.weight) == storage(layer.self_attn.qkv.weight)
    torch.manual_seed(0)
    t = 9
    x = torch.randn(1, t, target.parts.text_config.hidden_size)
    pos = torch.arange(t)[None]
    pos = pos[None].expand(3, 1, t) if plain.mrope else pos
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    (lp, fp), (lf, ff) = (dec(x, pos, torch.tensor(0), mask, t) for dec in (plain, fused))
    torch.testing.assert_close(lf, lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ff, fp, atol=1e-5, rtol=1e-5)
    assert torch.equal(lf.argmax(-1), lp.argmax(-1))
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, hf_before)


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl", "qwen3"])
def test_fused_rounds_give_hf_greedy(arch):
    """Through the round loop (static passes, trees with scattered accepted rows) with fused weights."""
    target, model, processor = fresh_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    ref = hf_greedy(model, inputs, NEW)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    oracle = OracleDrafter(inputs["input_ids"].shape[1], ref, target.vocab_size, 4, decoy=True)
    dec = static_decoder(target, drafter, chunk=5, oracle=oracle, max_length=256, gate=False, tree_budget=16,
                         fuse=True, prepack=False)  # fusing takes the plain weights (a CPU plan has its own)
    assert dec.verifier.stacks[0][0].self_attn.qkv is not None
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == ref
    eager = glance_rt.Decoder(target, None, max_length=256, backend=Backend("eager", EagerPasses, fuse=True),
                              prepack=False)
    assert eager.generate(max_new_tokens=NEW, **inputs).token_ids == ref


@pytest.mark.parametrize("backend", ["eager", "compile"])
def test_cpu_backends_do_not_fuse_by_default(backend):
    """On a CPU the plain weights stay as HF laid them out (the kernels there are chosen by timing)."""
    target, _, _ = fresh_target("llama")
    dec = glance_rt.Decoder(target, None, max_length=64, backend=backend, prepack=False)
    assert dec.verifier.stacks[0][0].self_attn.qkv is None
    q, k = (target.parts.text_model.layers[0].self_attn.q_proj, target.parts.text_model.layers[0].self_attn.k_proj)
    assert storage(q.weight) != storage(k.weight)


def test_fused_decoder_compiles():
    """torch.compile over the fused weights (views of one buffer): HF greedy's tokens."""
    from glance_rt.round.verify import compiled_fns, static_passes

    target, model, processor = fresh_target("llama")
    inputs = make_inputs("llama", processor)
    backend = Backend("compile", static_passes(compiled_fns, 8), fuse=True)
    dec = glance_rt.Decoder(target, glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2), max_length=128,
                            backend=backend, prepack=False, tree_budget=8)
    assert dec.verifier.stacks[0][0].mlp.gate_up is not None
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)
