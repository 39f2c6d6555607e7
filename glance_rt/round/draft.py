"""The draft pass: one drafter forward fills a whole block of B positions.

Block ids `[b, M, ..., M]` at token indices `[n-1, n+B-1)`. Each drafter layer's queries come from
the block; keys/values from the drafter's context cache (projections of the target's features for
every committed row `[0, n-1)`) plus the block itself, with no mask inside the block. New context
rows (the previous round's accepted rows) are projected into the cache in the same pass.

`step` is the pass on tensors (`context` then `block`): the eager call runs it at exact lengths;
static backends run it with the context padded to B rows (padding lands on the block's rows, which
the block then overwrites) and attention over all `max_len` cache rows.
"""

import copy

import torch
from torch import Tensor, nn

from glance_rt.errors import GlanceError
from glance_rt.models.attention import attend as attend_tree
from glance_rt.models.drafter import GlanceDrafter, rope, rope_tables
from glance_rt.models.kernels import KernelPlan, class_index, nearest_class, with_plan
from glance_rt.models.kv_cache import KVCache
from glance_rt.models.linear import swap_linears
from glance_rt.models.target import Segment, SlotBatch, attend_pass, layout


class DraftPass(nn.Module):
    """Runs a `GlanceDrafter` against a target's shared embeddings and lm_head, with a static
    context cache of `max_len` rows (for `slots` sequences: `forward_batch`). Call:
    `(ctx_feats [m, F], ctx_start, bonus, block_start)` -> draft logits [B-1, V] for depths 1..B-1
    (column j is token `draft_vocab[j]` when the drafter has a draft vocabulary, else token j).
    Requires `ctx_start + m == block_start`."""

    def __init__(self, drafter: GlanceDrafter, embed_tokens: nn.Module, lm_head: nn.Module, max_len: int,
                 plan: KernelPlan | None = None, slots: int = 1):
        super().__init__()
        c = drafter.config
        # with a plan, one drafter per row class whose linear layers run the plan's kernels at that class
        # (glance_rt.models.kernels; copies of the structure, sharing the weights): the block runs its
        # class's, a context pass the class of its row count
        self.row_classes = plan.row_classes() if plan is not None else (c.block_size,)
        self.drafters = nn.ModuleList(drafter if plan is None else planned(drafter, plan, rows)
                                      for rows in self.row_classes)
        self.embed_tokens, self.lm_head = embed_tokens, lm_head
        self.block_size = c.block_size
        drafter = self.drafter
        self.target_layer_ids = c.target_layer_ids
        w = drafter.hidden_norm.weight  # (fc may be prepacked: no .weight)
        self.cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, max_len, c.head_dim, w.dtype, w.device,
                             slots)
        self.copies = c.copy_head
        if self.copies:  # the copy head's pointer key and next token of every context row, per slot
            self.register_buffer("copy_keys", torch.zeros(slots, max_len, c.head_dim, dtype=w.dtype, device=w.device),
                                 persistent=False)
            self.register_buffer("copy_next", torch.zeros(slots, max_len, dtype=torch.long, device=w.device),
                                 persistent=False)
        inv_freq, self.rope_scaling = rope(c)  # [D/2], the RoPE type's attention scaling (a constant)
        self.register_buffer("inv_freq", inv_freq.to(w.device), persistent=False)
        ids = torch.full((c.block_size,), c.mask_token_id if c.mask_token_id is not None else 0)
        self.register_buffer("block_ids", ids.to(w.device), persistent=False)
        self.register_buffer("block_mask", torch.ones(c.block_size, c.block_size, dtype=torch.bool, device=w.device),
                             persistent=False)
        self.sub_head = None  # the lm_head rows of the draft vocabulary, gathered once
        if c.draft_vocab_size is not None:
            bias = getattr(lm_head, "bias", None)
            self.sub_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=bias is not None,
                                      device=w.device, dtype=lm_head.weight.dtype).requires_grad_(False)
            self.sub_head.weight.copy_(lm_head.weight.detach()[drafter.draft_vocab])  # [Vd, H]
            if bias is not None:
                self.sub_head.bias.copy_(bias.detach()[drafter.draft_vocab])
        self.head = with_plan(plan, lm_head if self.sub_head is None else self.sub_head, c.block_size)

    @property
    def drafter(self) -> GlanceDrafter:
        """The drafter the block runs (its row class's kernels)."""
        return self.drafters[class_index(self.block_size, self.row_classes)]

    @property
    def draft_vocab(self) -> Tensor | None:
        """[Vd] the token id of each draft-logit column, or None (column j is token j)."""
        return getattr(self.drafter, "draft_vocab", None)

    def kernel_modules(self) -> dict[int, list[nn.Module]]:
        """{row class: the modules that run at it} (`glance_rt.models.kernels.kernel_summary`)."""
        block = nearest_class(self.block_size, self.row_classes)
        return {rows: [d, self.head] if rows == block else [d] for rows, d in zip(self.row_classes, self.drafters,
                                                                               strict=True)}

    def block_embeds(self, bonus: Tensor) -> Tensor:
        """The blocks [b, M, ..., M] of bonus tokens [n] (or one, []) -> [1, n*B, H], block after block."""
        bonus = bonus.reshape(-1, 1)  # [n, 1]
        ids = torch.cat([bonus, self.block_ids[1:].expand(bonus.shape[0], -1)], 1)  # [n, B]
        x = self.embed_tokens(ids.reshape(1, -1))  # [1, n*B, H]
        if self.drafter.config.learned_mask:
            x = x.unflatten(1, (-1, self.block_size))  # [1, n, B, H]
            mask = self.drafter.mask_embedding.expand(1, x.shape[1], self.block_size - 1, -1)
            x = torch.cat([x[:, :, :1], mask], 2).flatten(1, 2)
        return x

    def context(self, ctx_feats: Tensor, ctx_start: Tensor, slot: int = 0, ctx_tokens: Tensor | None = None) -> None:
        """Project context rows ctx_feats [m, F] (target features) into every layer's cache rows
        [ctx_start, ctx_start + m) of cache slot `slot`. A copy head also needs ctx_tokens [m]: the token
        after each row."""
        self.contexts(((slot, ctx_feats, ctx_start, ctx_tokens),))

    def contexts(self, items: tuple) -> None:
        """`context` for several sequences in one pass: items ((slot, ctx_feats [m_i, F], ctx_start [],
        ctx_tokens [m_i] or None), ...), their rows projected together, each written to its own slot."""
        rows = [start + torch.arange(f.shape[0], device=f.device) for _, f, start, _ in items]  # [m_i] each
        d, ctx = self._project(_cat([f for _, f, _, _ in items], 0))  # [1, m, H]
        for i, k, v in self._context_kv(d, ctx, _cat(rows, 0)):
            for (slot, *_), r, (k_i, v_i) in zip(items, rows, _split((k, v), [len(r) for r in rows]), strict=True):
                self.cache.layer(i).write(r, k_i, v_i, slot)
        if self.copies:
            keys = d.copy_k(ctx[0])  # [m, D]
            for (slot, _, _, tokens), r, k_i in zip(items, rows, keys.split([len(r) for r in rows]), strict=True):
                if tokens is None:
                    raise GlanceError("a drafter with a copy head needs each context row's next token (ctx_tokens)")
                self.copy_keys[slot, r] = k_i
                self.copy_next[slot, r] = tokens

    def slot_contexts(self, ctx: Tensor, ctx_start: Tensor) -> None:
        """`contexts` of cache slots 0..S-1, m rows each: ctx [S, m, F], ctx_start [S] (one scatter per layer;
        no loop over the slots, so S can be symbolic)."""
        self._no_copy("slot_contexts")
        rows = ctx_start[:, None] + torch.arange(ctx.shape[1], device=ctx.device)  # [S, m]
        for i, k, v in self._context_kv(*self._project(ctx.flatten(0, 1)), rows.flatten()):
            self.cache.layer(i).write_slots(rows, k, v)

    def _no_copy(self, name: str) -> None:
        if self.copies:
            raise GlanceError(f"a drafter with a copy head runs on the eager backend only ({name} is a static pass); "
                              "use backend='eager', or a drafter without --copy-head")

    def _project(self, feats: Tensor) -> tuple[GlanceDrafter, Tensor]:
        """Context rows feats [m, F] -> (the drafter of their row class, its context rows [1, m, H])."""
        d = self.drafters[class_index(feats.shape[0], self.row_classes)]
        return d, d.context(feats)[None]

    def _context_kv(self, d: GlanceDrafter, ctx: Tensor, rows: Tensor):
        """Context rows ctx [1, m, H] at token indices rows [m] -> (layer, k, v [1, nkv, m, D]) per layer."""
        cos, sin = rope_tables(self.inv_freq, rows, ctx.dtype, self.rope_scaling)  # [1, m, D]
        for i in range(len(d.layers)):
            yield i, *d.context_kv(i, ctx, cos, sin)

    def block(self, bonus: Tensor, block_start: Tensor, kv_len: int, slot: int = 0) -> Tensor:
        """The block [bonus, M, ..., M] at rows [block_start, block_start + B) of cache slot `slot`, seeing
        the context rows before it -> draft logits [B-1, V]."""
        return self.blocks(((slot, bonus, block_start, kv_len),))[0]

    def blocks(self, items: tuple) -> list[Tensor]:
        """`block` for several sequences in one pass: items ((slot, bonus [], block_start [], kv_len), ...);
        every linear layer runs over all their rows, attention per sequence over its own slot (one call of
        the op where they are slots 0..S-1 reading as many rows: `SlotBatch`) -> each one's draft logits
        [B-1, V]."""
        b = self.block_size
        rows = [start + torch.arange(b, device=self.block_ids.device) for _, _, start, _ in items]  # [B] each
        seqs = layout(tuple(Segment(slot, j * b, b, r, self.block_mask, kv_len)  # slots 0..S-1: one op call
                            for j, ((slot, *_, kv_len), r) in enumerate(zip(items, rows, strict=True))))
        copy_at = [(slot, start) for slot, _, start, _ in items] if self.copies else None
        return list(self._blocks(torch.stack([bonus for _, bonus, _, _ in items]), _cat(rows, 0), seqs, copy_at))

    def slot_blocks(self, bonus: Tensor, block_start: Tensor, kv_len: int) -> Tensor:
        """`blocks` of cache slots 0..S-1: bonus, block_start [S] -> draft logits [S, B-1, V] (no loop over the
        slots, so S can be symbolic)."""
        self._no_copy("slot_blocks")
        b = self.block_size
        rows = block_start[:, None] + torch.arange(b, device=block_start.device)  # [S, B]
        seqs = SlotBatch(rows, self.block_mask.expand(rows.shape[0], b, b), kv_len)
        return self._blocks(bonus, rows.flatten(), seqs)

    def _blocks(self, bonus: Tensor, rows: Tensor, seqs, copy_at: list | None = None) -> Tensor:
        """The blocks of bonus tokens [n] at token indices rows [n*B], their attention laid out by `seqs`
        (`layout`) -> draft logits [n, B-1, V]. A copy head's (`copy_at`: each block's (slot, block_start))
        are its mixture's log-probs, pointing at the slot's context rows before the block."""
        h = self.block_embeds(bonus)  # [1, n*B, H]
        cos, sin = rope_tables(self.inv_freq, rows, h.dtype, self.rope_scaling)  # [1, n*B, D]
        d = self.drafters[class_index(h.shape[1], self.row_classes)]  # one block: the block's drafter
        scale = d.config.head_dim**-0.5

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # the block's rows join the cache
            return attend_pass(attend_tree, seqs, q, k, v, self.cache.layer(i), scale)  # [1, nh, n*B, D]

        # all B rows through the head, then drop row 0 (a GEMM of B rows is the faster shape);
        # draft numerics never affect the output, only acceptance
        hidden = d(h, cos, sin, attend)[0]  # [n*B, H]
        logits = self.head(hidden[None])[0].unflatten(0, (-1, self.block_size))[:, 1:]  # [n, B-1, V or Vd]
        if copy_at is None:
            return logits
        hidden = hidden.unflatten(0, (-1, self.block_size))[:, 1:]  # [n, B-1, H]
        return torch.stack([d.copy_mix(hidden[j], logits[j], self.copy_keys[slot],
                                       *d.copy_targets(self.copy_next[slot], start, self.block_size - 1))
                            for j, (slot, start) in enumerate(copy_at)])  # [n, B-1, V]

    def step(self, ctx_feats: Tensor, ctx_start: Tensor, bonus: Tensor, block_start: Tensor, kv_len: int) -> Tensor:
        self._no_copy("step")
        self.context(ctx_feats, ctx_start)
        return self.block(bonus, block_start, kv_len)

    def forward(self, ctx_feats: Tensor, ctx_start: int, bonus: int, block_start: int, slot: int = 0,
                ctx_tokens: Tensor | None = None) -> Tensor:
        return self.forward_batch(((slot, ctx_feats, ctx_start, bonus, block_start, ctx_tokens),))[0]

    def forward_batch(self, items: tuple) -> list[Tensor]:
        """Eager draft passes of several sequences as one: items ((slot, ctx_feats [m, F], ctx_start, bonus,
        block_start[, ctx_tokens [m]]), ...) with Python ints -> each one's draft logits [B-1, V]. A copy
        head needs ctx_tokens: the token after each context row (the last one's is the bonus)."""
        dev = self.block_ids.device

        def t(x: int) -> Tensor:
            return torch.tensor(x, device=dev)

        items = tuple((*it, None) if len(it) == 5 else it for it in items)
        for _, feats, ctx_start, _, block_start, _ in items:
            assert ctx_start + feats.shape[0] == block_start, "context rows must end where the block starts"
        self.contexts(tuple((slot, feats, t(ctx_start), tokens) for slot, feats, ctx_start, _, _, tokens in items))
        return self.blocks(tuple((slot, t(bonus), t(start), start + self.block_size)
                                 for slot, _, _, bonus, start, _ in items))


def _cat(xs: list[Tensor], dim: int) -> Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs, dim)


def _split(xs: tuple[Tensor, ...], lengths: list[int]):
    """Cut each of xs [1, h, n, D] along its rows into pieces of `lengths` -> one tuple of pieces per length
    (the tensors whole when there is one piece)."""
    if len(lengths) == 1:
        return [xs]
    return list(zip(*(x.split(lengths, 2) for x in xs), strict=True))


def planned(drafter: nn.Module, plan: KernelPlan, rows: int) -> nn.Module:
    """A copy of `drafter` (a GLANCE drafter or an EAGLE-3 head: its structure; the weights are shared)
    whose linear layers run `plan`'s kernels at `rows` rows."""
    copied = copy.deepcopy(drafter, memo={id(t): t for t in (*drafter.parameters(), *drafter.buffers())})
    swap_linears(copied, lambda linear: plan.linear(linear, rows))
    return copied
