"""GLANCE's training objective: anchored blocks `[x_a, M, ..., M]` drafted in one pass, cross-entropy
through the target's frozen lm_head (or its draft-vocabulary rows) weighted exp(-(k-1)/gamma)."""

import copy

import torch
import torch.nn.functional as F
from torch import Tensor

from glance_rt.errors import GlanceError
from glance_rt.models.drafter import init_drafter, read_drafter, rope, rope_tables, save_drafter
from glance_rt.tools.training.config import TrainConfig
from glance_rt.tools.training.data import Sequence


def block_forward(drafter, embed: Tensor, features: Tensor, ids: Tensor, anchors: Tensor) -> Tensor:
    """The training pass for one sequence: K blocks `[x_a, M, ..., M]` at anchors a [K], all in one
    drafter forward (`GlanceDrafter.forward`, the inference pass's too). Each block sees the context
    rows strictly before its anchor and its own rows (a block-sparse mask), exactly what `DraftPass`
    sees at inference. features [L, F], ids [L] -> normed hidden of depths 1..B-1 [K, B-1, H]."""
    c = drafter.config
    b, k_blocks, length = c.block_size, anchors.shape[0], ids.shape[0]
    w = drafter.fc.weight
    pos = anchors[:, None] + torch.arange(b)  # [K, B] token index of each block row
    ctx = drafter.context(features)[None]  # [1, L, H]
    first = embed[ids[anchors]][:, None]  # [K, 1, H]
    mask_vec = drafter.mask_embedding if c.learned_mask else embed[c.mask_token_id]
    h = torch.cat([first, mask_vec.expand(k_blocks, b - 1, -1)], 1)  # [K, B, H]
    h = h.reshape(1, k_blocks * b, -1).to(w.dtype)  # [1, KB, H]
    q_block = torch.arange(k_blocks).repeat_interleave(b)  # [KB] block of each query row
    ctx_vis = torch.arange(length)[None, :] < anchors[q_block][:, None]  # [KB, L]
    blk_vis = q_block[:, None] == q_block[None, :]  # [KB, KB]
    mask = torch.cat([ctx_vis, blk_vis], 1)[None, None]  # [1, 1, KB, L+KB]
    inv_freq, scaling = rope(c)
    cos, sin = rope_tables(inv_freq, torch.cat([torch.arange(length), pos.flatten()]), w.dtype, scaling)
    groups = c.num_attention_heads // c.num_key_value_heads

    def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # keys: the whole context, then the blocks
        k_ctx, v_ctx = drafter.context_kv(i, ctx, cos[:, :length], sin[:, :length])
        k = torch.cat([k_ctx, k], 2).repeat_interleave(groups, 1)  # [1, nh, L+KB, D]
        v = torch.cat([v_ctx, v], 2).repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c.head_dim**-0.5)

    out = drafter(h, cos[:, length:], sin[:, length:], attend)  # [1, KB, H]
    return out.view(k_blocks, b, -1)[:, 1:]  # [K, B-1, H]


def block_loss(drafter, embed: Tensor, head: Tensor, picks: list[tuple[Sequence, Tensor]], gamma: float,
               column: Tensor | None = None):
    """CE of depth k predicting x_{a+k} through the frozen lm_head rows `head` [Vd, H], weighted
    exp(-(k-1)/gamma), for every (sequence, anchors [K]) pick. The drafter runs once per sequence; the
    head and the softmax run once over all picks' rows (one large GEMM: over the whole vocabulary the
    head is most of a step's cost, and 8 small GEMMs ran ~3x slower than one). `column` [V] maps a
    token id to its row of `head` (-1: not in the draft vocabulary, which the drafter cannot propose:
    no loss, and a chain stops there); None: row = id.
    Returns (weighted CE sum, weight sum, chain accepted-length sum over the blocks)."""
    b = drafter.config.block_size
    outs, targets, valid = [], [], []
    for seq, anchors in picks:
        length = seq.ids.shape[0]
        outs.append(block_forward(drafter, embed, seq.features, seq.ids, anchors))  # [K, B-1, H]
        tgt_pos = anchors[:, None] + torch.arange(1, b)  # [K, B-1]
        targets.append(seq.ids[tgt_pos.clamp(max=length - 1)])
        valid.append(tgt_pos < length)
    out, targets, valid = torch.cat(outs), torch.cat(targets), torch.cat(valid)  # [N, B-1, ...]
    logits = F.linear(out.to(head.dtype), head).float()  # [N, B-1, Vd]
    if column is not None:
        targets = column[targets]
    valid = valid & (targets >= 0)
    targets = targets.clamp(min=0)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    weight = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / gamma)[None].expand_as(ce) * valid
    correct = (logits.argmax(-1) == targets) & valid
    accepted = 1 + correct.long().cumprod(1).sum(1)  # chain acceptance of each block (+1 bonus)
    return (ce * weight).sum(), weight.sum(), accepted.sum().item()


