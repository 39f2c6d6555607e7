"""The candidate tree built on the device with static shapes: `build_tree`, bit for bit.

`build_tree` (glance_rt.round.tree, the reference) copies the top-K of the draft log-probs to the
host and runs a heap there. This builds the same arrays with torch ops only, every shape fixed by
(budget, D, K, Lmax): no `.item()`, no host copy, no branch on a tensor value, no data-dependent
shape. Draft, tree, verify and acceptance can then be one `torch.compile(fullgraph=True)` graph and
one CUDA graph.

The heap becomes a frontier of 2*budget+1 slots. Slot 0 holds the first entry (depth 1, rank 0);
pop `s` writes its sibling (same depth, rank+1) to slot 2s+1 and its first child (depth+1, rank 0)
to slot 2s+2, each marked live only if the host would push it. Pop `s` takes the live slot of the
highest score, the lowest slot among equal scores. That is the host's order exactly:
- heapq pops the least (-score, counter, ...); the counter is unique, so the order is total.
- the host pushes the sibling before the child and pop s before pop s+1, so slot order among live
  slots is push order: the lowest slot is the least counter.
- scores are the host's float32s: heap keys are numpy float32 scalars (NumPy >= 2 keeps
  `python float + float32` in float32, NEP 50), the root-level sibling is `0.0 + lp` = lp, a
  child `neg - lp` = -(score + lp) (round to nearest is symmetric), so every score is the same
  float32 `parent score + lp[d-1, r]` computed here.
The host loop runs while the tree has <= budget nodes; each pop adds a node or shares a grafted
one, and (for distinct tokens per depth) no node is popped twice, so `budget` static steps suffice,
a step doing nothing once the tree is full or the frontier empty.

Lookup grafting: `build_tree`'s `lookup=(n, chain)` becomes a chain tensor [Lmax] and its length L
(a tensor [], 0: none), truncated on the host as build_tree does (`lookup_tensors`): prompt lookup
runs on the host anyway. Nodes 1..L are the chain; grafted node i has parent i-1, so a popped
prefix (par, tok) is grafted node par+1 iff par < L and chain[par] == tok (the host's
`grafted.get((par, tok))`), found by one gather.

On CUDA the search runs as one Triton program (`glance::best_first`, plugins/best_first_triton.py):
the same frontier, pops and scores in registers, tested against this module bit for bit.

Not here (host-only, trivial): no drafter (`draft_logits is None`): the tree is the root alone.
`budget == 0` is handled (the root alone). `vocab` must map columns to distinct ids (a draft
vocabulary does); with repeated ids the host may pop a grafted node twice and run more pops.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from glance_rt.round.tree import draft_topk, lookup_rows


class DeviceTree(NamedTuple):
    tokens: Tensor  # [N+1] int64; tokens[0] = root
    parent: Tensor  # [N+1] int64; parent[0] = -1
    depth: Tensor  # [N+1] int64; depth[0] = 0
    mask: Tensor  # [N+1, N+1] bool; row i true at i and its ancestors


def lookup_tensors(lookup: tuple[int, list[int]], n_depth: int, budget: int, chain: bool = False,
                   device=None) -> tuple[Tensor, Tensor]:
    """Host side: a prompt-lookup match (n, chain) -> (chain [max(budget, 1)] int64, length [] int64),
    truncated exactly as `build_tree` does (`lookup_rows(D + 1, budget, n)`; none with `chain`)."""
    ngram, toks = lookup
    toks = [] if chain or not ngram else [int(t) for t in toks][: lookup_rows(n_depth + 1, budget, ngram)]
    toks = toks[:budget]
    padded = toks + [0] * (max(budget, 1) - len(toks))
    return (torch.tensor(padded, dtype=torch.int64, device=device),
            torch.tensor(len(toks), dtype=torch.int64, device=device))


def build_tree_device(draft_logits: Tensor, root: Tensor | int, budget: int, chain: bool = False,
                      vocab: Tensor | None = None, lookup_chain: Tensor | None = None,
                      lookup_len: Tensor | None = None) -> DeviceTree:
    """`build_tree` on the device: draft_logits [D, V], root [] (or int), lookup_chain [Lmax] and
    lookup_len [] from `lookup_tensors` (None: no lookup) -> DeviceTree of N+1 rows, N = budget
    (with `chain`: min(budget, D)). Static in (budget, D, V, Lmax); equal to build_tree's arrays."""
    n_depth, n_vocab = draft_logits.shape
    device = draft_logits.device
    root = root.to(device, torch.int64) if isinstance(root, Tensor) else torch.full((), root, device=device)
    if budget == 0:  # the root alone
        minus1, zero = torch.full((1,), -1, device=device), torch.zeros(1, dtype=torch.int64, device=device)
        return _finish(root.reshape(1), minus1, zero, 0)
    width = 1 if chain else min(budget, n_vocab)
    top_lp, top_ids = draft_topk(draft_logits, width, vocab)  # [D, K]
    if chain or lookup_chain is None:  # chain mode: the top-1 path, never a lookup
        budget = min(budget, n_depth) if chain else budget
        lookup_chain = torch.zeros(1, dtype=torch.int64, device=device)
        lookup_len = torch.zeros((), dtype=torch.int64, device=device)
    # on CUDA one Triton program (this module's loop of small ops would launch hundreds of kernels)
    search = best_first_op if device.type == "cuda" else search_tree
    return DeviceTree(*search(top_lp, top_ids, lookup_chain, lookup_len, root, budget))


