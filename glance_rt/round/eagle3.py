"""The EAGLE-3 draft pass: the head's own KV cache, a context pass over the rows the target
committed, then EAGLE's dynamic tree, one draft pass per depth.

Row t of the head pairs a state with the embedding of token t+1 at RoPE position t and predicts token
t+2. For a row the target has seen the state is `fc` of its fused features; for a draft node it is the
output of the row that drafted its parent (the head was trained on its own states: training-time test).

A round, with the root (the target's bonus token) at position s:
- context: the rows [c, s) not yet in the head's cache (the accepted rows of the last drafted round,
  and any rounds the gate skipped since) are written to the cache, each seeing the cache before it;
  the last row's token is the root, so its logits are the root's children (depth 1);
- depth d = 2 .. D: the `top_k` best nodes of depth d-1 (cumulative log-probability; ties: the earlier
  candidate) run as one pass of k rows at position s + d - 2, each seeing the committed cache and its
  own ancestors' rows (they occupy scratch rows past s: the next round's context rows overwrite them),
  and each proposes its `top_k` best children;
- the tree: the `budget` candidates of highest cumulative log-probability (ties: the earlier), in the
  order they were drafted, so a node's parent always precedes it (a child never scores above its
  parent). A chain is top_k = 1: the top-1 token at every depth.
Verification, acceptance and the commit are the round loop's, unchanged: the output is the target's.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glance_rt.models.drafter import rope, rope_tables
from glance_rt.models.eagle3 import Eagle3Drafter, Eagle3Head
from glance_rt.models.kernels import KernelPlan, class_index
from glance_rt.models.kv_cache import KVCache
from glance_rt.round.draft import planned
from glance_rt.round.tree import Tree, _pack


class Eagle3Pass(nn.Module):
    """Runs an `Eagle3Drafter` against a target's embeddings with its own static KV cache of `max_len`
    committed rows (+ the scratch rows of one round's depths). `plan`: the linear layers' kernels per row
    class, as the GLANCE draft pass runs them (a depth pass is `top_k` rows; the first round's context
    pass the prompt's)."""

    def __init__(self, drafter: Eagle3Drafter, embed_tokens: nn.Module, max_len: int, plan: KernelPlan | None = None):
        super().__init__()
        head = drafter.head
        c = head.config
        self.drafter, self.head, self.depth = drafter, head, drafter.depth
        self.row_classes = plan.row_classes() if plan is not None else (drafter.top_k,)
        self.heads = nn.ModuleList(head if plan is None else planned(head, plan, rows) for rows in self.row_classes)
        self.embed_tokens = head.embed_tokens if c.own_embeddings else embed_tokens
        rows = max_len + drafter.depth * drafter.top_k  # committed rows, then one depth's rows per depth
        w = head.norm.weight
        self.cache = KVCache(1, c.num_key_value_heads, rows, c.head_dim, w.dtype, w.device)  # its one layer
        inv_freq, self.rope_scaling = rope(c)
        self.register_buffer("inv_freq", inv_freq.to(w.device), persistent=False)
        self.groups = c.num_attention_heads // c.num_key_value_heads

    @property
    def block_size(self) -> int:
        return self.depth + 1

    @property
    def target_layer_ids(self) -> tuple[int, int, int]:
        return self.head.target_layer_ids

    def head_for(self, rows: int) -> Eagle3Head:
        """The head a pass of `rows` rows runs (its row class's kernels)."""
        return self.heads[class_index(rows, self.row_classes)]

    def kernel_modules(self) -> dict[int, list[nn.Module]]:
        """{row class: the modules that run at it} (`glance_rt.models.kernels.kernel_summary`)."""
        return {rows: [head] for rows, head in zip(self.row_classes, self.heads, strict=True)}

    def rows(self, tokens: Tensor, states: Tensor, positions: Tensor, cache_rows: Tensor, visible: Tensor,
             fuse: bool = False, last: bool = False):
        """One draft pass over T rows: tokens [T] (target ids), states [T, H] (`fuse`: the target's
        features [T, F], fused first), RoPE positions [T]; their K and V go to `cache_rows` [T]; row i
        attends the cache rows where visible[i] [T, L] (its own included). -> (next states [T, H], draft
        log-probs [T, Vd] fp32; `last`: the last row's alone, [1, Vd]: a context pass reads no other)."""
        head = self.head_for(tokens.shape[0])
        states = head.fuse(states) if fuse else states
        cos, sin = rope_tables(self.inv_freq, positions, states.dtype, self.rope_scaling)
        length = visible.shape[1]

        def attend(q, k, v):  # q [1, nh, T, D]; k, v [1, nkv, T, D]
            kv = self.cache.layer(0)
            kv.write(cache_rows, k, v)
            keys, values = (x.repeat_interleave(self.groups, 1) for x in kv.read(length))  # [1, nh, L, D]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[None, None])

        h = head.step(self.embed_tokens(tokens)[None], states[None], cos, sin, attend)  # [1, T, H]
        logits = head.lm_head(head.norm(h[:, -1:] if last else h))
        return h[0], torch.log_softmax(logits[0].float(), -1)

    def context(self, feats: Tensor, tokens: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Rows [start, start + m) the target committed: features [m, F] and each row's next token [m]
        -> the last row's next state [H] and log-probs [Vd] (the root's children)."""
        m, dev = feats.shape[0], feats.device
        index = start + torch.arange(m, device=dev)
        visible = torch.arange(start + m, device=dev)[None, :] <= index[:, None]  # [m, start + m] causal
        h, lp = self.rows(tokens, feats, index, index, visible, fuse=True, last=True)
        return h[-1], lp[-1]

    def depth_rows(self, budget: int, chain: bool) -> int:
        return self.drafter.depth_rows(budget, chain)

    @property
    def cache_rows(self) -> int:
        return self.cache.max_len

    def static_context(self, feats: Tensor, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """`context` at a fixed row count C (a compiled graph's): features [C, F], next tokens [C] and
        positions [C] of the rows (a short chunk is padded by repeating its last row, which writes the same
        K and V to the same row again); each row sees the cache rows up to its own, over the whole cache.
        -> the last row's next state [H] and log-probs [Vd]."""
        visible = torch.arange(self.cache_rows, device=feats.device)[None, :] <= positions[:, None]  # [C, L]
        h, lp = self.rows(tokens, feats, positions, positions, visible, fuse=True, last=True)
        return h[-1], lp[-1]

    @torch.inference_mode()
    def draft_tree(self, feats: Tensor, tokens: Tensor, ctx_start: int, root: int, start: int, budget: int,
                   chain: bool, graphs=None) -> tuple[Tree, int]:
        """The round's tree of `budget` draft nodes under `root` (at position `start`), from the context
        rows [ctx_start, start): features [m, F], next tokens [m]. `graphs`: the fixed-shape context and
        depth passes (`StaticPasses`; None: this module's, eagerly). -> (Tree, draft passes run)."""
        score, ids, parent, n = self.grow(feats, tokens, ctx_start, start, budget, chain, graphs)
        return _select(root, score, ids, parent, budget, chain), n

    def grow(self, feats: Tensor, tokens: Tensor, ctx_start: int, start: int, budget: int, chain: bool,
             graphs=None):
        """Every candidate of the round in drafting order (depth 1's k, then k*k a depth, beam-major):
        -> (cumulative log-probs [C] fp32, target ids [C], parent candidate [C] (-1: the root), passes).
        With fixed-shape `graphs`, each depth's mask spans the whole cache (a fixed shape)."""
        if graphs is None:
            state, lp = self.context(feats, tokens, ctx_start)
        else:
            state, lp = graphs.context(feats, tokens, ctx_start)
        k = self.depth_rows(budget, chain)
        dev = lp.device
        score, rank = _topk(lp, k)  # [k]: depth 1
        cand_score, cand_id, cand_parent = [score], [rank], [torch.full((k,), -1, device=dev)]
        beam = torch.arange(k, device=dev)  # candidate index of each beam node
        beam_score, beam_state = score, state.expand(k, -1)
        beam_rows = torch.empty(0, dtype=torch.long, device=dev)  # [k, d-1] each beam node's ancestors' rows
        passes, n = 1, k
        for d in range(2, self.depth + 1):
            if n >= budget and chain:
                break
            rows = start + (d - 2) * k + torch.arange(k, device=dev)  # this depth's scratch rows
            ancestors = torch.cat([beam_rows, rows[:, None]], 1)  # [k, d-1]
            width = int(rows[-1]) + 1 if graphs is None else self.cache_rows
            visible = torch.zeros(k, width, dtype=torch.bool, device=dev)
            visible[:, :start] = True
            visible.scatter_(1, ancestors, True)
            ids = self.head.target_ids(torch.cat(cand_id)[beam])
            position = torch.full((k,), start + d - 2, device=dev)
            if graphs is None:
                h, lp = self.rows(ids, beam_state, position, rows, visible)
            else:
                h, lp = graphs.depth(ids, beam_state, position, rows, visible)
            passes += 1
            child_score, child_rank = _topk(lp, k)  # [k, k]
            cum = (beam_score[:, None] + child_score).reshape(-1)  # [k*k], beam-major
            cand_score.append(cum)
            cand_id.append(child_rank.reshape(-1))
            cand_parent.append(beam.repeat_interleave(k))
            best = _topk(cum, k)[1]  # the next beam: flat indices into this depth's children
            beam_rows, beam_state = ancestors[best // k], h[best // k]
            beam, beam_score = n + best, cum[best]
            n += k * k
        return torch.cat(cand_score), self.head.target_ids(torch.cat(cand_id)), torch.cat(cand_parent), passes


def _topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k highest of each row, ties to the lower index (a stable sort; torch.topk leaves ties open)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return scores.gather(-1, order), order


def _select(root: int, score: Tensor, ids: Tensor, parent: Tensor, budget: int, chain: bool) -> Tree:
    """The tree of the `budget` best candidates (score, token id, parent candidate or -1 for the root),
    in drafting order. A chain keeps its whole path up to the budget."""
    keep = _topk(score, min(budget, score.shape[0]))[1].sort().values.tolist()  # drafting order: parents first
    where = {c: i + 1 for i, c in enumerate(keep)}  # candidate -> tree node
    ids, parent = ids.tolist(), parent.tolist()
    tokens, parents, depth = [root], [-1], [0]
    for c in keep:
        p = where[parent[c]] if parent[c] >= 0 else 0
        tokens.append(ids[c])
        parents.append(p)
        depth.append(depth[p] + 1)
    return _pack(tokens, parents, depth, budget + 1 if not chain else len(tokens))