def start_from(drafter, path) -> None:
    """Copy the weights of drafter folder `path` into `drafter` (same architecture and target layers);
    a tensor the other drafter lacks (a mask embedding, a draft vocabulary) keeps its new value."""
    src = read_drafter(path)
    a, b = src.config, drafter.config
    keys = ("hidden_size", "vocab_size", "target_layer_ids", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta", "rope_scaling")
    differ = [k for k in keys if getattr(a, k) != getattr(b, k)]
    if differ:
        raise GlanceError(f"--init-from {path}: its {', '.join(differ)} differ from this run's; "
                          "pick a drafter of the same shape and target layers")
    own = drafter.state_dict()
    with torch.no_grad():
        for k, v in src.state_dict().items():
            if k in own and k != "draft_vocab":
                own[k].copy_(v)


class GlanceObjective:
    """The GLANCE drafter a run trains (`model`), its frozen embedding and head, and `loss`."""

    def __init__(self, target, cfg: TrainConfig, layer_ids: tuple[int, ...], vocab: Tensor | None, bf16: bool):
        drafter = init_drafter(target, cfg.num_layers, cfg.block_size, seed=cfg.seed, target_layer_ids=layer_ids,
                               draft_vocab_size=None if vocab is None else len(vocab),
                               mask_token_id=cfg.mask_token_id, learned_mask=cfg.learned_mask)
        if vocab is not None:
            drafter.draft_vocab.copy_(vocab)
        if cfg.init_from:
            start_from(drafter, cfg.init_from)
        self.model = drafter.float().train().requires_grad_(True)
        self.embed = target.parts.text_model.embed_tokens.weight.detach().float()  # [V, H]
        head = target.parts.lm_head.weight.detach()
        self.column = None
        if vocab is not None:  # token id -> row of the draft head, -1 outside the draft vocabulary
            head = head[vocab]
            self.column = torch.full((target.vocab_size,), -1, dtype=torch.long)
            self.column[vocab] = torch.arange(len(vocab))
        self.head = head.to(torch.bfloat16 if bf16 else torch.float32).contiguous()  # [Vd, H]
        self.gamma = cfg.gamma

    def loss(self, picks: list[tuple[Sequence, Tensor]]) -> tuple[Tensor, Tensor, int, int]:
        """(weighted CE sum, weight sum, chain accepted-length sum, chains) over the picks' blocks."""
        loss_sum, weight_sum, accepted = block_loss(self.model, self.embed, self.head, picks, self.gamma, self.column)
        return loss_sum, weight_sum, accepted, sum(len(a) for _, a in picks)

    @staticmethod
    def save(model, path, dtype: torch.dtype) -> None:
        save_drafter(model, path, dtype=dtype)

    @staticmethod
    def read(path, target, dtype: torch.dtype = torch.float32):
        return read_drafter(path, dtype=dtype)

    @staticmethod
    def drafter(model, target):
        """What `Decoder` drafts with: a copy in the target's dtype (the trained one untouched)."""
        return copy.deepcopy(model).to(target.dtype).eval().requires_grad_(False)
