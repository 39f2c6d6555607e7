"""Batched rounds (glance_rt.round.batch): sequences decoded together commit exactly the tokens each gets
alone, on every architecture, with mixed prompt lengths and images, sequences finishing at different
rounds and joining as slots free, mixed sampling settings, the gate and prompt lookup; in exact numerics
a batched verify row has a one-sequence pass's bits."""

import json

import pytest
import torch

import glance_rt
from glance_rt.round.batch import Batch
from tests.conftest import called_nodes, extended, hf_greedy, tiny_target
from tests.tiny_models import ARCHS, TEXT_ARCHS, make_inputs, make_tiny

PROMPTS = ["Hi.", "Describe what you see in one short sentence, please, with care and in some detail.",
           "Count: one two three four five, one two three four five, one two three"]
NEW = (9, 16, 23)  # each request's max_new_tokens: they finish at different rounds


def requests(arch: str, processor) -> list[dict]:
    """Three requests of different lengths (VLMs: 0, 1 and 2 images)."""
    images = (0, 0, 0) if arch in TEXT_ARCHS else (0, 1, 2)
    return [make_inputs(arch, processor, prompt=p, n_images=n) for p, n in zip(PROMPTS, images, strict=True)]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_equals_hf_on_every_architecture(arch):
    """max_batch=2 over three requests: the third joins when the first leaves (continuous batching)."""
    target, model, processor = tiny_target(arch)
    reqs = requests(arch, processor)
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    dec = glance_rt.Decoder(target, drafter, tree_budget=8, gate=False, max_batch=2)
    results = Batch(dec).run([dict(r, max_new_tokens=n) for r, n in zip(reqs, NEW, strict=True)])
    for r, n, res in zip(reqs, NEW, results, strict=True):
        assert res.token_ids == hf_greedy(model, r, n)
        assert res.stats.rounds > 1 and res.stats.draft_passes == res.stats.rounds


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
@pytest.mark.parametrize("drafted", [True, False], ids=["tree", "ar"])
def test_mixed_sampling_in_one_batch_equals_each_alone(arch, drafted):
    """Greedy, seeded sampling (two settings), a repetition penalty and a stop string in one batch, with
    the gate and prompt lookup on (their defaults): each sequence == the same engine decoding it alone."""
    target, _, processor = tiny_target(arch)
    reqs = requests(arch, processor) + [make_inputs(arch, processor, prompt=PROMPTS[2], n_images=0)]
    samplings = [glance_rt.Sampling(), glance_rt.Sampling(do_sample=True, temperature=1.5, top_k=0, seed=7),
                 glance_rt.Sampling(do_sample=True, top_p=0.9, seed=3, repetition_penalty=1.2),
                 glance_rt.Sampling(repetition_penalty=1.3, stop=("e",))]
    drafter = glance_rt.init_drafter(target, block_size=5, seed=2) if drafted else None
    alone = glance_rt.Decoder(target, drafter, tree_budget=12)
    want = [alone.generate(max_new_tokens=20, sampling=s, **r).token_ids for r, s in zip(reqs, samplings, strict=True)]
    dec = glance_rt.Decoder(target, drafter, tree_budget=12, max_batch=4)
    got = Batch(dec).run([dict(r, sampling=s, max_new_tokens=20) for r, s in zip(reqs, samplings, strict=True)])
    assert [g.token_ids for g in got] == want
    assert want[1] != want[0]  # sampling took other tokens than greedy


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_exact_bf16_batch_equals_the_engines_own_autoregression(arch):
    """In exact numerics, a batch of GLANCE sequences in bf16 commits the same engine's one-sequence
    autoregressive tokens (a row's bits do not depend on the other sequences in the pass)."""
    model, processor = make_tiny(arch)
    target = glance_rt.load_target(model, processor=processor, dtype="bfloat16")
    reqs = requests(arch, processor)
    ar = glance_rt.Decoder(target, None, numerics="exact")
    want = [ar.generate(max_new_tokens=n, **r).token_ids for r, n in zip(reqs, NEW, strict=True)]
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    dec = glance_rt.Decoder(target, drafter, tree_budget=16, gate=False, numerics="exact", max_batch=3)
    got = Batch(dec).run([dict(r, max_new_tokens=n) for r, n in zip(reqs, NEW, strict=True)])
    assert [g.token_ids for g in got] == want


