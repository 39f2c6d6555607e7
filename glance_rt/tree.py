"""The candidate tree: the N most likely prefixes under the product of the block's marginals.

Best-first search (DDTree-style) over (depth, rank-tuple) prefixes: pop the best, push its next
sibling (same depth, rank+1) and its first child (depth+1, rank 0). Log-probs are <= 0, so a
parent always pops before its children and the N pops are exactly the N most likely prefixes.
Node 0 is the root (the bonus token); nodes 1..N follow in pop order, so parent index < child index.
A chain (DFlash) is the width-1 tree: the top-1 token at every depth.
"""

import heapq
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from glance_rt.errors import GlanceError

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


def best_first(top_lp: np.ndarray, top_ids: np.ndarray, budget: int):
    """top_lp, top_ids [D, K]: per depth, log-probs sorted descending and their tokens.
    Returns (tokens, parent, depth) for the root + up to `budget` nodes, in pop order."""
    n_depth, width = top_lp.shape
    tokens, parent, depth = [0], [-1], [0]
    heap = [(-top_lp[0, 0], 0, 1, 0, 0, 0.0)]  # (-score, tiebreak, depth, rank, parent, parent score)
    count = 1
    while heap and len(tokens) <= budget:
        neg, _, d, r, par, par_score = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(top_ids[d - 1, r]))
        parent.append(par)
        depth.append(d)
        if r + 1 < width:  # next sibling
            heapq.heappush(heap, (-(par_score + top_lp[d - 1, r + 1]), count, d, r + 1, par, par_score))
            count += 1
        if d < n_depth:  # first child
            heapq.heappush(heap, (neg - top_lp[d, 0], count, d + 1, 0, node, -neg))
            count += 1
    return tokens, parent, depth


def build_tree(draft_logits: Tensor | None, root: int, budget: int, chain: bool = False) -> Tree:
    """draft_logits [D, V] (depths 1..D) -> a Tree of exactly budget+1 rows (root included).

    With `chain`, the tree is the top-1 path (budget is then at most D). With no draft logits
    the tree is the root alone (autoregression). Rows that a small vocabulary or depth cannot
    fill are padded with copies of the root's first child, which change no acceptance.
    """
    if draft_logits is None or budget == 0:
        return _pack([root], [-1], [0], 1)
    lp = torch.log_softmax(draft_logits.float(), dim=-1).nan_to_num(nan=-1e30, neginf=-1e30)
    width = 1 if chain else min(budget, lp.shape[-1])
    top_lp, top_ids = torch.topk(lp, width, dim=-1)  # [D, K]
    tokens, parent, depth = best_first(top_lp.numpy(), top_ids.numpy(), budget)
    tokens[0] = root
    size = min(budget, len(lp)) + 1 if chain else budget + 1
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
