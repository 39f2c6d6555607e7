"""The candidate tree: the N most likely prefixes under the product of the block's marginals.

Best-first search (DDTree-style) over (depth, rank-tuple) prefixes: pop the best, push its next
sibling (same depth, rank+1) and its first child (depth+1, rank 0). Log-probs are <= 0, so a
parent always pops before its children and the N pops are exactly the N most likely prefixes.
Node 0 is the root (the bonus token); nodes 1..N follow in pop order, so parent index < child index.
A chain (DFlash) is the width-1 tree: the top-1 token at every depth.

Prompt lookup (optional): the tokens that followed the latest earlier occurrence of the context's
last n-gram (n <= max_ngram) form a chain that is grafted first (nodes 1..L); best-first then
shares those nodes where its prefixes coincide with them and fills the rest of the budget. A chain
that takes the whole budget (a long match) leaves the drafter nothing to fill: that round's tree is
the chain alone (`lookup_tree`), and the round loop skips its draft pass.
"""

import heapq
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from glance_rt.errors import GlanceError
from glance_rt.method import DEFAULT_LOOKUP_BUDGET
from glance_rt.models.drafter import MAX_BLOCK_SIZE
from glance_rt.models.eagle3 import Eagle3Drafter

MAX_TREE_BUDGET = 1024


@dataclass(frozen=True)
class Tree:
    tokens: np.ndarray  # [N+1] int64; tokens[0] = root (bonus)
    parent: np.ndarray  # [N+1] int64; parent[0] = -1
    depth: np.ndarray  # [N+1] int64; depth[0] = 0
    mask: np.ndarray  # [N+1, N+1] bool; row i true at i and its ancestors
    children: dict  # (parent index, token) -> child index

    @property
    def size(self) -> int:
        return len(self.tokens)


def check_budget(budget: int) -> None:
    if not 1 <= budget <= MAX_TREE_BUDGET:
        raise GlanceError(f"tree_budget must be in [1, {MAX_TREE_BUDGET}], got {budget}")


def prompt_lookup(history: np.ndarray, max_ngram: int, length: int) -> list[int]:
    """history [L] (prompt + committed tokens, the root last) -> up to `length` tokens that followed
    the latest earlier occurrence of its last n tokens, for the largest n <= max_ngram that occurs."""
    return lookup_match(history, max_ngram, length)[1]


def lookup_match(history: np.ndarray, max_ngram: int, length: int) -> tuple[int, list[int]]:
    """`prompt_lookup` with the size n of the n-gram it matched (0: none)."""
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)  # [L-n, n], starts 0..L-1-n
        hits = np.flatnonzero((windows == history[-n:]).all(1))
        if len(hits):
            start = int(hits[-1]) + n  # the token after the match
            return n, history[start : start + length].tolist()
    return 0, []


def max_depth(block_size: int) -> int:
    """The deepest row a round's tree may have: the drafter's candidates reach B-1, a prompt-lookup
    chain twice as deep (where a chain is right it runs long: an extraction answer copies whole
    passages), within a scratch of MAX_BLOCK_SIZE rows. A round commits at most max_depth + 1 tokens."""
    return min(2 * block_size, MAX_BLOCK_SIZE) - 1


