"""Property tests on tree building and acceptance alone: for ANY drafter logits, budget and block
size, the committed tokens equal greedy decoding of a (synthetic) target."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glance_rt.errors import GlanceError
from glance_rt.round.commit import accept, accept_path, apply_stops, committed_tokens
from glance_rt.round.tree import build_tree, check_budget, fills_budget, lookup_rows, lookup_tree, prompt_lookup


def target_next(prefix: tuple, vocab: int) -> int:
    """A deterministic 'target': its greedy next token given the whole prefix."""
    h = 1469598103934665603
    for t in prefix:
        h = ((h ^ (t + 1)) * 1099511628211) % (1 << 61)
    return h % vocab


def greedy(prefix: tuple, n: int, vocab: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(target_next(prefix + tuple(out), vocab))
    return out


def row_prefix(tree, i):
    toks = []
    while i > 0:
        toks.append(int(tree.tokens[i]))
        i = int(tree.parent[i])
    return tuple(reversed(toks))


def one_round(prefix, bonus, draft_logits, budget, vocab, chain=False, lookup=(0, ())):
    tree = build_tree(draft_logits, bonus, budget, chain, lookup=lookup)
    base = prefix + (bonus,)
    g = np.array([target_next(base + row_prefix(tree, i), vocab) for i in range(tree.size)])
    path = accept(tree, g)
    return tree, path, committed_tokens(tree, g, path)


logits_strategy = st.integers(1, 9).flatmap(
    lambda depth: st.integers(2, 12).flatmap(
        lambda vocab: st.lists(
            st.lists(st.floats(-50, 50, allow_nan=False), min_size=vocab, max_size=vocab),
            min_size=depth, max_size=depth,
        )
    )
)


@settings(max_examples=300, deadline=None)
@given(logits=logits_strategy, budget=st.integers(1, 40), seed=st.integers(0, 10_000), chain=st.booleans())
def test_any_draft_commits_greedy(logits, budget, seed, chain):
    draft = torch.tensor(logits)
    vocab = draft.shape[1]
    rng = np.random.default_rng(seed)
    prefix = tuple(int(t) for t in rng.integers(0, vocab, size=rng.integers(0, 5)))
    bonus = int(rng.integers(0, vocab))
    tree, path, run = one_round(prefix, bonus, draft, budget, vocab, chain)
    assert run == greedy(prefix + (bonus,), len(run), vocab)
    assert 1 <= len(run) <= draft.shape[0] + 1
    # static shape: always budget + 1 rows (chain: at most depth + 1)
    assert tree.size == (min(budget, draft.shape[0]) + 1 if chain else budget + 1)


@settings(max_examples=300, deadline=None)
@given(logits=logits_strategy, budget=st.integers(1, 40), seed=st.integers(0, 10_000), right=st.integers(0, 9),
       ngram=st.integers(1, 8))
def test_lookup_chain_is_grafted_and_lossless(logits, budget, seed, right, ngram):
    """A prompt-lookup chain (its first `right` tokens the greedy ones, then noise) is a path of the
    tree from node 1 (as deep as `lookup_rows` lets it, past the D drafted depths), best-first shares
    it instead of repeating a prefix, its own nodes stay <= D deep, and the round still commits exactly
    the greedy tokens."""
    draft = torch.tensor(logits)
    depth, vocab = draft.shape
    rng = np.random.default_rng(seed)
    prefix = tuple(int(t) for t in rng.integers(0, vocab, size=3))
    bonus = int(rng.integers(0, vocab))
    want = greedy(prefix + (bonus,), 9, vocab)
    chain = want[:right] + [int(t) for t in rng.integers(0, vocab, size=9 - right)]
    tree, path, run = one_round(prefix, bonus, draft, budget, vocab, lookup=(ngram, chain))  # matched ngram tokens
    assert run == greedy(prefix + (bonus,), len(run), vocab)
    n = min(lookup_rows(depth + 1, budget, ngram), len(chain))  # a block of D + 1 rows drafts D depths
    assert tree.size == budget + 1 and tree.depth.max() <= max(depth, n)  # the chain may run past the block
    assert [int(t) for t in tree.tokens[1 : n + 1]] == chain[:n] and list(tree.parent[1 : n + 1]) == list(range(n))
    real = [i for i in range(1, tree.size) if i == 1 or not (tree.tokens[i] == tree.tokens[1] and tree.parent[i] == 0)]
    assert len({row_prefix(tree, i) for i in real}) == len(real)  # no prefix twice (padding aside)
    assert len(path) - 1 >= min(right, n)  # the grafted greedy tokens are accepted


@settings(max_examples=300, deadline=None)
@given(logits=logits_strategy, budget=st.integers(1, 16), ngram=st.integers(1, 8), length=st.integers(0, 16),
       seed=st.integers(0, 10_000))
def test_a_chain_that_fills_the_budget_is_the_whole_tree(logits, budget, ngram, length, seed):
    """Where the lookup chain takes every row (`fills_budget`), `build_tree` makes the same tree from any
    draft logits as `lookup_tree` makes without them (so the round may skip its draft pass)."""
    draft = torch.tensor(logits)
    depth, vocab = draft.shape
    chain = [int(t) for t in np.random.default_rng(seed).integers(0, vocab, size=length)]
    tree = build_tree(draft, 0, budget, lookup=(ngram, chain))
    full = fills_budget(depth + 1, budget, (ngram, chain))
    assert full == (length >= budget and lookup_rows(depth + 1, budget, ngram) >= budget)
    if full:
        alone = lookup_tree(0, budget, chain)
        for a in ("tokens", "parent", "depth", "mask"):
            np.testing.assert_array_equal(getattr(tree, a), getattr(alone, a))


def test_fills_budget_needs_a_long_match_and_chain():
    assert fills_budget(8, 8, (5, list(range(8)))) and fills_budget(8, 8, (8, list(range(20))))
    assert not fills_budget(8, 8, (4, list(range(8))))  # a 4-token match takes 6 of 8 rows
    assert not fills_budget(8, 8, (8, list(range(7))))  # the history ends 7 tokens after the match
    assert not fills_budget(8, 16, (8, list(range(16))))  # max_depth(8) = 15 rows at most
    assert not fills_budget(8, 0, (8, [1])) and not fills_budget(8, 8, (0, list(range(8))))


@settings(max_examples=300, deadline=None)
@given(hist=st.lists(st.integers(0, 4), min_size=1, max_size=30), ngram=st.integers(1, 4), length=st.integers(1, 6))
def test_prompt_lookup_is_the_latest_longest_match(hist, ngram, length):
    h = np.array(hist)
    got = prompt_lookup(h, ngram, length)
    want = []
    for n in range(min(ngram, len(h) - 1), 0, -1):
        starts = [i for i in range(len(h) - n) if list(h[i : i + n]) == list(h[-n:])]
        if starts:
            want = list(h[starts[-1] + n : starts[-1] + n + length])
            break
    assert got == want


@settings(max_examples=200, deadline=None)
@given(depth=st.integers(1, 8), vocab=st.integers(2, 6), budget=st.integers(1, 64), seed=st.integers(0, 10_000))
def test_perfect_draft_accepts_whole_block(depth, vocab, budget, seed):
    rng = np.random.default_rng(seed)
    prefix = tuple(int(t) for t in rng.integers(0, vocab, size=3))
    bonus = int(rng.integers(0, vocab))
    want = greedy(prefix + (bonus,), depth, vocab)
    draft = torch.full((depth, vocab), -5.0)
    draft[torch.arange(depth), torch.tensor(want)] = 5.0
    _, path, run = one_round(prefix, bonus, draft, budget, vocab)
    assert len(path) - 1 == min(depth, budget)
    assert run == greedy(prefix + (bonus,), len(run), vocab)


@settings(max_examples=150, deadline=None)
@given(logits=logits_strategy, budget=st.integers(1, 30))
def test_tree_is_top_prefixes(logits, budget):
    """The tree's nodes are exactly a set of `budget` most likely prefixes, parents first."""
    draft = torch.tensor(logits)
    depth, vocab = draft.shape
    lp = torch.log_softmax(draft.double(), -1).numpy()
    tree = build_tree(draft, 0, budget)
    n_real = min(budget, sum(vocab**d for d in range(1, depth + 1)))
    scores = []
    for i in range(1, n_real + 1):
        assert 0 <= tree.parent[i] < i
        assert tree.depth[i] == tree.depth[tree.parent[i]] + 1
        anc = {i}
        j = i
        while j > 0:
            j = int(tree.parent[j])
            anc.add(j)
        assert set(np.flatnonzero(tree.mask[i])) == anc
        p = row_prefix(tree, i)
        scores.append(sum(lp[d, t] for d, t in enumerate(p)))
    assert len({row_prefix(tree, i) for i in range(1, n_real + 1)}) == n_real
    if depth <= 3 and vocab**depth <= 400:
        all_scores = sorted(
            (sum(lp[d, t] for d, t in enumerate(p)) for k in range(1, depth + 1)
             for p in itertools.product(range(vocab), repeat=k)), reverse=True)
        kth = all_scores[n_real - 1]
        assert min(scores) >= kth - 1e-4  # (float32 top-k vs float64 sums)


