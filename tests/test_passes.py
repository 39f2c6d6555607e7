"""Static-shape passes (`glance_rt.round.verify`) and the torch.compile backend: the same tokens as HF
greedy (fp32) with chunked prefill, padded drafter context and fixed-size compaction exercised by
decoy drafters; the drafter's logits equal the eager pass's; compiled rounds never recompile."""

import pytest
import torch

import glance_rt
from glance_rt.models.kernels import KernelTuner
from glance_rt.models.linear import can_pack
from glance_rt.round.verify import GRAPHS, Backend, named_backend, static_passes
from tests.conftest import OracleDrafter, hf_greedy, tiny_target
from tests.tiny_models import ARCHS, VLM_ARCHS, make_inputs

NEW = 24


def static_decoder(target, drafter, chunk: int, oracle=None, spy=None, fuse=None, **kw):
    """A Decoder over StaticPasses whose graphs run eagerly (no compiler), the device round's too. With
    `oracle`, the real draft graph still runs (writing the context cache) but the oracle's logits are
    drafted (in a device round as well: its graph drafts through `graphs.draft`). `fuse`: the Backend's."""

    def fns(graphs):
        draft = graphs.draft

        def wrapped(ctx, ctx_start, bonus, block_start):
            out = draft(ctx, ctx_start, bonus, block_start)
            if spy is not None:
                spy.append(out)
            return out if oracle is None else oracle(None, 0, int(bonus), int(block_start))

        graphs.draft = wrapped
        return {n: getattr(graphs, n) for n in (*GRAPHS, "round", "lookup", "step")}

    return glance_rt.Decoder(target, drafter, backend=Backend("static", static_passes(fns, chunk), fuse=fuse), **kw)


