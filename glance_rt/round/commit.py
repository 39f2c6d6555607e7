"""Greedy acceptance and the commit: which tree rows the target agrees with, what gets committed,
and the compaction of the accepted rows' KV from scratch to their final cache rows."""

import numpy as np
import torch
from torch import Tensor

from glance_rt.round.tree import Tree


def accept(tree: Tree, greedy: np.ndarray) -> list[int]:
    """greedy [N+1]: the target's argmax at every tree row. From the root, follow the child whose
    token equals the target's argmax at the current row; stop where none does.
    Returns the accepted path of row indices, root first."""
    path = [0]
    while (child := tree.children.get((path[-1], int(greedy[path[-1]])))) is not None:
        path.append(child)
    return path


def committed_tokens(tree: Tree, greedy: np.ndarray, path: list[int]) -> list[int]:
    """The accepted draft tokens plus the bonus (the target's argmax after the last accepted row).
    Each is the target's argmax given its exact prefix, so this is the greedy continuation."""
    return [int(tree.tokens[i]) for i in path[1:]] + [int(greedy[path[-1]])]


def entropies(logits: Tensor) -> Tensor:
    """Entropy (nats) of softmax of each row of logits [K, V] -> [K] float32 (on the device)."""
    lp = torch.log_softmax(logits.float(), -1)
    return -(lp.exp() * lp).sum(-1)


def apply_stops(tokens: list[int], produced: int, max_new_tokens: int, eos_ids: frozenset, stop_strings=None,
                before=None) -> tuple[list[int], bool]:
    """Cut a run of committed tokens exactly where decoding would stop: after an EOS token, after
    the token that completes a stop string (`stop_strings`: HF's StopStringCriteria, checked over
    `before` [L], every token before the run, + the run so far), or when `max_new_tokens` is reached.
    Returns (the tokens kept, whether generation is over)."""
    kept = []
    for tok in tokens:
        if produced + len(kept) >= max_new_tokens:
            return kept, True
        kept.append(tok)
        if tok in eos_ids:
            return kept, True
        if stop_strings is not None:
            seq = torch.cat([before, torch.tensor(kept, dtype=torch.long)])[None]  # [1, L + k]
            if bool(stop_strings(seq, None)[0]):
                return kept, True
    return kept, produced + len(kept) >= max_new_tokens


def compact(cache, path: list[int], start: int, slot: int = 0) -> None:
    """Move the accepted rows' KV (root included) from scratch rows `start + path` of `slot` to
    `[start, start + len(path))`. Rejected rows are left to be overwritten."""
    if path != list(range(len(path))):
        src = torch.tensor([start + i for i in path], device=cache.k0.device)
        cache.move_rows(src, start, slot)


def accept_path(parent, tokens, greedy, depth: int):
    """`accept` on tensors with a fixed number of steps (no host sync, so it can run inside a
    compiled graph or CUDA graph). parent, tokens, greedy [..., T] int64 (one tree, or a batch of
    trees [S, T]) -> path [..., depth+1] int64: the accepted rows, root first, then -1 after the last
    accepted row. Among equal siblings the lowest row wins, as in `Tree.children`."""
    t = tokens.shape[-1]
    rows = torch.arange(t, device=tokens.device)
    cur = torch.zeros(*tokens.shape[:-1], 1, dtype=torch.long, device=tokens.device)  # [..., 1]
    alive = torch.ones_like(cur, dtype=torch.bool)
    out = [cur]
    for _ in range(depth):
        want = greedy.gather(-1, cur)  # [..., 1]: the target's token after row cur
        match = (parent == cur) & (tokens == want)  # [..., T]: children of cur carrying it
        alive = alive & match.any(-1, keepdim=True)
        nxt = torch.where(match, rows, t).amin(-1, keepdim=True)
        cur = torch.where(alive, nxt, cur)
        out.append(torch.where(alive, nxt, -1))
    return torch.cat(out, -1)
