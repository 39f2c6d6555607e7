"""Decoding with an EAGLE-3 head: the head's own draft passes grow EAGLE's dynamic tree and
glance-rt verifies it. Every output is the target's (HF greedy; seed-exact sampling equals the same
engine's AR sampling) on all nine architectures; each tree node's score is the head's log-probability
of its path, recomputed from scratch; the context rows the loop hands the head are the committed ones."""

import json

import pytest
import torch

import glance_rt
from glance_rt.models.drafter import rope, rope_tables
from glance_rt.models.eagle3 import Eagle3Drafter, init_eagle3
from tests.conftest import hf_greedy, tiny_target
from tests.test_eagle3 import causal_attend
from tests.tiny_models import ARCHS, VLM_ARCHS, make_inputs

NEW = 20


def eagle3(target, depth=4, top_k=3, seed=0, vocab=None, norm_before_residual=False) -> Eagle3Drafter:
    layers = target.text_config.num_hidden_layers
    ids = (0, layers // 2, layers - 1)  # the tiny targets have too few layers for EAGLE-3's defaults
    return init_eagle3(target, draft_vocab_size=vocab, seed=seed, depth=depth, top_k=top_k, target_layer_ids=ids,
                       norm_before_residual=norm_before_residual)


def case(arch):
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    return target, model, inputs


# vLLM's norm_before_residual drafts other tokens (test_eagle3's reference tests prove which); decoding with
# it stays HF greedy's, shown on one architecture
@pytest.mark.parametrize(("arch", "norm_before_residual"), [(a, False) for a in ARCHS] + [("llama", True)])
def test_eagle3_trees_and_chains_give_hf_greedy(arch, norm_before_residual):
    target, model, inputs = case(arch)
    ref = hf_greedy(model, inputs, NEW)
    drafter = eagle3(target, norm_before_residual=norm_before_residual)
    for kw in ({"tree_budget": 10}, {"chain": True}):
        dec = glance_rt.Decoder(target, drafter, max_length=256, gate=False, **kw)
        out = dec.generate(max_new_tokens=NEW, **inputs)
        assert out.token_ids == ref, kw
        assert out.stats.draft_passes >= drafter.depth  # a pass per depth each drafted round
    assert glance_rt.Decoder(target, drafter, chain=True, max_length=256).tree_budget == drafter.depth


@pytest.mark.parametrize("budget,depth,top_k,vocab", [(1, 1, 1, None), (6, 2, 4, 40), (24, 5, 2, None), (40, 3, 5, 60)])
def test_eagle3_budgets_depths_and_draft_vocabularies(budget, depth, top_k, vocab):
    target, model, inputs = case("qwen2")
    ref = hf_greedy(model, inputs, NEW)
    drafter = eagle3(target, depth=depth, top_k=top_k, vocab=vocab, seed=budget)
    dec = glance_rt.Decoder(target, drafter, tree_budget=budget, max_length=256)  # the gate on
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == ref


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_eagle3_sampling_equals_the_engines_own(arch):
    target, _, inputs = case(arch)
    sampling = glance_rt.Sampling(do_sample=True, temperature=0.9, top_k=20, seed=7)
    ar = glance_rt.Decoder(target, None, max_length=256).generate(max_new_tokens=NEW, sampling=sampling, **inputs)
    dec = glance_rt.Decoder(target, eagle3(target), tree_budget=12, max_length=256, gate=False)
    assert dec.generate(max_new_tokens=NEW, sampling=sampling, **inputs).token_ids == ar.token_ids


def scratch_log_probs(drafter: Eagle3Drafter, embed, feats, tokens, path) -> torch.Tensor:
    """The head's draft log-probs after `path` (target ids drafted after the root), from scratch: a causal
    pass over every row per step, no cache; the context rows' states are fc(features), each path row's
    the previous row's output. tokens: the committed tokens, the root last."""
    head, c = drafter.head, drafter.head.config
    inv_freq, scaling = rope(c)
    states, ids = list(head.fuse(feats)), list(tokens[1:])  # each context row: its state, its next token
    for tok in [None, *path]:
        if tok is not None:
            states.append(h[0, -1])  # noqa: F821 (the previous step's output)
            ids.append(tok)
        cos, sin = rope_tables(inv_freq, torch.arange(len(states)), feats.dtype, scaling)
        h, logits = head(embed(torch.tensor(ids))[None], torch.stack(states)[None], cos, sin, causal_attend)
    return torch.log_softmax(logits[0, -1].float(), -1)


def scratch_candidates(drafter: Eagle3Drafter, embed, feats, tokens):
    """EAGLE's dynamic tree written out plainly over `scratch_log_probs`: every candidate in drafting
    order -> (scores, target ids, parent candidates) (ties: the earlier candidate, a stable sort)."""
    head, k = drafter.head, drafter.top_k
    tid = head.target_ids

    def best(scores, n):
        return torch.sort(scores, descending=True, stable=True).indices[:n].tolist()

    lp = scratch_log_probs(drafter, embed, feats, tokens, [])
    cands = [(float(lp[i]), int(tid(torch.tensor(i))), -1, [int(tid(torch.tensor(i)))]) for i in best(lp, k)]
    beam = list(range(len(cands)))
    for _ in range(2, drafter.depth + 1):
        first = len(cands)
        for b in beam:
            score, _, _, path = cands[b]
            lp = scratch_log_probs(drafter, embed, feats, tokens, path)
            for i in best(lp, k):
                t = int(tid(torch.tensor(i)))
                cands.append((score + float(lp[i]), t, b, [*path, t]))
        beam = [first + j for j in best(torch.tensor([c[0] for c in cands[first:]]), k)]
    return torch.tensor([c[0] for c in cands]), [c[1] for c in cands], [c[2] for c in cands]


@pytest.mark.parametrize("depth,top_k,budget", [(3, 3, 12), (4, 2, 7)])
def test_the_pass_grows_the_tree_written_out_from_scratch(depth, top_k, budget):
    """The pass's cache, positions and ancestor masks: its candidates are EAGLE's over the head's
    log-probabilities recomputed from scratch for every path (no cache, plain causal passes), score
    for score, and its tree holds the budget's best of them."""
    from glance_rt.round.eagle3 import Eagle3Pass

    target, _, inputs = case("llama")
    drafter = eagle3(target, depth=depth, top_k=top_k, vocab=70, seed=4)
    embed = target.parts.text_model.embed_tokens
    p = inputs["input_ids"].shape[1]
    with torch.no_grad():
        hidden = target.hf_model(**inputs, output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i + 1][0] for i in drafter.target_layer_ids], -1)  # [p, 3H]
        tokens = torch.cat([inputs["input_ids"][0], torch.tensor([5])])  # the prompt, then a root token
        pas = Eagle3Pass(drafter, embed, 128)
        score, ids, parent, passes = pas.grow(feats, tokens[1:], 0, p, budget, False)
        want_score, want_ids, want_parent = scratch_candidates(drafter, embed, feats, tokens.tolist())
        tree, _ = pas.draft_tree(feats, tokens[1:], 0, 5, p, budget, False)
    assert passes == depth and ids.tolist() == want_ids and parent.tolist() == want_parent
    torch.testing.assert_close(score, want_score, atol=1e-5, rtol=1e-5)
    keep = sorted(torch.sort(want_score, descending=True, stable=True).indices[:budget].tolist())
    assert tree.size == budget + 1 and tree.tokens[1:].tolist() == [want_ids[c] for c in keep]