def case(arch):
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    return target, model, inputs, hf_greedy(model, inputs, NEW)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["ar", "chain", "tree-decoy"])
def test_static_passes_are_lossless(arch, mode):
    target, _, inputs, ref = case(arch)
    p = inputs["input_ids"].shape[1]
    drafter = None if mode == "ar" else glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    oracle = OracleDrafter(p, ref, target.vocab_size, 4, decoy=True) if mode == "tree-decoy" else None
    kw = {"chain": True} if mode == "chain" else {"tree_budget": 24}
    dec = static_decoder(target, drafter, chunk=5, oracle=oracle, max_length=256, gate=False, **kw)  # 5: mid-chunk
    res = dec.generate(max_new_tokens=NEW, **inputs)
    assert res.token_ids == ref
    if mode == "tree-decoy":
        assert max(res.stats.accepted_lengths) == 4  # scattered accepted rows: compaction ran


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_static_passes_accept_lookup_chains_deeper_than_the_block(arch, monkeypatch):
    """A lookup chain that is the true continuation (an oracle for the n-gram match) runs past the
    block's B-1 depths up to `max_depth`: the static passes accept it whole (path and padded draft
    context of max_depth + 1 rows) and the tokens stay HF greedy's."""
    import glance_rt.round.loop as dm
    from glance_rt.round.tree import lookup_rows, max_depth

    target, _, inputs, ref = case(arch)
    p = inputs["input_ids"].shape[1]
    def oracle(history, max_ngram, length):
        return max_ngram, ref[len(history) - p : len(history) - p + length]

    monkeypatch.setattr(dm, "lookup_match", oracle)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    dec = static_decoder(target, drafter, chunk=5, tree_budget=12, lookup=3, max_length=256, gate=False)
    res = dec.generate(max_new_tokens=NEW, **inputs)
    assert res.token_ids == ref
    assert lookup_rows(4, 12, 3) == max_depth(4) == 7  # the chain takes 7 of 12 rows, 7 deep
    assert max(res.stats.accepted_lengths) == 8  # past the block's 3 drafted depths, and its 4 rows


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_static_draft_pass_equals_eager(arch):
    """Padded context rows (prompt chunks, B-row rounds) leave the drafter's logits unchanged."""
    target, _, inputs, ref = case(arch)
    p = inputs["input_ids"].shape[1]
    drafter = glance_rt.init_drafter(target, num_layers=2, block_size=4, seed=4)
    seen = {"eager": [], "static": []}
    oracle = OracleDrafter(p, ref, target.vocab_size, 4, decoy=True)  # same acceptance in both runs
    eager = glance_rt.Decoder(target, drafter, tree_budget=12, max_length=256)
    real = eager.passes.draft

    def spy_eager(*a):
        seen["eager"].append(real(*a))
        return oracle(None, 0, a[2], a[3])

    eager.passes.draft = spy_eager
    assert eager.generate(max_new_tokens=NEW, **inputs).token_ids == ref
    oracle.rng = OracleDrafter(p, ref, target.vocab_size, 4, decoy=True).rng
    static = static_decoder(target, drafter, chunk=3, oracle=oracle, spy=seen["static"], tree_budget=12, max_length=256)
    assert static.generate(max_new_tokens=NEW, **inputs).token_ids == ref
    assert len(seen["eager"]) == len(seen["static"]) > 3
    for a, b in zip(seen["eager"], seen["static"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
@pytest.mark.parametrize("rows,lengths", [(6, [7, 7, 7]), (None, [8, 8])])
def test_lookup_rounds_skip_the_draft_and_leave_its_context_whole(arch, rows, lengths, monkeypatch):
    """Rounds whose lookup chain fills the budget (a long match) run no draft pass and verify
    `lookup_budget` rows of the chain (None: max_depth(4) = 7 here, past the tree's 6; 6: the tree's
    shape); the rows they commit wait as drafter context, and the next draft pass projects them all
    (more than R rows: context chunks on static passes). The draft logits of every drafted round
    equal the eager pass's, and the tokens stay HF greedy's."""
    import glance_rt.round.loop as dm

    target, _, inputs, ref = case(arch)
    p = inputs["input_ids"].shape[1]

    def lookup(history, max_ngram, length):  # a true 8-token match for the first 16 tokens, then none
        done = len(history) - p
        return (max_ngram, ref[done : done + length]) if done < 16 else (0, [])

    monkeypatch.setattr(dm, "lookup_match", lookup)
    drafter = glance_rt.init_drafter(target, num_layers=2, block_size=4, seed=4)
    seen = {"eager": [], "static": []}
    oracle = OracleDrafter(p, ref, target.vocab_size, 4, decoy=True)
    kw = {"tree_budget": 6, "lookup": 8, "max_length": 256, "gate": False, "lookup_budget": rows}
    eager = glance_rt.Decoder(target, drafter, **kw)
    real = eager.passes.draft

    def spy_eager(*a):
        seen["eager"].append(real(*a))
        return oracle(None, 0, a[2], a[3])

    eager.passes.draft = spy_eager
    res = eager.generate(max_new_tokens=NEW, **inputs)
    assert res.token_ids == ref
    s = res.stats
    n = len(lengths)  # lookup rounds until 16 tokens are out: 1 + 7 + 7 < 16 <= 1 + 21; 1 + 8 < 16 <= 1 + 16
    assert s.accepted_lengths[:n] == lengths and s.lookup_rounds == n and s.budgets[:n] == [lengths[0] - 1] * n
    assert s.draft_passes == s.rounds - n == len(seen["eager"]) > 0 and s.tau > 1
    oracle.rng = OracleDrafter(p, ref, target.vocab_size, 4, decoy=True).rng
    static = static_decoder(target, drafter, chunk=3, oracle=oracle, spy=seen["static"], **kw)
    assert static.generate(max_new_tokens=NEW, **inputs).token_ids == ref
    assert len(seen["eager"]) == len(seen["static"])
    for a, b in zip(seen["eager"], seen["static"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_static_passes_refuse_protocol_drafters_and_bad_backends():
    target, _, inputs, ref = case("llama")
    oracle = OracleDrafter(inputs["input_ids"].shape[1], ref, target.vocab_size, 4)
    oracle.block_size = 4
    with pytest.raises(glance_rt.GlanceError, match="GlanceDrafter"):
        glance_rt.Decoder(target, oracle, backend="compile")
    with pytest.raises(glance_rt.GlanceError, match="unknown backend"):
        glance_rt.Decoder(target, None, backend="tensorrt")
    with pytest.raises(glance_rt.GlanceError, match="chunk"):
        glance_rt.Decoder(target, None, backend="compile", chunk=0)


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def mixed_kernels(tmp_path) -> KernelTuner:
    """A tuner whose (fake, deterministic) timings pick each kernel (torch's own, oneDNN, MKL over the
    transposed weight) for some shapes at some row counts."""
    return KernelTuner(lambda o, i, r, dt: {"mkl": 1.0, "mkl_t": 0.5 if (o + r) % 3 == 2 else 2.0,
                                            "onednn": 0.5 if (o + r) % 3 == 1 else 2.0},
                       cache=tmp_path / "kernels.json", pass_timer=lambda key, runs: {"plan": 1.0, "plain": 2.0})


@pytest.mark.parametrize("arch,prepack", [("llama", True), ("llama", False), ("llama", "mixed"),
                                          ("qwen2_5_vl", "auto")])
def test_compile_backend_is_lossless_and_never_recompiles(arch, prepack, tmp_path):
    """After one warm-up generation, generations with other prompts (other lengths, so other
    drafter-context chunk counts and acceptance patterns) add no compiled graph. With oneDNN-prepacked
    weights, plain ones, a mix chosen per layer and row class, and the machine's own choice."""
    torch._dynamo.reset()
    target, model, processor = tiny_target(arch)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=3)
    dec = glance_rt.Decoder(target, drafter, tree_budget=8, max_length=256, backend="compile", chunk=8, gate=False,
                            prepack=mixed_kernels(tmp_path) if prepack == "mixed" else prepack)
    assert dec.prepack == (prepack is not False and can_pack(target.parts.lm_head.weight))
    first = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    before = unique_graphs()
    assert dec.generate(max_new_tokens=NEW, **first).token_ids == hf_greedy(model, first, NEW)
    warm = unique_graphs()
    assert warm - before == 3  # verify, draft, context: one graph each (the prompt's prefill runs eagerly)
    vlm = arch in VLM_ARCHS
    for prompt, n_images, new in [("Hi", 0, 30), ("Count the objects, then name their colours, one by one.",
                                                   2 if vlm else 0, 20), ("What is it?", 1 if vlm else 0, 27)]:
        inputs = make_inputs(arch, processor, prompt=prompt, n_images=n_images, seed=new)
        assert dec.generate(max_new_tokens=new, **inputs).token_ids == hf_greedy(model, inputs, new)
    assert unique_graphs() == warm


def test_compile_backend_autoregression():
    torch._dynamo.reset()
    target, model, inputs, ref = case("qwen3")
    dec = glance_rt.Decoder(target, None, max_length=128, backend="compile", chunk=16)
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == ref


def test_compile_backend_traces_a_layer_once_for_all():
    """The compile backend runs the verifier's layers as one nested compile region: a graph traces a layer
    once and stamps it out for the rest, so four more layers add (almost) nothing to trace, where every
    layer is traced again without regions; yet a layer launches as many Inductor kernels as it does inline
    (a region that ended at the layer's residual add would cost one more: that add no longer fused with the
    next layer's norm); HF's tokens either way. (Compile time: docs/engines.md.)"""
    from dataclasses import replace

    from torch._dynamo.utils import counters
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def traced_and_launched(layers: int, regions: bool) -> tuple[int, int]:
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, eos_token_id=None)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).eval()
        backend = named_backend("compile", 8)
        assert backend.regions  # the compile backend's default
        dec = glance_rt.Decoder(glance_rt.load_target(model), None, max_length=64, chunk=8,
                                backend=replace(backend, regions=regions))
        ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(layers))
        torch._dynamo.reset()
        counters.clear()
        assert dec.generate(input_ids=ids, max_new_tokens=3).token_ids == hf_greedy(model, {"input_ids": ids}, 3)
        with torch.profiler.profile() as prof:  # compiled: the same passes again (each Inductor kernel an event)
            dec.generate(input_ids=ids, max_new_tokens=3)
        return counters["stats"]["calls_captured"], sum("cpp_fused" in e.name for e in prof.events())

    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        runs = {(n, regions): traced_and_launched(n, regions) for n in (2, 6) for regions in (True, False)}
    traced, launched = ({regions: (runs[6, regions][k] - runs[2, regions][k]) / 4 for regions in (True, False)}
                        for k in (0, 1))
    # torch 2.13: traced 3 (a region's call, its 2 outputs) and 59; launched 10 and 10 (12 for regions that end
    # at the residual add)
    assert traced[True] <= 4 and traced[False] >= 20, traced
    assert launched[False] > 0 and launched[True] == launched[False], launched


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", ["trees", "runner"])
def test_compile_backend_cuda_graphs_match_hf(cuda_graphs):
    """On CUDA the compiled passes replay as CUDA graphs (torch.compile's trees, or a GraphRunner per
    pass); fp32 tokens == HF over generations that replay the captured graphs."""
    torch._dynamo.reset()
    from tests.tiny_models import make_tiny

    model, processor = make_tiny("llama")
    target = glance_rt.load_target(model, processor=processor, device="cuda")
    inputs = {k: v.to("cuda") for k, v in make_inputs("llama", processor).items()}
    ref = hf_greedy(target.hf_model, inputs, NEW)
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=3)
    dec = glance_rt.Decoder(target, drafter, tree_budget=8, max_length=256, chunk=8,
                            backend=named_backend("compile", 8, cuda_graphs=cuda_graphs))
    ar = glance_rt.Decoder(target, None, max_length=256, chunk=8, backend=named_backend("compile", 8, cuda_graphs))
    assert dec.device_round and ar.device_round  # CUDA: drafted rounds and AR steps run as one graph each
    for _ in range(2):  # the second run replays the captured graphs
        res = dec.generate(max_new_tokens=NEW, **inputs)
        assert res.token_ids == ref and res.stats.timings["round"] > 0
        assert ar.generate(max_new_tokens=NEW, **inputs).token_ids == ref
    if cuda_graphs == "runner":
        assert dec.passes.fns["round"].replays > 0 and ar.passes.fns["step"].replays > 0


