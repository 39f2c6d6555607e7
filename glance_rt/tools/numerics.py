"""Row invariance: does a verify pass compute a tree row's logits bit for bit like the
autoregressive step at that position with the same prefix?

Two measurements:
- `glance_rt.models.kernels.linear_invariance`: one linear layer's output rows computed in a call of T
  rows against the same rows computed one at a time (torch's own GEMM, or any `linear(x, w)`; exact
  numerics' kernel probe runs it too);
- `row_agreement`: a whole target. A prompt is prefilled, then a tree of T rows is verified in one pass;
  for every row, the cache is reset to the prompt and the row's path (root first) is stepped one row at
  a time, as autoregressive decoding would commit it. The row's logits are compared with the last
  step's, bit for bit.

Where the two differ in their last bits, greedy speculative decoding can commit a token that the same
engine's autoregression would not (a near tie); `scripts/row_invariance.py` runs both over the tiny
architectures and dtypes and writes what it finds.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class RowCheck:
    row: int  # tree row
    depth: int  # its depth (0: the root, which an AR step at the same position computes)
    equal: bool  # logits bit-identical to the AR step's
    max_diff: float  # max |verify - AR| over the vocabulary
    argmax_equal: bool  # the greedy token agrees


def torch_linear(x: Tensor, w: Tensor) -> Tensor:
    return F.linear(x, w)


def tree_mask(parents: list[int]) -> Tensor:
    """Ancestor mask [T, T] (a row sees itself and its ancestors) of a tree given by parent rows (-1: root)."""
    t = len(parents)
    mask = torch.eye(t, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def _path(parents: list[int], row: int) -> list[int]:
    path = [row]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _compare_rows(run, cache, prompt_len: int, tokens: list[int], parents: list[int]) -> list[RowCheck]:
    """The comparison behind both entry points, after the prompt is prefilled into `cache`: the tree
    verified in one pass, then for every row the cache reset to the prompt and the row's path stepped one
    row at a time (each node committed at the next position), the last step's logits against the row's.
    `run(ids, start, index [n], mask [n, n], parent [n]) -> logits [n, V]`: one pass."""
    p = prompt_len
    prompt_cache = [b.clone() for b in cache.buffers()]
    mask = tree_mask(parents)
    depth = mask.sum(1) - 1  # [T]
    verified = run(tokens, p, p + depth, mask, parents)  # [T, V]
    one = torch.ones(1, 1, dtype=torch.bool)
    checks = []
    for row in range(len(tokens)):
        for b, saved in zip(cache.buffers(), prompt_cache, strict=True):
            b.copy_(saved)
        for d, node in enumerate(_path(parents, row)):
            ar = run([tokens[node]], p + d, torch.tensor([p + d]), one, [-1])[0]
        v = verified[row]
        checks.append(RowCheck(row, int(depth[row]), torch.equal(v, ar), float((v.float() - ar.float()).abs().max()),
                               bool(v.argmax() == ar.argmax())))
    return checks


@torch.inference_mode()
def row_agreement(target, input_ids: list[int], tokens: list[int], parents: list[int], kernels=None,
                  max_len: int = 256, numerics: str = "fast", static: bool = False) -> list[RowCheck]:
    """Verify rows against AR steps on `target` (text prompt `input_ids`; a tree of `tokens` with
    `parents`, row 0 the root at the position after the prompt). `kernels`: the target's linear kernels
    as `round_modules` takes them (None: the plain weights, torch's own GEMM); `numerics`: "fast" or
    "exact" (`glance_rt.models.exact`); `static`: every pass attends all `max_len` cache rows, as the
    fixed-shape graphs do (exact numerics: `static_row_attention`)."""
    from glance_rt.method import check_numerics
    from glance_rt.models.exact import ExactNumerics
    from glance_rt.round.verify import round_modules, text_positions

    exact = ExactNumerics(static=static) if check_numerics(numerics) == "exact" else None
    verifier, _ = round_modules(target, None, max_len, (len(tokens), 1), kernels, fuse=False, exact=exact)
    dev = verifier.embed_tokens.weight.device
    p = len(input_ids)

    def run(ids: list[int], start: int, positions: Tensor, mask: Tensor, parent=None, prefill: bool = False) -> Tensor:
        embeds = verifier.embed_tokens(torch.tensor(ids, device=dev))[None]  # [1, n, H]
        pos = text_positions(positions.to(dev), 0, verifier.mrope)
        kv_len = max_len if static else start + len(ids)
        logits, _ = verifier(embeds, pos, torch.tensor(start, device=dev), mask.to(dev), kv_len, prefill=prefill)
        return logits  # [n, V]

    run(input_ids, 0, torch.arange(p), torch.ones(p, p, dtype=torch.bool).tril(), prefill=True)
    return _compare_rows(run, verifier.cache, p, tokens, parents)


@torch.inference_mode()
def decoder_row_agreement(decoder, input_ids: list[int], tokens: list[int], parents: list[int]) -> list[RowCheck]:
    """`row_agreement` through a Decoder's own passes (eager, compiled, or an engine's graphs): the prompt
    prefilled, the tree verified in one pass (its row count must be one the passes run), each row's path
    stepped as one-row verify passes (the AR step's graph). Text prompts."""
    from glance_rt.round.tree import Tree
    from glance_rt.round.verify import text_positions

    passes, verifier = decoder.passes, decoder.verifier
    dev = verifier.embed_tokens.weight.device

    def run(ids: list[int], start: int, index: Tensor, mask: Tensor, parent: list[int]) -> Tensor:
        children = {(q, ids[i]): i for i, q in enumerate(parent) if q >= 0}
        tree = Tree(np.array(ids), np.array(parent), index.numpy() - start, mask.numpy(), children)
        pos = text_positions(index.to(dev), 0, verifier.mrope)
        logits = passes.verify(tree, torch.tensor(ids, device=dev), pos, start, mask.to(dev))[0]
        return logits.clone()  # [n, V] (an engine's outputs are reused by its next call)

    embeds = verifier.embed_tokens(torch.tensor(input_ids, device=dev))[None]  # [1, P, H]
    passes.prefill(embeds, text_positions(torch.arange(len(input_ids), device=dev), 0, verifier.mrope), 0)
    return _compare_rows(run, verifier.cache, len(input_ids), tokens, parents)  # the caches the passes write