def test_exact_batched_verify_rows_have_the_single_pass_bits():
    """The verify pass of two sequences at once == each one's own pass, bit for bit, in exact numerics;
    and a planted leak (a sequence's rows attending the other slot) is caught."""
    from glance_rt.round.tree import build_tree

    target, _, processor = tiny_target("qwen2")
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    dec = glance_rt.Decoder(target, drafter, tree_budget=8, gate=False, lookup=0, numerics="exact", max_batch=2)
    passes, calls = dec.passes, []
    for slot, prompt in enumerate(PROMPTS[:2]):
        pre = dec.prefill_inputs(make_inputs("qwen2", processor, prompt=prompt))
        p = pre.embeds.shape[0]
        passes.prefill(pre.embeds[None], pre.positions[None], slot=slot)
        logits = torch.randn(3, target.parts.lm_head.weight.shape[0], generator=torch.Generator().manual_seed(slot))
        tree = build_tree(logits, 5 + slot, 8, False, None, (0, []))
        tokens, mask = torch.from_numpy(tree.tokens), torch.from_numpy(tree.mask)
        calls.append((slot, (tree, tokens, (torch.from_numpy(tree.depth) + p)[None], p, mask)))
    together = passes.verify_batch(calls)
    for (slot, args), got in zip(calls, together, strict=True):
        alone = passes.verify(*args, slot=slot)
        assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1]) and got[3] == alone[3]
    calls[1] = (0, calls[1][1])  # the second sequence's rows in the first one's slot: another prefix
    assert not torch.equal(passes.verify_batch(calls)[1][0], together[1][0])


def test_sequences_join_leave_and_cancel():
    """A cancelled sequence frees its slot at once; the request that takes it decodes as alone, and the
    sequence that kept running is unaffected."""
    target, model, processor = tiny_target("llama")
    reqs = requests("llama", processor)
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    batch = Batch(glance_rt.Decoder(target, drafter, tree_budget=8, max_batch=2))
    keep, drop = batch.add(20, **reqs[0]), batch.add(20, **reqs[1])
    tokens = {keep: [], drop: []}
    for _ in range(2):
        for ev in batch.step():
            tokens[ev.handle] += ev.tokens
    assert tokens[drop] and batch.full
    with pytest.raises(glance_rt.GlanceError, match="batch is full"):
        batch.add(5, **reqs[2])
    batch.cancel(drop)
    late = batch.add(20, **reqs[2])
    tokens[late] = []
    stats = {}
    while len(batch):
        for ev in batch.step():
            tokens[ev.handle] += ev.tokens
            if ev.done:
                stats[ev.handle] = ev.stats
    assert tokens[keep] == hf_greedy(model, reqs[0], 20) and tokens[late] == hf_greedy(model, reqs[2], 20)
    assert set(stats) == {keep, late} and stats[late].prompt_tokens == reqs[2]["input_ids"].shape[1]


def test_a_new_sequences_first_token_comes_out_before_the_round():
    """Time to first token: a step yields a joining sequence's prefill token before the batched passes
    run (the running sequence's round tokens come after)."""
    target, _, processor = tiny_target("llama")
    reqs = requests("llama", processor)
    batch = Batch(glance_rt.Decoder(target, glance_rt.init_drafter(target, block_size=4, seed=1), max_batch=2))
    first = batch.add(10, **reqs[0])
    list(batch.step())
    second = batch.add(10, **reqs[1])
    events = list(batch.step())
    assert [ev.handle for ev in events][:1] == [second] and len(events[0].tokens) == 1
    assert {ev.handle for ev in events[1:]} == {first, second}


def test_a_bad_request_ends_alone():
    target, model, processor = tiny_target("llama")
    reqs = requests("llama", processor)
    batch = Batch(glance_rt.Decoder(target, None, max_batch=2))
    good, bad = batch.add(6, **reqs[0]), batch.add(0, **reqs[1])  # max_new_tokens=0: refused in its first step
    events = list(batch.step())
    (ended,) = [ev for ev in events if ev.handle == bad]
    assert ended.done and isinstance(ended.error, glance_rt.GlanceError)
    assert not batch.full and len(batch) == 1
    tokens = [t for ev in events if ev.handle == good for t in ev.tokens]
    while len(batch):
        tokens += [t for ev in batch.step() for t in ev.tokens]
    assert tokens == hf_greedy(model, reqs[0], 6)