def test_warmup_compiles_every_bucket_up_front():
    """An adaptive budget's rounds switch between buckets; after warmup() none of them compiles."""
    from glance_rt.round.adaptive import AdaptiveBudget, Bucket

    torch._dynamo.reset()
    target, model, inputs, ref = case("llama")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=3)
    eager = glance_rt.Decoder(target, drafter, tree_budget=4, max_length=256)
    entropies = sorted(eager.generate(max_new_tokens=NEW, **inputs).stats.prior_entropy)
    m = entropies[len(entropies) // 2]  # a bucket each side of the median entropy
    policy = AdaptiveBudget((Bucket(4, 100.0, 1.0, 1.0), Bucket(8, 100.0 + 2 * m, -1.0, 1.0)))
    dec = glance_rt.Decoder(target, drafter, tree_budget=policy, max_length=256, backend="compile", chunk=8,
                            gate=False)
    before = unique_graphs()
    dec.warmup()
    warm = unique_graphs()
    assert dec.budgets == [4, 7, 8]  # lookup rounds verify max_depth(4) = 7 rows past the smaller tree's 4
    assert warm - before == 5  # verify at 5, 8 and 9 rows, draft, context
    res = dec.generate(max_new_tokens=NEW, **inputs)
    assert res.token_ids == ref and {4, 8} <= set(res.stats.budgets) <= {4, 7, 8}
    assert unique_graphs() == warm


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
@pytest.mark.parametrize("mode", ["tree-decoy", "chain-oracle", "drafter+lookup"])
def test_device_rounds_equal_host_rounds(arch, mode):
    """A drafted round as one graph (device tree, verify, acceptance, compaction, one copy back) commits
    what the host-tree round commits, round for round: HF greedy's tokens, the same accepted lengths
    (scattered accepted rows: compaction in the graph), budgets and draft passes."""
    target, _, inputs, ref = case(arch)
    p = inputs["input_ids"].shape[1]
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    oracle = None if mode == "drafter+lookup" else OracleDrafter(p, ref, target.vocab_size, 4,
                                                                 decoy=mode == "tree-decoy")
    kw = {"tree_budget": 24, "lookup": 0} if mode == "tree-decoy" else {"tree_budget": 10, "lookup": 3}
    kw = {"chain": True} if mode == "chain-oracle" else kw
    runs = {}
    for device_round in (False, True):
        dec = static_decoder(target, drafter, chunk=5, oracle=oracle, max_length=256, gate=False,
                             device_round=device_round, **kw)
        res = runs[device_round] = dec.generate(max_new_tokens=NEW, **inputs)
        assert res.token_ids == ref
        assert (res.stats.timings["round"] > 0) == device_round and (res.stats.timings["tree"] > 0) != device_round
    host, device = runs[False].stats, runs[True].stats
    assert (device.accepted_lengths, device.budgets, device.draft_passes) == (host.accepted_lengths, host.budgets,
                                                                               host.draft_passes)
    assert device.root_entropy == pytest.approx(host.root_entropy, rel=1e-5)
    if oracle is not None:
        assert max(device.accepted_lengths) == 4  # whole blocks accepted (decoys: scattered rows compacted)


def test_device_round_grafts_the_lookup_chain():
    """A device round's prompt-lookup chain (in its one upload) is grafted as the host grafts it: a chain that is
    the target's own continuation is accepted whole, beside an untrained drafter's candidates."""
    target, _, inputs, ref = case("llama")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=8, seed=2)
    dec = static_decoder(target, drafter, chunk=5, max_length=256, tree_budget=8, gate=False, device_round=True)
    pre = target.prefill_inputs(inputs)
    p = pre.embeds.shape[0]
    with torch.inference_mode():
        _, feats = dec.passes.prefill(pre.embeds[None].to(target.dtype), pre.positions[None])
        out = dec.passes.round(feats, 0, ref[0], p, pre.rope_delta, 8, False, (3, ref[1:9]))  # 3-gram: 6 rows
    assert out.run == ref[1:8] and len(out.path) == 7