def test_the_loop_hands_the_head_the_committed_rows():
    """Context rows are contiguous across drafted rounds and each row's token is the committed token
    after it, the root last."""
    target, _, inputs = case("qwen3")
    dec = glance_rt.Decoder(target, eagle3(target), tree_budget=8, max_length=256)
    calls, draft_tree = [], dec.passes.draft_tree

    def spy(feats, tokens, ctx_start, bonus, block_start, budget, chain):
        calls.append((feats.shape[0], tokens.clone(), ctx_start, bonus, block_start))
        return draft_tree(feats, tokens, ctx_start, bonus, block_start, budget, chain)

    dec.passes.draft_tree = spy
    out = dec.generate(max_new_tokens=NEW, **inputs)
    ids = torch.cat([inputs["input_ids"][0], torch.tensor(out.token_ids)])
    assert calls and calls[0][2] == 0
    for (m, tokens, start, bonus, block_start), nxt in zip(calls, [*calls[1:], None], strict=True):
        assert m == block_start - start == tokens.shape[0]
        assert torch.equal(tokens.cpu(), ids[start + 1 : block_start + 1]) and int(tokens[-1]) == bonus
        if nxt is not None:
            assert nxt[2] <= block_start < nxt[4]  # the next round's context starts at or before this root


@pytest.mark.parametrize("steps", [1, 3])
def test_training_time_test_is_the_drafting_it_trains(steps):
    """Row t of the unrolled training pass at step k gives the log-probs the head drafts with after the
    path ids[t+2 .. t+1+k] from context rows [0, t] (recomputed from scratch), so a head trained here
    drafts as it was trained."""
    from glance_rt.tools.training.eagle3 import ttt_forward, ttt_loss

    target, _, inputs = case("llama")
    drafter = eagle3(target, depth=3, vocab=70, seed=6)
    embed = target.parts.text_model.embed_tokens
    ids = inputs["input_ids"][0][:14]
    with torch.no_grad():
        hidden = target.hf_model(input_ids=ids[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i + 1][0] for i in drafter.target_layer_ids], -1)  # [L, 3H]
        outs = ttt_forward(drafter.head, embed.weight, feats, ids, steps)
        for k, state in enumerate(outs):
            lp = torch.log_softmax(drafter.head.lm_head(drafter.head.norm(state)).float(), -1)
            for t in (0, 4, 13 - 2 - k):
                path = ids[t + 2 : t + 2 + k].tolist()
                want = scratch_log_probs(drafter, embed, feats[: t + 1], ids[: t + 2].tolist(), path)
                torch.testing.assert_close(lp[t], want, atol=1e-5, rtol=1e-5)
        loss, weight, accepted, chains = ttt_loss(drafter.head, embed.weight, feats, ids, 5, steps, 0.8)
    assert weight > 0 and torch.isfinite(loss) and chains == 13 - 1 - 3 and chains <= accepted <= chains * (steps + 1)