def lookup_rows(block_size: int, budget: int, ngram: int) -> int:
    """How many rows a prompt-lookup chain whose match was `ngram` tokens long may take, at most
    `max_depth` deep. A long match is reliably right (on the response store a chain matched on 8
    tokens is right for its first token 95% of the time, on 1 token 26%), so a match of 5 or more
    tokens takes the whole budget, one of 1 token a quarter (at least 1), any other three quarters,
    the drafter's candidates keeping the rest (docs/benchmarks.md, "Lookup chain length": held-out
    tau at budget 8 with n-grams up to 8, 100 prompts: 2.975 with 6 rows for any match, 3.060 with
    this rule; earlier with n <= 3, 6 of 8 rows against half 2.61 -> 2.75)."""
    if ngram >= 5:
        rows = budget
    elif ngram == 1:
        rows = max(1, budget // 4)
    else:
        rows = budget - budget // 4
    return min(max_depth(block_size), rows)


def grafts_lookup(drafter, chain: bool) -> bool:
    """Whether prompt lookup can graft onto this decoder's rounds: a drafter's trees, not a chain,
    autoregression (no drafter) or an EAGLE-3 head's own tree."""
    return drafter is not None and not chain and not isinstance(drafter, Eagle3Drafter)


def default_lookup_budget(block_size: int) -> int:
    """The rows a lookup round verifies unless told: `DEFAULT_LOOKUP_BUDGET` within `max_depth`."""
    return min(DEFAULT_LOOKUP_BUDGET, max_depth(block_size))


def check_lookup_budget(rows: int, block_size: int) -> int:
    """`rows` if a lookup round may verify that many rows of its chain (1 to `max_depth`)."""
    deepest = max_depth(block_size)
    if not 1 <= rows <= deepest:
        raise GlanceError(f"lookup_budget={rows}: a lookup round verifies 1 to max_depth = {deepest} rows of its "
                          f"chain with a drafter of block {block_size}")
    return rows


def with_lookup_bucket(budgets, rows: int) -> list[int]:
    """The verify buckets of tree `budgets` (0: one-row steps) and lookup rounds of `rows` rows (0:
    none): `rows` is a bucket of its own only where it exceeds the smallest tree's."""
    trees = [b for b in budgets if b]
    if rows and trees and rows > min(trees) and rows not in budgets:
        return sorted([*budgets, rows])
    return list(budgets)


def fills_budget(block_size: int, budget: int, lookup: tuple[int, list[int]]) -> bool:
    """Whether a prompt-lookup match (n, chain) takes every row of a tree of `budget` nodes: then the
    drafter's candidates would get none, and the round needs no draft pass (`lookup_tree`)."""
    ngram, chain = lookup
    return budget > 0 and ngram > 0 and len(chain) >= budget and lookup_rows(block_size, budget, ngram) >= budget


def lookup_tree(root: int, budget: int, chain: list[int]) -> Tree:
    """The tree of a round whose lookup chain fills the budget (`fills_budget`): root -> chain[0] ->
    ... -> chain[budget-1], the same tree `build_tree` makes from any draft logits for that match."""
    tokens, parent, depth = [root], [-1], [0]
    graft(tokens, parent, depth, list(chain)[:budget])
    return _pack(tokens, parent, depth, budget + 1)


def graft(tokens: list, parent: list, depth: list, chain: list[int]) -> dict:
    """Append root -> chain[0] -> chain[1] ... to the tree lists (the root is node 0).
    Returns {(parent, token): node} of the grafted nodes."""
    index, prev = {}, 0
    for d, tok in enumerate(chain, start=1):
        node = len(tokens)
        index[(prev, int(tok))] = node
        tokens.append(int(tok))
        parent.append(prev)
        depth.append(d)
        prev = node
    return index


def best_first(top_lp: np.ndarray, top_ids: np.ndarray, budget: int, lookup: list[int] = ()):
    """top_lp, top_ids [D, K]: per depth, log-probs sorted descending and their tokens; `lookup`: a
    chain grafted first (nodes 1..L) that best-first prefixes share where they coincide.
    Returns (tokens, parent, depth) for the root + up to `budget` nodes, in pop order."""
    n_depth, width = top_lp.shape
    tokens, parent, depth = [0], [-1], [0]
    grafted = graft(tokens, parent, depth, list(lookup)[:budget])
    root = np.float32(0.0)  # scores stay float32 whatever NumPy's scalar promotion (1.x would widen 0.0 + f32)
    heap = [(-top_lp[0, 0], 0, 1, 0, 0, root)]  # (-score, tiebreak, depth, rank, parent, parent score)
    count = 1
    while heap and len(tokens) <= budget:
        neg, _, d, r, par, par_score = heapq.heappop(heap)
        tok = int(top_ids[d - 1, r])
        node = grafted.get((par, tok))
        if node is None:  # a new node; else this prefix is a grafted node, shared
            node = len(tokens)
            tokens.append(tok)
            parent.append(par)
            depth.append(d)
        if r + 1 < width:  # next sibling
            heapq.heappush(heap, (-(par_score + top_lp[d - 1, r + 1]), count, d, r + 1, par, par_score))
            count += 1
        if d < n_depth:  # first child
            heapq.heappush(heap, (neg - top_lp[d, 0], count, d + 1, 0, node, -neg))
            count += 1
    return tokens, parent, depth


def draft_topk(draft_logits: Tensor, width: int, vocab: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """draft_logits [D, V] -> (top log-probs [D, K] float32, their columns [D, K] int64, or the token ids
    of a draft vocabulary `vocab` [V] tensor): log_softmax in float32, NaN and -inf as -1e30, topk. The
    host tree (`build_tree`) and the device tree (`glance_rt.round.device_tree`) both start here."""
    lp = torch.log_softmax(draft_logits.float(), dim=-1).nan_to_num(nan=-1e30, neginf=-1e30)  # [D, V]
    top_lp, top_ids = torch.topk(lp, width, dim=-1)  # [D, K]
    if vocab is not None:
        top_ids = vocab.to(top_ids.device)[top_ids]
    return top_lp, top_ids.long()


def build_tree(draft_logits: Tensor | None, root: int, budget: int, chain: bool = False,
               vocab: np.ndarray | None = None, lookup: tuple[int, list[int]] = (0, ())) -> Tree:
    """draft_logits [D, V] (depths 1..D) -> a Tree of exactly budget+1 rows (root included).
    `vocab` [V] maps logit columns to token ids (a drafter's draft vocabulary); None: column = id.
    `lookup`: a prompt-lookup match (n, chain) as `lookup_match` returns it: the chain is grafted after
    the root first (at most `lookup_rows(D + 1, budget, n)` nodes, deeper than D where the budget allows).

    With `chain`, the tree is the top-1 path (budget is then at most D). With no draft logits
    the tree is the root alone (autoregression). Rows that a small vocabulary or depth cannot
    fill are padded with copies of the root's first child, which change no acceptance.
    """
    if draft_logits is None or budget == 0:
        return _pack([root], [-1], [0], 1)
    width = 1 if chain else min(budget, draft_logits.shape[-1])
    top_lp, top_ids = (x.cpu() for x in draft_topk(draft_logits, width))  # [D, K]: only these reach the host
    top_ids = top_ids.numpy() if vocab is None else vocab[top_ids.numpy()]
    ngram, grafted = lookup
    grafted = [] if chain or not ngram else list(grafted)[: lookup_rows(len(top_lp) + 1, budget, ngram)]
    tokens, parent, depth = best_first(top_lp.numpy(), top_ids, budget, grafted)
    tokens[0] = root
    size = min(budget, len(top_lp)) + 1 if chain else budget + 1
    return _pack(tokens, parent, depth, size)


def _pack(tokens, parent, depth, size: int) -> Tree:
    while len(tokens) < size:  # padding: a duplicate of node 1 (same token, same parent)
        tokens.append(tokens[1])
        parent.append(parent[1])
        depth.append(depth[1])
    tokens = np.asarray(tokens, dtype=np.int64)
    parent = np.asarray(parent, dtype=np.int64)
    depth = np.asarray(depth, dtype=np.int64)
    mask = np.zeros((size, size), dtype=bool)
    children = {}
    for i in range(size):
        if i:
            mask[i] = mask[parent[i]]
            children.setdefault((int(parent[i]), int(tokens[i])), i)
        mask[i, i] = True
    return Tree(tokens, parent, depth, mask, children)