@settings(max_examples=300, deadline=None)
@given(logits=logits_strategy, budget=st.integers(1, 40), seed=st.integers(0, 10_000), noise=st.floats(0, 1))
def test_device_acceptance_equals_host_acceptance(logits, budget, seed, noise):
    """accept_path (fixed steps, tensors: what compiled / CUDA-graph verify runs) == accept, for target
    argmaxes that follow the tree, leave it anywhere, or are random."""
    draft = torch.tensor(logits)
    vocab = draft.shape[1]
    rng = np.random.default_rng(seed)
    tree = build_tree(draft, int(rng.integers(0, vocab)), budget)
    g = np.array([target_next(row_prefix(tree, i), vocab) for i in range(tree.size)])
    g = np.where(rng.random(tree.size) < noise, rng.integers(0, vocab, tree.size), g)
    path = accept_path(*(torch.from_numpy(a) for a in (tree.parent, tree.tokens, g)), draft.shape[0])
    want = accept(tree, g)
    assert path.tolist() == want + [-1] * (draft.shape[0] + 1 - len(want))


def test_chain_is_top1_path():
    draft = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    tree = build_tree(draft, 7, 32, chain=True)
    assert tree.tokens.tolist() == [7, 1, 0, 2]
    assert tree.parent.tolist() == [-1, 0, 1, 2]