def search_tree(top_lp: Tensor, top_ids: Tensor, lookup_chain: Tensor, lookup_len: Tensor, root: Tensor,
                budget: int) -> DeviceTree:
    """The tree from the draft's top-K [D, K] (`draft_topk`): best-first search, the root, the mask."""
    tokens, parent, depth = best_first_device(top_lp, top_ids, budget, lookup_chain, lookup_len)
    tokens = torch.cat([root.reshape(1), tokens[1:]])
    return _finish(tokens, parent, depth, min(budget, max(top_lp.shape[0], lookup_chain.shape[0])))


@torch.library.custom_op("glance::best_first", mutates_args=())
def best_first_op(top_lp: Tensor, top_ids: Tensor, lookup_chain: Tensor, lookup_len: Tensor, root: Tensor,
                  budget: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The tree's arrays (tokens, parent, depth [N+1], mask [N+1, N+1]) from the draft's top-K
    [D, K]: `search_tree` here; on CUDA the Triton program of
    `glance_rt/plugins/best_first_triton.py`, equal to it bit for bit."""
    return tuple(search_tree(top_lp, top_ids, lookup_chain, lookup_len, root, budget))


@best_first_op.register_kernel("cuda")
def _(top_lp, top_ids, lookup_chain, lookup_len, root, budget):
    from glance_rt.plugins.best_first_triton import best_first

    return best_first(top_lp, top_ids, lookup_chain, lookup_len, root, budget)


@best_first_op.register_fake
def _(top_lp, top_ids, lookup_chain, lookup_len, root, budget):
    n = budget + 1
    ints = [top_lp.new_empty(n, dtype=torch.int64) for _ in range(3)]
    return (*ints, top_lp.new_empty(n, n, dtype=torch.bool))


def best_first_device(top_lp: Tensor, top_ids: Tensor, budget: int, lookup_chain: Tensor,
                      lookup_len: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`best_first` with static shapes, padded as `_pack` pads: top_lp, top_ids [D, K] ->
    (tokens, parent, depth) [budget+1] int64 (tokens[0] = 0, the caller's root)."""
    n_depth, width = top_lp.shape
    device = top_lp.device
    n_chain = lookup_chain.shape[0]
    graft_len = lookup_len.clamp(0, min(budget, n_chain))
    tokens, parent, depth = _graft(lookup_chain, graft_len, budget)  # [N+1] each
    count = graft_len + 1  # nodes so far
    slots = 2 * budget + 1
    f_live = torch.zeros(slots, dtype=torch.bool, device=device)
    f_score = torch.zeros(slots, dtype=torch.float32, device=device)  # the prefix's log-prob
    f_pscore = torch.zeros(slots, dtype=torch.float32, device=device)  # its parent prefix's log-prob
    f_depth = torch.ones(slots, dtype=torch.int64, device=device)
    f_rank = torch.zeros(slots, dtype=torch.int64, device=device)
    f_par = torch.zeros(slots, dtype=torch.int64, device=device)  # the parent's node index
    f_live[0], f_score[0] = True, top_lp[0, 0]
    slot_ids = torch.arange(slots, device=device)
    node_ids = torch.arange(budget + 1, device=device)
    for step in range(budget):
        active = (count <= budget) & f_live.any()
        j = _pop(f_live, f_score, slot_ids)
        score, pscore, d, r, par = (_take(f, j) for f in (f_score, f_pscore, f_depth, f_rank, f_par))
        f_live = f_live & (slot_ids != j)
        tok = _take(top_ids, (d.clamp(1, n_depth) - 1) * width + r.clamp(max=width - 1))  # clamps: dead slots only
        shared = (par < graft_len) & (_take(lookup_chain, par.clamp(max=n_chain - 1)) == tok)
        node = torch.where(shared, par + 1, count)
        write = (node_ids == count) & active & ~shared
        tokens = torch.where(write, tok, tokens)
        parent = torch.where(write, par, parent)
        depth = torch.where(write, d, depth)
        count = count + (active & ~shared).long()
        sib = 2 * step + 1  # next sibling: same depth, rank + 1
        f_live[sib] = active & (r + 1 < width)
        f_score[sib] = pscore + _take(top_lp, (d - 1) * width + (r + 1).clamp(max=width - 1))
        f_pscore[sib], f_depth[sib], f_rank[sib], f_par[sib] = pscore, d, r + 1, par
        kid = 2 * step + 2  # first child: depth + 1, rank 0
        f_live[kid] = active & (d < n_depth)
        f_score[kid] = score + _take(top_lp, d.clamp(max=n_depth - 1) * width)
        f_pscore[kid], f_depth[kid], f_rank[kid], f_par[kid] = score, d + 1, 0, node
    pad = node_ids >= count  # rows the vocabulary/depth could not fill: copies of node 1
    return (torch.where(pad, tokens[1], tokens), torch.where(pad, parent[1], parent),
            torch.where(pad, depth[1], depth))


def _take(x: Tensor, i: Tensor) -> Tensor:
    """x.flatten()[i] for an index tensor i [] (a gather: indexing by a 0-d tensor would be `.item()`)."""
    return x.reshape(-1).gather(0, i.reshape(1)).reshape(())


def _pop(live: Tensor, score: Tensor, slot_ids: Tensor) -> Tensor:
    """The heap's pop: the live slot of the highest score, the lowest slot among ties -> [] int64."""
    best = torch.where(live, score, float("-inf")).max()
    return torch.where(live & (score == best), slot_ids, live.shape[0] - 1).min()


def _graft(chain: Tensor, length: Tensor, budget: int) -> tuple[Tensor, Tensor, Tensor]:
    """Nodes 1..length = root -> chain[0] -> chain[1] ...; the rest zero -> [budget+1] each."""
    ids = torch.arange(budget + 1, device=chain.device)
    grafted = (ids >= 1) & (ids <= length)
    tok = chain[(ids - 1).clamp(0, chain.shape[0] - 1)]
    tokens = torch.where(grafted, tok, 0)
    parent = torch.where(grafted, ids - 1, 0)
    parent[0] = -1
    depth = torch.where(grafted, ids, 0)
    return tokens, parent, depth


def _finish(tokens: Tensor, parent: Tensor, depth: Tensor, max_depth: int) -> DeviceTree:
    """The ancestor mask by pointer chasing `max_depth` (a static bound on any node's depth) times."""
    ids = torch.arange(tokens.shape[0], device=tokens.device)
    up = parent.clamp(min=0)  # the root is its own parent here
    anc, mask = ids, ids[:, None] == ids[None, :]  # [N+1], [N+1, N+1]
    for _ in range(max_depth):
        anc = up[anc]
        mask = mask | (anc[:, None] == ids[None, :])
    return DeviceTree(tokens, parent, depth, mask)
