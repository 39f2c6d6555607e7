"""The device tree builder (static shapes, no host sync) equals the host `build_tree` bit for bit:
tokens, parent, depth and mask, on any logits (ties, -inf, NaN), budget, depth, vocabulary size,
vocab map, prompt-lookup chain and chain mode; it compiles as one graph and runs on 'meta' tensors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glance_rt.round.device_tree import build_tree_device, lookup_tensors
from glance_rt.round.tree import build_tree, lookup_tree

FIELDS = ("tokens", "parent", "depth", "mask")


def assert_same(logits, root, budget, chain=False, vocab=None, lookup=(0, ())):
    """build_tree and build_tree_device (with `lookup_tensors`) give identical arrays."""
    host = build_tree(logits, root, budget, chain, vocab=vocab, lookup=lookup)
    c, n = lookup_tensors(lookup, logits.shape[0], budget, chain)
    dev = build_tree_device(logits, torch.tensor(root), budget, chain,
                            vocab=None if vocab is None else torch.from_numpy(vocab), lookup_chain=c, lookup_len=n)
    for f in FIELDS:
        got = getattr(dev, f)
        assert got.dtype == (torch.bool if f == "mask" else torch.int64), f
        np.testing.assert_array_equal(got.numpy(), getattr(host, f), err_msg=f)
    return host


def make_logits(seed: int, depth: int, vocab: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct values: many equal scores, the heap's counter decides
        x = torch.randint(-2, 2, (depth, vocab), generator=g).float()
    elif kind == "halves":  # exact binary fractions: sums tie across depths too
        x = torch.randint(-4, 1, (depth, vocab), generator=g).float() * 0.5
    else:
        x = torch.randn(depth, vocab, generator=g) * 4
    if kind == "nonfinite":  # -inf entries, whole -inf rows (NaN log-probs) and NaN logits
        r = torch.rand(depth, vocab, generator=g)
        x = x.masked_fill(r < 0.3, float("-inf")).masked_fill(r > 0.93, float("nan"))
        x[torch.rand(depth, generator=g) < 0.2] = float("-inf")
    return x


def make_lookup(seed, logits, vocab, ngram, length, hit):
    """A chain that follows the drafter's top-1 path with probability `hit` (shared nodes), else random."""
    g = torch.Generator().manual_seed(seed + 1)
    top1 = logits.float().nan_to_num(nan=-1e30).argmax(-1).numpy()
    ids = top1 if vocab is None else vocab[top1]
    pool = int(logits.shape[1]) if vocab is None else vocab
    toks = []
    for i in range(length):
        if i < len(ids) and float(torch.rand((), generator=g)) < hit:
            toks.append(int(ids[i]))
        else:
            toks.append(int(np.random.default_rng(seed + i).choice(pool)))
    return ngram, toks


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 10**6), depth=st.integers(1, 16), n_vocab=st.integers(1, 50), budget=st.integers(1, 40),
       kind=st.sampled_from(["ties", "halves", "normal", "nonfinite"]), mapped=st.booleans(),
       ngram=st.integers(0, 8), length=st.integers(0, 24), hit=st.sampled_from([0.0, 0.7, 1.0]),
       chain=st.booleans(), root=st.integers(0, 1000))
def test_device_equals_host(seed, depth, n_vocab, budget, kind, mapped, ngram, length, hit, chain, root):
    logits = make_logits(seed, depth, n_vocab, kind)
    vocab = None
    if mapped:  # a draft vocabulary: distinct ids of a larger target vocabulary
        vocab = np.random.default_rng(seed).permutation(4 * n_vocab + 7)[:n_vocab].astype(np.int64)
    lookup = make_lookup(seed, logits, vocab, ngram, length, hit)
    assert_same(logits, root, budget, chain, vocab, lookup)