def test_training_time_test_trains():
    """A few optimizer steps on one sequence lower the loss (gradients reach every weight)."""
    from glance_rt.tools.training.eagle3 import ttt_loss

    target, _, inputs = case("qwen2")
    drafter = eagle3(target, depth=3, seed=7)
    head = drafter.head.requires_grad_(True).train()
    ids = inputs["input_ids"][0]
    with torch.no_grad():
        hidden = target.hf_model(input_ids=ids[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i + 1][0] for i in drafter.target_layer_ids], -1)
    embed = target.parts.text_model.embed_tokens.weight.detach()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss, weight, _, _ = ttt_loss(head, embed, feats, ids, 1, 3, 0.8)
        opt.zero_grad()
        (loss / weight).backward()
        assert all(p.grad is not None for p in head.parameters())
        opt.step()
        losses.append(float(loss.detach() / weight))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
@pytest.mark.parametrize("plan", ["mixed", "onednn", "slow-depth"])
def test_eagle3_head_runs_the_kernels_chosen_for_it_and_stays_exact(arch, plan, tmp_path):
    """The EAGLE-3 head gets the draft pass's kernel machinery (a module set per row class: a depth pass is
    top_k rows, the first context pass the prompt's), checked whole against torch's own linear: the
    tokens stay HF greedy whichever kernels run."""
    from glance_rt.models.kernels import PREFILL_ROWS, KernelTuner
    from tests.test_kernels import FakePassTimer, FakeTimer, mixed, mixed_transposed

    target, model, inputs = case(arch)
    drafter = eagle3(target, depth=3, top_k=3)
    wins = (mixed, mixed_transposed) if plan == "mixed" else (lambda o, i, r: True,)
    passes = FakePassTimer(*(["eagle3@3:"] if plan == "slow-depth" else []))
    tuner = KernelTuner(FakeTimer(*wins), cache=tmp_path / "k.json", pass_timer=passes)
    dec = glance_rt.Decoder(target, drafter, tree_budget=6, max_length=256, gate=False, prepack=tuner)
    assert {k.split(":")[0] for k in passes.keys if k.startswith("eagle3")} == {f"eagle3@{PREFILL_ROWS}", "eagle3@3"}
    draft = dec.kernel_choices["draft"]
    kinds = {k for v in draft.values() for k in (v.values() if isinstance(v, dict) else [v])}
    if plan == "mixed":
        assert len(kinds) > 1
    elif plan == "onednn":
        assert kinds == {"onednn"}
    else:  # the depth class ran no faster whole: torch's own there, the prefill class keeps oneDNN
        assert all(v == {3: "mkl", PREFILL_ROWS: "onednn"} for v in draft.values())
    assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)