def test_autoregression_tree_is_root_only():
    tree = build_tree(None, 5, 0)
    assert tree.tokens.tolist() == [5] and tree.mask.tolist() == [[True]]


def test_stops_cut_run_exactly():
    eos = frozenset({9})
    assert apply_stops([1, 9, 3], 0, 10, eos) == ([1, 9], True)
    assert apply_stops([1, 2, 3], 8, 10, eos) == ([1, 2], True)
    assert apply_stops([1, 2], 0, 10, eos) == ([1, 2], False)
    assert apply_stops([1, 2], 8, 10, eos) == ([1, 2], True)


@pytest.mark.parametrize("budget", [0, -1, 10_000])
def test_budget_out_of_range(budget):
    with pytest.raises(GlanceError, match="tree_budget"):
        check_budget(budget)


def test_lookup_rows_follow_the_match_length():
    """A long match takes the whole budget, a 1-token match a quarter, others three quarters; never
    deeper than the block allows (docs/benchmarks.md, "Lookup chain length")."""
    assert [lookup_rows(8, 8, n) for n in range(1, 9)] == [2, 6, 6, 6, 8, 8, 8, 8]
    assert [lookup_rows(8, 16, n) for n in (1, 3, 5)] == [4, 12, 15]  # max_depth(8) = 15
    assert [lookup_rows(4, 2, n) for n in (1, 2, 5)] == [1, 2, 2]