def test_batched_decoding_refuses_what_it_cannot_run():
    target, _, _ = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    for bad in (0, -1, 1.5):
        with pytest.raises(glance_rt.GlanceError, match="max_batch must be"):
            glance_rt.Decoder(target, drafter, max_batch=bad)
    with pytest.raises(glance_rt.GlanceError, match="eager or compile backend"):
        glance_rt.Decoder(target, glance_rt.init_eagle3(target, seed=0), max_batch=2)
    from glance_rt.engines.engine import build_engine

    with pytest.raises(glance_rt.GlanceError, match="EAGLE-3 heads take one sequence"):
        build_engine(target, glance_rt.init_eagle3(target, seed=0), "/tmp/never-built", backend="onnxruntime",
                     max_batch=2)
    with pytest.raises(glance_rt.GlanceError, match="device_round"):
        glance_rt.Decoder(target, drafter, backend="compile", max_batch=2, device_round=True)


def test_draft_pass_of_a_batch_equals_each_alone():
    """DraftPass.forward_batch: each sequence's draft logits as its own pass gives them (up to rounding)."""
    from glance_rt.round.draft import DraftPass

    target, _, _ = tiny_target("qwen3")
    drafter = glance_rt.init_drafter(target, block_size=4, seed=3)
    parts = target.parts
    dp = DraftPass(drafter, parts.text_model.embed_tokens, parts.lm_head, 64, slots=2)
    width = len(drafter.target_layer_ids) * parts.text_config.hidden_size
    feats = [torch.randn(m, width, generator=torch.Generator().manual_seed(m)) for m in (5, 9)]
    items = ((0, feats[0], 0, 11, 5), (1, feats[1], 0, 12, 9))
    together = dp.forward_batch(items)
    for (slot, f, start, bonus, block_start), got in zip(items, together, strict=True):
        torch.testing.assert_close(got, dp(f, start, bonus, block_start, slot), rtol=1e-5, atol=1e-5)


def test_static_batched_passes_attend_in_one_op_call_per_layer():
    """The static batched verify and draft passes (slots 0..S-1, trees padded to T rows) attend through ONE
    call of `glance::tree_attention` per layer over the whole batch ([S, heads, T, D]: what a GPU runs as
    one launch), not one per sequence."""
    target, _, _ = tiny_target("qwen2")
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    dec = glance_rt.Decoder(target, drafter, tree_budget=6, backend="compile", max_length=64, max_batch=3,
                            prepack=False)
    graphs, cfg = dec.passes.graphs, target.parts.text_config
    shapes = []

    def backend(gm, example_inputs):
        shapes.extend(tuple(n.meta["example_value"].shape) for n in called_nodes(gm)
                      if str(n.target).startswith("glance.tree_attention"))
        return gm.forward

    slots, t, head_dim = 3, 5, cfg.hidden_size // cfg.num_attention_heads
    masks = torch.ones(slots, t, t, dtype=torch.bool).tril()
    starts = torch.tensor([9, 20, 4])
    positions = (starts[:, None] + torch.arange(t))[None]  # [1, S, T]
    torch.compile(graphs.verify_batch, backend=backend, fullgraph=True)(
        torch.arange(slots * t).view(slots, t), positions, starts, masks, torch.arange(-1, t - 1).repeat(slots, 1))
    assert shapes == [(slots, cfg.num_attention_heads, t, head_dim)] * cfg.num_hidden_layers
    shapes.clear()
    r, width = graphs.ctx_rows, len(drafter.target_layer_ids) * cfg.hidden_size
    torch.compile(graphs.draft_batch, backend=backend, fullgraph=True)(
        torch.randn(slots, r, width), starts - r, torch.tensor([1, 2, 3]), starts)
    layers, heads = len(graphs.draft_pass.drafter.layers), graphs.draft_pass.drafter.config.num_attention_heads
    assert shapes == [(slots, heads, 4, graphs.draft_pass.drafter.config.head_dim)] * layers