@pytest.mark.parametrize("n_vocab", [1, 2, 3])
@pytest.mark.parametrize("depth", [1, 2, 5])
@pytest.mark.parametrize("budget", [1, 4, 40])
def test_small_vocab_pads(n_vocab, depth, budget):
    """Fewer prefixes than the budget: the frontier empties and the rest are copies of node 1."""
    for seed in range(3):
        assert_same(make_logits(seed, depth, n_vocab, "ties"), 7, budget)
        assert_same(make_logits(seed, depth, n_vocab, "normal"), 7, budget, chain=True)


@pytest.mark.parametrize("fill", [float("-inf"), float("nan"), 0.0])
def test_constant_rows(fill):
    """All-equal (or all non-finite) rows: every score ties, pop order is push order."""
    logits = torch.full((6, 9), fill)
    for budget in (1, 9, 30):
        assert_same(logits, 1, budget)
        assert_same(logits, 1, budget, lookup=(2, [0, 1, 2, 3]))


def test_lookup_fills_budget_is_lookup_tree():
    """A chain that takes every row (a >= 5-token match): the tree is `lookup_tree`, whatever the draft."""
    logits = make_logits(0, 4, 20, "normal")
    chain = list(range(10, 22))
    host = assert_same(logits, 3, 8, lookup=(6, chain))
    np.testing.assert_array_equal(host.tokens, lookup_tree(3, 8, chain).tokens)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_logit_dtypes(dtype):
    for seed in range(4):
        assert_same(make_logits(seed, 5, 30, "normal").to(dtype), 2, 12, lookup=(3, [1, 2, 3, 4, 5]))


def test_budget_zero_is_root_alone():
    tree = build_tree_device(torch.zeros(3, 5), 9, 0)
    assert tree.tokens.tolist() == [9] and tree.parent.tolist() == [-1] and tree.depth.tolist() == [0]
    assert tree.mask.tolist() == [[True]]


def test_no_lookup_args_means_none():
    logits = make_logits(3, 4, 12, "ties")
    host = build_tree(logits, 5, 10)
    dev = build_tree_device(logits, 5, 10)
    for f in FIELDS:
        np.testing.assert_array_equal(getattr(dev, f).numpy(), getattr(host, f))


def test_meta_tensors_never_sync():
    """On 'meta' tensors (no data) any .item(), .cpu(), data-dependent branch or shape would raise."""
    meta = torch.device("meta")
    logits = torch.empty(5, 40, device=meta)
    chain, n = torch.empty(12, dtype=torch.int64, device=meta), torch.empty((), dtype=torch.int64, device=meta)
    vocab = torch.empty(40, dtype=torch.int64, device=meta)
    tree = build_tree_device(logits, torch.empty((), dtype=torch.int64, device=meta), 12, vocab=vocab,
                             lookup_chain=chain, lookup_len=n)
    assert tree.tokens.shape == tree.parent.shape == tree.depth.shape == (13,) and tree.mask.shape == (13, 13)
    assert tree.tokens.device == meta and tree.mask.dtype == torch.bool
    assert build_tree_device(logits, 0, 12, chain=True).mask.shape == (6, 6)


def test_compiles_fullgraph():
    """One graph (fullgraph: a graph break or a host sync raises), static shapes, the host's trees."""
    budget, depth, n_vocab = 6, 4, 11

    def fn(logits, root, chain, n):
        return build_tree_device(logits, root, budget, lookup_chain=chain, lookup_len=n)

    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    for seed in range(8):
        logits = make_logits(seed, depth, n_vocab, ["ties", "normal", "nonfinite", "halves"][seed % 4])
        lookup = make_lookup(seed, logits, None, seed % 7, 5, 0.7)
        host = build_tree(logits, 3, budget, lookup=lookup)
        dev = compiled(logits, torch.tensor(3), *lookup_tensors(lookup, depth, budget))
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(dev, f).numpy(), getattr(host, f), err_msg=f"{seed} {f}")