def chain_lookup(prefix: int, ref: list[int], until: int):
    """A `lookup_match` stand-in: for the first `until` tokens an 8-gram match whose chain is the target's
    own continuation with one token made wrong, at a place that moves from round to round (the chain is
    accepted up to it); then none."""

    def lookup(history, max_ngram, length):
        done = len(history) - prefix
        if done >= until:
            return 0, []
        chain = list(ref[done : done + length])
        wrong = 2 + done % 5
        if wrong < len(chain):
            chain[wrong] = (chain[wrong] + 1) % 50
        return max_ngram, chain

    return lookup


@pytest.mark.parametrize("arch,backend", [("llama", "static"), ("qwen2_5_vl", "static"), ("llama", "compile"),
                                          pytest.param("llama", "compile-cuda", marks=pytest.mark.gpu)])
def test_device_lookup_rounds_equal_host_lookup_rounds(arch, backend, monkeypatch):
    """A lookup round (a chain that fills the budget: no draft pass) as one graph (the chain's verify and
    greedy acceptance, one copy in, one back) commits what the host's lookup round commits, round for round,
    chains accepted up to a wrong token or whole, at the tree's budget and at the lookup budget; the drafted
    rounds between them and after draft what they draft from the host. Compiled: warmup() builds a lookup
    graph per chain length, and nothing compiles after it (on CUDA: each replayed as a CUDA graph)."""
    import glance_rt.round.loop as dm

    if backend == "compile-cuda":  # a model of its own (the shared tiny ones stay on the CPU)
        from tests.tiny_models import make_tiny

        model, processor = make_tiny(arch)
        target = glance_rt.load_target(model, processor=processor, device="cuda")
        inputs = {k: v.to("cuda") for k, v in make_inputs(arch, processor).items()}
        ref = hf_greedy(target.hf_model, inputs, NEW)
    else:
        target, _, inputs, ref = case(arch)
    p = inputs["input_ids"].shape[1]
    monkeypatch.setattr(dm, "lookup_match", chain_lookup(p, ref, 24))
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=4)
    kw = {"tree_budget": 6, "lookup": 8, "max_length": 256, "gate": False}
    runs = {}
    for device_round in (False, True):
        if backend.startswith("compile"):
            torch._dynamo.reset()
            dec = glance_rt.Decoder(target, drafter, backend="compile", chunk=8, device_round=device_round, **kw)
            if device_round:
                assert dec._device_lookups() == [6, 7]  # a chain of the tree's 6 rows, or lookup_budget's 7
                dec.warmup()
                warm = unique_graphs()
        else:
            dec = static_decoder(target, drafter, chunk=5, device_round=device_round, **kw)
        res = runs[device_round] = dec.generate(max_new_tokens=NEW, **inputs)
        assert res.token_ids == ref
        assert (res.stats.timings["tree"] > 0) != device_round  # every round on the device: no host tree
    if backend.startswith("compile"):
        assert unique_graphs() == warm
    host, device = runs[False].stats, runs[True].stats
    assert host.lookup_rounds >= 3 and host.draft_passes > 0
    assert set(host.budgets) >= {6, 7} and len(set(host.accepted_lengths)) > 1  # both lengths; cut chains
    for field in ("accepted_lengths", "budgets", "lookup_rounds", "draft_passes"):
        assert getattr(device, field) == getattr(host, field), field
    assert device.root_entropy == pytest.approx(host.root_entropy, rel=1e-5)
    assert device.prior_entropy == pytest.approx(host.prior_entropy, rel=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_device_steps_equal_host_steps(arch):
    """An autoregressive step as one graph (the one-row verify, argmax and entropy in it; one copy in, one
    back) commits what the host's step commits, step for step: HF greedy's tokens, the same entropies,
    and no host tree."""
    target, _, inputs, ref = case(arch)
    runs = {}
    for device_round in (False, True):
        res = runs[device_round] = static_decoder(target, None, chunk=5, max_length=256,
                                                  device_round=device_round).generate(max_new_tokens=NEW, **inputs)
        assert res.token_ids == ref and res.stats.budgets == [0] * (NEW - 1)
        assert (res.stats.timings["tree"] > 0) != device_round and res.stats.timings["round"] == 0
    host, device = runs[False].stats, runs[True].stats
    assert device.root_entropy == pytest.approx(host.root_entropy, rel=1e-5)
    assert device.prior_entropy == pytest.approx(host.prior_entropy, rel=1e-5)


def test_device_rounds_beside_the_gates_steps():
    """Both kinds of round in one generation, each one graph on the device: the gate's autoregressive steps
    (their context rows stay pending for the next drafted round's draft) and drafted rounds; the output is
    HF greedy's, and the rounds are the host's."""
    target, _, inputs, ref = case("llama")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    runs = {}
    for device_round in (False, True):
        dec = static_decoder(target, drafter, chunk=5, max_length=256, lookup=0, device_round=device_round)
        res = runs[device_round] = dec.generate(max_new_tokens=NEW, **inputs)
        assert res.token_ids == ref
        assert 0 < res.stats.draft_passes < res.stats.rounds  # some rounds were the gate's one-row steps
        assert (res.stats.timings["tree"] > 0) != device_round
    host, device = runs[False].stats, runs[True].stats
    assert (device.accepted_lengths, device.budgets) == (host.accepted_lengths, host.budgets)


def test_device_round_needs_static_passes_and_a_glance_drafter_or_none():
    from tests.test_eagle3_decode import eagle3

    target, _, _ = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2)
    no_step = Backend("static", static_passes(lambda graphs: {n: getattr(graphs, n) for n in (*GRAPHS, "round")}, 5))
    for kw in ({"backend": "eager"}, {"backend": "eager", "drafter": None}, {"drafter": eagle3(target)},
               {"backend": no_step}):  # (no_step: the gate's steps would have no graph)
        with pytest.raises(glance_rt.GlanceError, match="device_round"):
            glance_rt.Decoder(target, kw.pop("drafter", drafter), max_length=128, device_round=True,
                              **{"backend": "compile", **kw})
    assert glance_rt.Decoder(target, None, max_length=128, backend="compile", device_round=True).device_round
    assert not glance_rt.Decoder(target, drafter, max_length=128, backend="compile").device_round  # a CPU: host trees
    assert not glance_rt.Decoder(target, None, max_length=128, backend="compile").device_round


@pytest.mark.parametrize("drafted", [True, False])
def test_compile_device_rounds_never_recompile(drafted):
    """The round graph (one per drafted budget) and the step graph compiled (fullgraph, built by warmup): new
    prompts add no graph, and the tokens are HF greedy's; the gate's steps and an AR decoder's run as steps."""
    torch._dynamo.reset()
    target, model, processor = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=3) if drafted else None
    dec = glance_rt.Decoder(target, drafter, tree_budget=6, max_length=256, backend="compile", chunk=8,
                            device_round=True)
    before = unique_graphs()
    dec.warmup()
    warm = unique_graphs()
    # verify at 1, 7 and 8 (lookup) rows, draft, context, round, lookup rounds of 6 and 7 rows, step
    assert warm - before == (9 if drafted else 2)
    for prompt, new in [("Hi", 30), ("Count the objects, then name their colours, one by one.", 20)]:
        inputs = make_inputs("llama", processor, prompt=prompt, seed=new)
        res = dec.generate(max_new_tokens=new, **inputs)
        assert res.token_ids == hf_greedy(model, inputs, new) and res.stats.timings["tree"] == 0
        assert (res.stats.timings["round"] > 0) == drafted
    assert unique_graphs() == warm