def test_one_op_call_over_slots_equals_a_call_per_sequence():
    """TargetDecoder.forward_batch over slots 0..S-1 (one op call per layer, `SlotBatch`) == the same pass
    run segment by segment: logits, features and every cache row written, bit for bit."""
    from glance_rt.models.target import Segment

    target, _, _ = tiny_target("llama")
    dec = glance_rt.Decoder(target, None, max_length=48, max_batch=3, prepack=False)
    verifier = dec.passes.verifier
    gen = torch.Generator().manual_seed(5)
    for buf in verifier.cache.buffers():
        buf.copy_(torch.randn(buf.shape, generator=gen))
    t, starts = 4, (11, 0, 30)
    masks = [torch.rand(t, t, generator=gen).lt(0.5).tril() | torch.eye(t, dtype=torch.bool) for _ in starts]
    segments = tuple(Segment(i, i * t, t, s + torch.arange(t), m, 48)
                     for i, (s, m) in enumerate(zip(starts, masks, strict=True)))
    embeds = torch.randn(1, 3 * t, target.parts.text_config.hidden_size, generator=gen)
    positions = torch.cat([s.rows for s in segments])[None]
    before = [b.clone() for b in verifier.cache.buffers()]
    batched = verifier.forward_batch(embeds, positions, segments)
    after = [b.clone() for b in verifier.cache.buffers()]
    for b, saved in zip(verifier.cache.buffers(), before, strict=True):
        b.copy_(saved)
    each = verifier.run(embeds, positions, segments)  # a call per segment
    assert all(torch.equal(x, y) for x, y in zip(batched, each, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(after, verifier.cache.buffers(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(after, before, strict=True))  # the pass wrote rows


def test_decoders_on_one_target_share_its_prepared_weights():
    """A second Decoder (or a batch's slots) costs its caches: prepared weight copies are made once per
    target (`Target.layouts`) and shared; the caches grow with max_batch."""
    from glance_rt.models.linear import PackedLinear

    target, _, _ = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    one, two = (glance_rt.Decoder(target, drafter, prepack=True, max_length=64) for _ in range(2))
    q = [d.verifier.stacks[0][0].self_attn.q_proj for d in (one, two)]
    assert isinstance(q[0], PackedLinear) and q[0] is q[1]
    model, processor = make_tiny("llama")
    other = glance_rt.Decoder(glance_rt.load_target(model, processor=processor), None, prepack=True, max_length=64)
    assert other.verifier.stacks[0][0].self_attn.q_proj is not q[0]  # another target: its own
    wide = glance_rt.Decoder(target, drafter, prepack=True, max_length=64, max_batch=3)
    assert wide.cache_bytes == 3 * one.cache_bytes > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_compiled_batches_are_lossless_and_never_recompile(arch):
    """backend="compile", max_batch=3: a graph per (slots, rows) bucket, all compiled by warmup(); then
    batches that join, leave and mix trees, lookup rounds and one-row steps add no graph, and every
    sequence gets HF greedy's tokens."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    target, model, processor = tiny_target(arch)
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    dec = glance_rt.Decoder(target, drafter, tree_budget=6, backend="compile", chunk=8, max_length=256,
                            max_batch=3, prepack=False).warmup()
    warm = counters["stats"]["unique_graphs"]
    reqs = requests(arch, processor) + [make_inputs(arch, processor, prompt="Count: one two three one two three")]
    results = Batch(dec).run([dict(r, max_new_tokens=n) for r, n in zip(reqs, (*NEW, 18), strict=True)])
    for r, n, res in zip(reqs, (*NEW, 18), results, strict=True):
        assert res.token_ids == hf_greedy(model, r, n)
    assert counters["stats"]["unique_graphs"] == warm


def test_a_batched_pass_is_charged_to_its_sequences_by_what_they_add():
    """The draft gate weighs a sequence's rounds by its share of each batched pass: a draft pass evenly;
    a verify pass by tree rows over a fixed part fitted on the recent passes (seconds = a + b * rows)."""
    from glance_rt.round.batch import _Sequence
    from glance_rt.round.loop import Call

    target, _, _ = tiny_target("llama")
    batch = Batch(glance_rt.Decoder(target, None, max_batch=2))

    def seqs(*rows):
        return [_Sequence(i, i, pending=Call("verify", (None, torch.zeros(r)))) for i, r in enumerate(rows)]

    a, b = seqs(9, 1)
    batch._share("verify", [a, b], 0.6)  # no fit yet: by rows
    assert a.spent == pytest.approx(0.54) and b.spent == pytest.approx(0.06)
    for total in (10, 20, 40):  # passes on the line 0.5 + 0.01 * rows
        batch._share("verify", seqs(total - 1, 1), 0.5 + 0.01 * total)
    a, b = seqs(9, 1)
    batch._share("verify", [a, b], 0.6)
    assert a.spent == pytest.approx(0.25 + 0.09) and b.spent == pytest.approx(0.25 + 0.01)
    a, b = seqs(9, 1)
    batch._share("draft", [a, b], 0.3)
    assert a.spent == b.spent == pytest.approx(0.15)


@pytest.mark.full
def test_an_aoti_engine_built_for_batches_decodes_them(tmp_path):
    """`build-engine --max-batch 2` (aoti): the batched graphs are packages of the engine; a load runs a
    Decoder of that batch, whose Batch gives every sequence HF greedy's tokens (three requests, two
    slots: one joins as another leaves); another max_batch asked is refused."""
    from glance_rt.engines.engine import build_engine

    target, model, processor = tiny_target("llama")
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    out = build_engine(target, drafter, tmp_path / "e", budgets=(6,), max_len=128, chunk=8, progress=False,
                       flavor="shared", max_batch=2)
    graphs = json.loads((out / "manifest.json").read_text())["graphs"]
    assert {"verify_batch-2x7", "draft_batch-2"} <= set(graphs)
    dec = glance_rt.Decoder.from_engine(out, target, drafter, gate=False)
    assert dec.max_batch == 2 and dec.passes.batches
    reqs = requests("llama", processor)
    results = Batch(dec).run([dict(r, max_new_tokens=n) for r, n in zip(reqs, NEW, strict=True)])
    for r, n, res in zip(reqs, NEW, results, strict=True):
        assert res.token_ids == hf_greedy(model, r, n)
    with pytest.raises(glance_rt.GlanceError, match="built for batches of 2"):
        glance_rt.Decoder.from_engine(out, target, drafter, max_batch=1)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["cache_layout"]  # a batched engine built before the caches became slot-major
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(glance_rt.GlanceError, match="slot-major.*rebuild it"):
        glance_rt.Decoder.from_engine(out, target, drafter)


@pytest.mark.full
@pytest.mark.parametrize("arch", ["llama", extended("qwen2_5_vl")])
def test_an_onnxruntime_engine_built_for_batches_decodes_them(arch, tmp_path):
    """`build-engine --backend onnxruntime --max-batch 3`: the batched passes are three ONNX graphs whose
    slots (and rows) are symbolic, `verify_batch` (every (slots, rows) bucket), `verify_batch-1` (batched
    AR steps) and `draft_batch`, each one session bound once per bucket; a Batch over the engine gives
    every sequence HF greedy's tokens (a VLM's images and M-RoPE positions included); an engine without a
    drafter batches its AR steps through `verify_batch-1`."""
    from glance_rt.engines.engine import build_engine

    target, model, processor = tiny_target(arch)
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    prompts = requests(arch, processor)
    reqs = [dict(r, max_new_tokens=n) for r, n in zip(prompts, NEW, strict=True)]
    out = build_engine(target, drafter, tmp_path / "e", backend="onnxruntime", budgets=(0, 4, 6), max_len=128,
                       chunk=8, progress=False, max_batch=3)
    graphs = json.loads((out / "manifest.json").read_text())["graphs"]
    assert {k: (g.get("slots"), g.get("rows")) for k, g in graphs.items() if "_batch" in k} == {
        "verify_batch": ([2, 3], [5, 7]), "verify_batch-1": ([2, 3], [1]), "draft_batch": ([2, 3], None)}
    assert graphs["verify_batch"]["inputs"][0][1] == ["slots", "rows"]
    dec = glance_rt.Decoder.from_engine(out, target, drafter, gate=False)
    assert dec.max_batch == 3 and dec.passes.batches
    runs = dec.passes.fns["verify_batch"].buckets
    assert set(runs) == {(s, t) for s in (2, 3) for t in (1, 5, 7)}
    assert len({id(runs[s, t].sess) for s in (2, 3) for t in (5, 7)}) == 1  # one session for every bucket
    want = [hf_greedy(model, r, n) for r, n in zip(prompts, NEW, strict=True)]
    assert [res.token_ids for res in Batch(dec).run(reqs)] == want
    if arch == "llama":
        ar = build_engine(target, None, tmp_path / "ar", backend="onnxruntime", max_len=128, chunk=8,
                          progress=False, max_batch=2)
        assert [res.token_ids for res in Batch(glance_rt.Decoder.from_engine(ar, target)).run(reqs)] == want


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
@pytest.mark.parametrize("backend", ["eager", "compile"])
def test_a_prompt_prefilled_in_pieces_decodes_as_in_one_pass(arch, backend):
    """Decoder(prefill_chunk=C): the prompt in pieces of C rows (a VLM's image rows cut through, the
    compiled prefill graph's chunk not a divisor of C) gives HF greedy's tokens alone and batched."""
    torch._dynamo.reset()  # compiled graphs of earlier tests' decoders count toward dynamo's recompile limit
    target, model, processor = tiny_target(arch)
    reqs = requests(arch, processor)
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    kw = dict(tree_budget=6, backend=backend, chunk=8, max_length=256, prefill_chunk=5, prepack=False)
    alone = glance_rt.Decoder(target, drafter, **kw)
    results = Batch(glance_rt.Decoder(target, drafter, max_batch=3, **kw)).run(
        [dict(r, max_new_tokens=n) for r, n in zip(reqs, NEW, strict=True)])
    for r, n, res in zip(reqs, NEW, results, strict=True):
        want = hf_greedy(model, r, n)
        assert alone.generate(max_new_tokens=n, **r).token_ids == want and res.token_ids == want
    assert max(r["input_ids"].shape[1] for r in reqs) > 3 * 5  # several pieces
    for bad in (0, -2, 2.5):
        with pytest.raises(glance_rt.GlanceError, match="prefill_chunk must be"):
            glance_rt.Decoder(target, drafter, prefill_chunk=bad)


def test_a_long_prompt_joining_is_prefilled_between_the_running_sequences_rounds():
    """With prefill_chunk, a sequence joining while another decodes is prefilled C prompt rows a step,
    and the running sequence commits tokens in each of those steps (without it, the join's whole
    prefill runs in one step); a batch with no one decoding prefills its joiners whole in the first
    step; every sequence's tokens == HF greedy."""
    target, model, processor = tiny_target("llama")
    long = make_inputs("llama", processor, prompt=" ".join(["one two three four five six"] * 6))
    short = requests("llama", processor)[0]
    drafter = glance_rt.init_drafter(target, block_size=4, seed=1)
    p = long["input_ids"].shape[1]
    for chunk in (8, None):
        batch = Batch(glance_rt.Decoder(target, drafter, tree_budget=6, gate=False, max_batch=2, prefill_chunk=chunk))
        running = batch.add(40, **short)
        tokens = {running: [t for ev in batch.step() for t in ev.tokens]}
        joining = batch.add(12, **long)
        tokens[joining] = []
        steps_to_first = 0
        while not tokens[joining]:
            events = list(batch.step())
            steps_to_first += 1
            for ev in events:
                tokens[ev.handle] += ev.tokens
            assert [t for ev in events if ev.handle == running for t in ev.tokens]  # it never stalls
        assert steps_to_first == (-(-p // chunk) if chunk else 1)
        while len(batch):
            for ev in batch.step():
                tokens[ev.handle] += ev.tokens
        assert tokens[running] == hf_greedy(model, short, 40) and tokens[joining] == hf_greedy(model, long, 12)
    batch = Batch(glance_rt.Decoder(target, drafter, max_batch=2, prefill_chunk=8))
    first, second = batch.add(5, **long), batch.add(5, **short)
    firsts = [ev.handle for ev in batch.step() if ev.tokens]
    assert first in firsts and second in firsts  # no one decoding: both prompts whole in the first step