@pytest.mark.gpu
def test_cuda_graph_capture():
    """Captured once, replayed on new logits and lookups: the host's trees (log_softmax and topk are the
    same CUDA kernels as build_tree's, which runs them on the device before its host copy)."""
    budget, depth, n_vocab = 16, 8, 1000
    logits = torch.zeros(depth, n_vocab, device="cuda")
    root = torch.zeros((), dtype=torch.int64, device="cuda")
    chain, n = (x.cuda() for x in lookup_tensors((0, []), depth, budget))
    build_tree_device(logits, root, budget, lookup_chain=chain, lookup_len=n)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build_tree_device(logits, root, budget, lookup_chain=chain, lookup_len=n)
    for seed in range(6):
        x = make_logits(seed, depth, n_vocab, ["ties", "normal", "nonfinite"][seed % 3]).cuda()
        lookup = make_lookup(seed, x.cpu(), None, seed % 7, 12, 0.7)
        c, k = lookup_tensors(lookup, depth, budget)
        logits.copy_(x), root.fill_(seed), chain.copy_(c), n.copy_(k)
        graph.replay()
        host = build_tree(x, seed, budget, lookup=lookup)
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(out, f).cpu().numpy(), getattr(host, f), err_msg=f"{seed} {f}")


def test_host_scores_stay_float32():
    """The device accumulates scores in float32 because the host heap does: with NumPy >= 2 (NEP 50)
    `0.0 + float32` and `float32 - float32` stay float32. NumPy 1.x would make the root-level siblings'
    scores float64 and their descendants' sums float64 too (then ties and orders could differ)."""
    lp = np.float32(-0.1)
    assert type(0.0 + lp) is np.float32 and type(-(0.0 + lp) - lp) is np.float32


# ----------------------------------------------------------------------------- the Triton program (CUDA)


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 10**6), depth=st.integers(1, 16), n_vocab=st.integers(1, 50), budget=st.integers(1, 40),
       kind=st.sampled_from(["ties", "halves", "normal", "nonfinite"]), mapped=st.booleans(),
       ngram=st.integers(0, 8), length=st.integers(0, 24), hit=st.sampled_from([0.0, 0.7, 1.0]),
       chain=st.booleans())
def test_triton_search_equals_host(seed, depth, n_vocab, budget, kind, mapped, ngram, length, hit, chain):
    """The CUDA implementation of glance::best_first (one Triton program), here through Triton's
    interpreter: the host's arrays bit for bit, as build_tree_device hands it the draft's top-K."""
    kernel = pytest.importorskip("glance_rt.plugins.best_first_triton", reason="triton is not installed")
    from glance_rt.round.tree import draft_topk

    logits = make_logits(seed, depth, n_vocab, kind)
    vocab = np.random.default_rng(seed).permutation(4 * n_vocab + 7)[:n_vocab].astype(np.int64) if mapped else None
    lookup = make_lookup(seed, logits, vocab, ngram, length, hit)
    host = build_tree(logits, 5, budget, chain, vocab=vocab, lookup=lookup)
    c, n = lookup_tensors(lookup, depth, budget, chain)
    if chain:  # as build_tree_device hands a chain to the search: the top-1 path, no lookup
        budget, c, n = min(budget, depth), torch.zeros(1, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    top_lp, top_ids = draft_topk(logits, 1 if chain else min(budget, n_vocab),
                                 None if vocab is None else torch.from_numpy(vocab))
    got = kernel.best_first(top_lp, top_ids, c, n, torch.tensor(5), budget)
    for f, x in zip(FIELDS, got, strict=True):
        np.testing.assert_array_equal(x.numpy(), getattr(host, f), err_msg=f)


def test_triton_search_compiles_ahead_of_time():
    """The tree program lowers to PTX and assembles for sm_90 at the paper's budgets, with no GPU."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json\nfrom glance_rt.plugins.best_first_triton import compile_aot\n"
            "print(json.dumps([len(compile_aot(n, 15, n, n).asm['cubin']) for n in (8, 64)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert all(n > 0 for n in json.loads(run.stdout))
