"""The draft pass: one drafter forward fills a whole block of B positions.

Block ids `[b, M, ..., M]` at token indices `[n-1, n+B-1)`. Each drafter layer's queries come from
the block; keys/values from the drafter's context cache (projections of the target's features for
every committed row `[0, n-1)`) plus the block itself, with no mask inside the block. New context
rows (the previous round's accepted rows) are projected into the cache in the same pass.
"""

import torch
from torch import Tensor, nn

from glance_rt.attention import tree_attention
from glance_rt.drafter import GlanceDrafter, inv_freq, layer_out, layer_qkv, rope_tables
from glance_rt.kv_cache import KVCache
from glance_rt.model import apply_rope


class DraftPass(nn.Module):
    """Runs a `GlanceDrafter` against a target's shared embeddings and lm_head, with a static
    context cache of `max_len` rows. Call: `(ctx_feats [m, F], ctx_start, bonus, block_start)`
    -> draft logits [B-1, V] for depths 1..B-1. Requires `ctx_start + m == block_start`."""

    def __init__(self, drafter: GlanceDrafter, embed_tokens: nn.Module, lm_head: nn.Module, max_len: int):
        super().__init__()
        c = drafter.config
        self.drafter, self.embed_tokens, self.lm_head = drafter, embed_tokens, lm_head
        self.block_size = c.block_size
        self.target_layer_ids = c.target_layer_ids
        w = drafter.fc.weight
        self.cache = KVCache(c.num_hidden_layers, c.num_key_value_heads, max_len, c.head_dim, w.dtype, w.device)
        self.register_buffer("inv_freq", inv_freq(c).to(w.device), persistent=False)
        ids = torch.full((c.block_size,), c.mask_token_id if c.mask_token_id is not None else 0)
        self.register_buffer("block_ids", ids.to(w.device), persistent=False)
        self.register_buffer("block_mask", torch.ones(c.block_size, c.block_size, dtype=torch.bool, device=w.device),
                             persistent=False)

    def rope(self, start: int, length: int, dtype) -> tuple[Tensor, Tensor]:
        return rope_tables(self.inv_freq, torch.arange(start, start + length, device=self.inv_freq.device), dtype)

    def block_embeds(self, bonus: int) -> Tensor:
        ids = self.block_ids.clone()
        ids[0] = bonus
        x = self.embed_tokens(ids)[None]  # [1, B, H]
        if self.drafter.config.learned_mask:
            x = torch.cat([x[:, :1], self.drafter.mask_embedding.expand(1, self.block_size - 1, -1)], 1)
        return x

    def forward(self, ctx_feats: Tensor, ctx_start: int, bonus: int, block_start: int) -> Tensor:
        d = self.drafter
        c = d.config
        m, b = ctx_feats.shape[0], self.block_size
        assert ctx_start + m == block_start, "context rows must end where the block starts"
        ctx = d.hidden_norm(d.fc(ctx_feats.to(d.fc.weight.dtype)))[None]  # [1, m, H]
        h = self.block_embeds(bonus)  # [1, B, H]
        cos, sin = self.rope(ctx_start, m + b, h.dtype)  # [1, m+B, D]
        prefix_len = torch.tensor(block_start, device=h.device)
        for i, layer in enumerate(d.layers):
            q, k, v = layer_qkv(layer, c, ctx, h)  # q [1, nh, B, D]; k, v [1, nkv, m+B, D]
            q, k = apply_rope(q, cos[:, m:], sin[:, m:]), apply_rope(k, cos, sin)
            k_all, v_all = self.cache.write(i, ctx_start, k, v)  # [1, nkv, block_start+B, D]
            h = layer_out(layer, h, tree_attention(q, k_all, v_all, self.block_mask, prefix_len, c.head_dim**-0.5))
        # all B rows through the head, then drop row 0: for B=8 MKL's GEMM takes 16 ms at M=8 and
        # 33 ms at M=7 (2-core CPU); draft numerics never affect the output, only acceptance
        return self.lm_head(d.norm(h))[0, 1:]  # [B-1, V]