@pytest.mark.full
@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_onnxruntime_engine_of_an_eagle3_head_is_lossless(arch, tmp_path):
    """ONNX export carries the head: its context graph (C rows) and a depth graph per beam width, each
    taking the head's cache as inputs and returning the rows it wrote (no glance.TreeAttention node: the
    head attends its own cache through a [k, L] mask, as in every backend). Through ONNX Runtime its
    tokens are HF greedy's, for trees and prompts longer than the chunk; another top_k is refused."""
    from glance_rt.engines.engine import build_engine

    target, model, processor = tiny_target(arch)
    drafter = eagle3(target, depth=3, top_k=3)
    out = tmp_path / "e"
    build_engine(target, drafter, out, backend="onnxruntime", budgets=(0, 6), max_len=192, chunk=8, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert m["eagle3"] == {"depth": 3, "top_k": 3} and m["lookup_budget"] is None
    assert set(m["graphs"]) == {"prefill", "verify-1", "verify-7", "eagle3_context", "eagle3_depth-3"}
    assert m["graphs"]["eagle3_depth-3"]["tree_attention_nodes"] == 0
    assert m["graphs"]["verify-7"]["tree_attention_nodes"] == target.parts.text_model.config.num_hidden_layers
    dec = glance_rt.Decoder.from_engine(out, target, drafter)
    assert dec.backend.name == "onnxruntime" and dec.method_name == "eagle3-6@onnxruntime"
    vlm = arch in VLM_ARCHS
    for prompt, n_images in (("Hello", 0), ("A longer prompt, longer than the engine's chunk of eight rows.", vlm)):
        inputs = make_inputs(arch, processor, prompt=prompt, n_images=int(n_images))
        res = dec.generate(max_new_tokens=NEW, **inputs)
        assert res.token_ids == hf_greedy(model, inputs, NEW), prompt
    assert res.stats.draft_passes >= drafter.depth
    # an untrained head accepts little, so compare the graphs themselves: each writes the head's cache rows
    # and returns the states and log-probs that the torch graph it was exported from gives
    passes, cache = dec.passes, dec.passes.graphs.draft_pass.cache
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(8, 3 * target.parts.text_model.config.hidden_size, generator=g)
    tokens = torch.randint(0, 90, (8,), generator=g)
    states = torch.randn(3, drafter.head.config.hidden_size, generator=g)
    visible = torch.zeros(3, cache.max_len, dtype=torch.bool)
    visible[:, :16] = True
    visible[torch.arange(3), 24 + torch.arange(3)] = True
    calls = [("eagle3_context", (feats, tokens, 10 + torch.arange(8))),
             ("eagle3_depth", (tokens[:3], states, torch.full((3,), 18), 24 + torch.arange(3), visible))]
    for name, args in calls:
        got = [t.clone() for t in passes.fns[name](*args)] + [b.clone() for b in cache.buffers()]
        with torch.no_grad():
            want = [*getattr(passes.graphs, name)(*args), *cache.buffers()]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert cache.k0[0, :, 10:18].abs().sum() > 0 and cache.k0[0, :, 24:27].abs().sum() > 0
    with pytest.raises(glance_rt.GlanceError, match="'top_k': 2} here"):
        glance_rt.Decoder.from_engine(out, target, eagle3(target, depth=3, top_k=2))


@pytest.mark.full
def test_aoti_engine_of_an_eagle3_head_is_lossless(tmp_path):
    """An aoti engine carries the head: its context package (C rows) and a depth package per beam width,
    the tree grown on the host between them. Its tokens are HF greedy's; a head drafting another top_k,
    or other weights, is refused with what differs."""
    from glance_rt.engines.engine import build_engine

    target, model, tok = tiny_target("llama")
    drafter = eagle3(target, depth=3, top_k=3)
    out = tmp_path / "e"
    build_engine(target, drafter, out, budgets=(0, 6), max_len=192, chunk=8, progress=False, flavor="shared")
    m = json.loads((out / "manifest.json").read_text())
    assert m["eagle3"] == {"depth": 3, "top_k": 3} and m["lookup_budget"] is None
    assert set(m["graphs"]) == {"prefill", "verify-1", "verify-7", "eagle3_context", "eagle3_depth-3"}
    dec = glance_rt.Decoder.from_engine(out, target, drafter)
    assert dec.backend.name == "aoti" and dec.method_name == "eagle3-6@aoti"
    for prompt in ("Hello", "A longer prompt, longer than the engine's chunk of eight rows."):
        inputs = make_inputs("llama", tok, prompt=prompt)
        out_ = dec.generate(max_new_tokens=NEW, **inputs)
        assert out_.token_ids == hf_greedy(model, inputs, NEW), prompt
    assert out_.stats.draft_passes >= drafter.depth
    with pytest.raises(glance_rt.GlanceError, match="'top_k': 2} here"):
        glance_rt.Decoder.from_engine(out, target, eagle3(target, depth=3, top_k=2))
    with pytest.raises(glance_rt.GlanceError, match="drafter weights differ"):
        glance_rt.Decoder.from_engine(out, target, eagle3(target, depth=3, top_k=3, seed=5))


@pytest.mark.full
@pytest.mark.parametrize("backend", ["aoti", "onnxruntime"])
def test_cli_builds_and_runs_an_eagle3_engine(backend, tmp_path_factory, tmp_path):
    """`build-engine --drafter` an EAGLE-3 folder: no lookup bucket (its rounds run none); `generate
    --engine` loads the head from the manifest's source, drafting as built, and prints HF's text."""
    from click.testing import CliRunner

    from glance_rt.cli import main
    from glance_rt.models.eagle3 import save_eagle3
    from tests.test_cli import model_folder
    from tests.test_engines import assert_cli_generates_hf_text

    path = model_folder("qwen3", str(tmp_path_factory.mktemp("models")))
    target = glance_rt.load_target(path)
    save_eagle3(eagle3(target).head, tmp_path / "head")
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["build-engine", "--target", path, "--drafter", str(tmp_path / "head"),
                                       "--tree-budget", "4", "--max-length", "128", "--chunk", "16", "--out", str(out),
                                       "--backend", backend])
    assert result.exit_code == 0, result.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["budgets"] == [4] and m["lookup_budget"] is None and m["eagle3"] == {"depth": 6, "top_k": 8}
    assert_cli_generates_hf_text(target, out)


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_compiled_eagle3_passes_are_lossless_and_never_recompile(arch):
    """backend="compile": the head's context pass (chunks of C rows) and its depth passes (k rows, a mask
    over the whole cache) are fixed-shape compiled graphs; trees and chains give HF greedy's tokens, and
    prompts of other lengths add no graph after the first generation."""
    from tests.test_passes import unique_graphs

    torch._dynamo.reset()
    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor, n_images=1 if arch in VLM_ARCHS else 0)
    drafter = eagle3(target, depth=3, top_k=3)
    for kw in ({"tree_budget": 6}, {"chain": True}):
        dec = glance_rt.Decoder(target, drafter, max_length=256, gate=False, backend="compile", chunk=8, **kw)
        before = unique_graphs()
        assert dec.generate(max_new_tokens=NEW, **inputs).token_ids == hf_greedy(model, inputs, NEW)
        warm = unique_graphs()
        if "tree_budget" in kw:  # verify, context, depth (k rows): one graph each (prefill runs eagerly); the
            assert warm - before == 3  # chain's decoder may reuse the context graph (same code and shapes)
        vlm = arch in VLM_ARCHS
        for prompt, n_images, new in [("Hi", 0, 20), ("Count the objects, then name their colours, one by one.",
                                                       2 if vlm else 0, 14)]:
            other = make_inputs(arch, processor, prompt=prompt, n_images=n_images, seed=new)
            assert dec.generate(max_new_tokens=new, **other).token_ids == hf_greedy(model, other, new)
        assert unique_graphs() == warm
