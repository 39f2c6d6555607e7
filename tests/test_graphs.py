"""The CUDA-graph runner (glance_rt.round.graphs): warm-up, capture and replay per input signature, each
call's side effects once, outputs in fixed tensors that the pass's next replay overwrites. Here on CPU
the capture step is a stand-in with CUDA's contract (nothing runs at capture; each replay recomputes into
the same output tensors), so a decoder reading an output after its pass ran again gets other values and
fails the token checks. The real capture runs in a gpu-marked test (test_passes.py)."""

import pytest
import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

import glance_rt
from glance_rt.round.batch import Batch
from glance_rt.round.graphs import GraphRunner, signature
from glance_rt.round.verify import Backend, graph_names, named_backend, static_passes
from tests.conftest import hf_greedy, tiny_target
from tests.tiny_models import VLM_ARCHS, make_inputs

NEW = 24


def stand_in_capture(fn, static_args, spec):
    """CUDA capture's contract on CPU: returns (replay, outputs) without running fn; each replay runs fn
    on the static inputs and copies its results into the same output tensors."""
    out = tree_map(lambda m: torch.empty(m.shape, dtype=m.dtype) if isinstance(m, Tensor) else m, spec)

    def replay():
        for dst, src in zip(tree_flatten(out)[0], tree_flatten(fn(*static_args))[0], strict=True):
            if isinstance(dst, Tensor):
                dst.copy_(src)

    return replay, out


def test_each_call_runs_once_and_replays_from_its_signatures_second_call():
    calls = []

    def fn(x, y, scale):
        calls.append(x.shape)
        return x * scale + y, (x.sum(),)

    runner = GraphRunner(fn, stand_in_capture)
    x, y = torch.arange(6.0).view(2, 3), torch.ones(2, 3)
    outs = []
    for i in range(4):
        out = runner(x + i, y, 2.0)
        torch.testing.assert_close(out[0], (x + i) * 2.0 + y, rtol=0, atol=0)
        assert out[1][0].item() == (x + i).sum().item()
        outs.append(out)
    assert len(calls) == 4 and runner.replays == 3  # a warm-up, then a capture and 3 replays
    assert outs[1][0] is outs[2][0] is outs[3][0]  # fixed outputs: the next replay overwrites them
    assert outs[0][0] is not outs[1][0]  # the warm-up's own
    runner(x, y, 3.0), runner(x.t(), y.t(), 2.0), runner(torch.zeros(3, 3), torch.zeros(3, 3), 2.0)
    assert len(calls) == 7 and runner.replays == 3 and len(runner.warm) == 4  # other values, strides, shapes
    torch.testing.assert_close(runner(x, y, 3.0)[0], x * 3.0 + y, rtol=0, atol=0)
    torch.testing.assert_close(runner(x.t(), y.t(), 2.0)[0], x.t() * 2.0 + y.t(), rtol=0, atol=0)
    assert len(runner.graphs) == 3 and runner.replays == 5


def test_signature_tells_layouts_values_and_modes_apart():
    a = torch.zeros(2, 3)
    assert signature((a, 1)) == signature((torch.ones(2, 3), 1))
    with torch.no_grad():
        no_grad = signature((a, 1))
    with torch.inference_mode():
        inference = signature((torch.zeros(2, 3), 1)), signature((a, 1))
    assert len({signature((a, 1)), signature((a, 2)), signature((a.t().contiguous(), 1)), signature((a[:, :2], 1)),
                signature((a.double(), 1)), no_grad, *inference}) == 8


def test_a_recompile_at_capture_raises_instead_of_being_captured():
    """torch.compile guards on something the signature does not tell apart (here a global read by the
    function): the capture would compile inside the graph, so it raises."""
    scale = [2.0]

    def fn(x):
        return x * scale[0]

    def capture(fn, static_args, spec):  # runs fn's host code at capture, as CUDA's does (fn is pure here)
        out = fn(*static_args)
        return (lambda: out.copy_(fn(*static_args))), out

    torch._dynamo.reset()
    runner = GraphRunner(torch.compile(fn, fullgraph=True, dynamic=False), capture)
    x = torch.ones(3)
    runner(x)  # warm-up: compiles for scale 2
    scale[0] = 3.0
    with pytest.raises(RuntimeError, match="recompil"):
        runner(x)


def runner_decoder(target, drafter, chunk: int, **kw):
    """A Decoder whose StaticGraphs passes (uncompiled; the compiled backend's, and prefill's chunks) run
    through GraphRunners with the stand-in capture."""

    def fns(graphs):
        return {n: GraphRunner(getattr(graphs, n), stand_in_capture) for n in ("prefill", *graph_names(graphs))}

    return glance_rt.Decoder(target, drafter, backend=Backend("runner", static_passes(fns, chunk)), **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
@pytest.mark.parametrize("mode", ["ar", "tree", "chain", "device-round", "device-step"])
def test_decoding_through_fixed_output_graphs_is_lossless(arch, mode):
    """Every pass's outputs live in fixed tensors that its next call overwrites (as a CUDA graph's do): the
    loop never reads one after that, so the tokens are HF greedy's, over two generations (the second all
    replays), in every kind of round."""
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    ref = hf_greedy(model, inputs, NEW)
    ar = mode in ("ar", "device-step")
    drafter = None if ar else glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=3)
    kw = {"chain": True} if mode == "chain" else {"tree_budget": 8}
    dec = runner_decoder(target, drafter, chunk=8, max_length=256, gate=False,
                         device_round=True if mode.startswith("device") else None, **kw)
    for _ in range(2):
        assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == ref
    replays = {n: f.replays for n, f in dec.passes.fns.items()}
    graph = {"device-round": "round", "device-step": "step"}.get(mode, "verify")
    assert replays["prefill"] > 0 and replays[graph] > 0
    assert all((replays.get(n, 0) > 0) == (n == graph) for n in ("round", "step"))
    if mode == "device-step":  # every step ran as the step graph
        assert replays["verify"] == 0


def test_batches_and_eagle3_through_fixed_output_graphs_are_lossless():
    """The batched passes (three requests, two slots: one joins as another leaves) and an EAGLE-3 head's
    context and depth passes, through the same runners: HF greedy's tokens."""
    from tests.test_batch import NEW as LENGTHS
    from tests.test_batch import requests
    from tests.test_eagle3_decode import eagle3

    target, model, processor = tiny_target("qwen2_5_vl")
    reqs = requests("qwen2_5_vl", processor)
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    dec = runner_decoder(target, drafter, chunk=8, tree_budget=8, gate=False, max_batch=2, max_length=256)
    results = Batch(dec).run([dict(r, max_new_tokens=n) for r, n in zip(reqs, LENGTHS, strict=True)])
    for r, n, res in zip(reqs, LENGTHS, results, strict=True):
        assert res.token_ids == hf_greedy(model, r, n)
    assert dec.passes.fns["verify_batch"].replays > 0 and dec.passes.fns["draft_batch"].replays > 0
    inputs = reqs[1]
    dec = runner_decoder(target, eagle3(target), chunk=8, tree_budget=8, gate=False, max_length=256)
    for _ in range(2):
        assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)
    assert dec.passes.fns["eagle3_depth"].replays > 0


def test_unknown_cuda_graphs_mode_is_refused():
    target, _, _ = tiny_target("llama")
    with pytest.raises(glance_rt.GlanceError, match="cuda_graphs"):
        glance_rt.Decoder(target, None, max_length=64, backend=named_backend("compile", 8, cuda_graphs="tree"))

