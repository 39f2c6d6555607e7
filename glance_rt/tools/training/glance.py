"""GLANCE's training objective: anchored blocks `[x_a, M, ..., M]` drafted in one pass, cross-entropy
through the target's frozen lm_head (or its draft-vocabulary rows) weighted exp(-(k-1)/gamma)."""

import copy

import torch
import torch.nn.functional as F
from torch import Tensor

from glance_rt.errors import GlanceError
from glance_rt.models.drafter import init_drafter, read_drafter, rope, rope_tables, save_drafter
from glance_rt.tools.training.config import TrainConfig
from glance_rt.tools.training.data import Sequence, capture_features, sequence_inputs


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
               column: Tensor | None = None, soft: bool = False):
    """CE of depth k predicting x_{a+k} through the frozen lm_head rows `head` [Vd, H], weighted
    exp(-(k-1)/gamma), for every (sequence, anchors [K]) pick. The drafter runs once per sequence; the
    head and the softmax run once over all picks' rows (one large GEMM: over the whole vocabulary the
    head is most of a step's cost, and 8 small GEMMs ran ~3x slower than one). `column` [V] maps a
    token id to its row of `head` (-1: not in the draft vocabulary, which the drafter cannot propose:
    no loss, and a chain stops there); None: row = id. `soft`: the CE is against the target's own
    top-K distribution over x_{a+k} (each sequence's `teacher`, --distill K) instead of its greedy token.
    Returns (weighted CE sum, weight sum, chain accepted-length sum over the blocks)."""
    b = drafter.config.block_size
    outs, targets, valid, teach_ids, teach_logp = [], [], [], [], []
    for seq, anchors in picks:
        length = seq.ids.shape[0]
        outs.append(block_forward(drafter, embed, seq.features, seq.ids, anchors))  # [K, B-1, H]
        tgt_pos = anchors[:, None] + torch.arange(1, b)  # [K, B-1]
        targets.append(seq.ids[tgt_pos.clamp(max=length - 1)])
        valid.append(tgt_pos < length)
        if soft:  # teacher row r predicts token prompt_len + r
            rows = (tgt_pos.clamp(max=length - 1) - seq.prompt_len).clamp(min=0)
            teach_ids.append(seq.teacher[0][rows].long())  # [K, B-1, Kt]
            teach_logp.append(seq.teacher[1][rows].float())
    out, targets, valid = torch.cat(outs), torch.cat(targets), torch.cat(valid)  # [N, B-1, ...]
    logits = F.linear(out.to(head.dtype), head).float()  # [N, B-1, Vd]
    if drafter.config.copy_head:  # the head's distribution with the pointer's mixed in, sequence by sequence
        sizes = [len(a) for _, a in picks]
        logp = torch.cat([copy_logprobs(drafter, o, lg, seq, anchors) for o, lg, (seq, anchors)
                          in zip(out.split(sizes), logits.split(sizes), picks, strict=True)])
    else:
        logp = logits.log_softmax(-1)  # [N, B-1, Vd]
    if column is not None:
        targets = column[targets]
    valid = valid & (targets >= 0)
    targets = targets.clamp(min=0)
    if soft:
        ce = -(torch.cat(teach_logp).exp() * logp.gather(-1, torch.cat(teach_ids))).sum(-1)
    else:
        ce = -logp.gather(-1, targets[..., None]).squeeze(-1)  # [N, B-1]
    weight = torch.exp(-torch.arange(b - 1, dtype=torch.float32) / gamma)[None].expand_as(ce) * valid
    correct = (logp.argmax(-1) == targets) & valid
    accepted = 1 + correct.long().cumprod(1).sum(1)  # chain acceptance of each block (+1 bonus)
    return (ce * weight).sum(), weight.sum(), accepted.sum().item()


def copy_logprobs(drafter, out: Tensor, logits: Tensor, seq: Sequence, anchors: Tensor) -> Tensor:
    """The copy head's mixture for one sequence's blocks, as the draft pass computes it: each block row
    points at the context rows before its anchor (what `DraftPass` caches) and proposes the token after
    each. out [K, B-1, H], logits [K, B-1, V] -> log-probs [K, B-1, V]."""
    ids = seq.ids
    keys = drafter.copy_k(drafter.context(seq.features))  # [L, D]
    next_ids = torch.cat([ids[1:], ids[-1:]])  # [L] the token after each row (the last row is never visible)
    targets, visible = drafter.copy_targets(next_ids, anchors[:, None, None], out.shape[1])  # [Q, L], [K, Q, L]
    return drafter.copy_mix(out, logits, keys[None], targets.expand_as(visible), visible)


def start_from_target(drafter, target, layers: tuple[int, ...], calibrate: list[Sequence],
                      images: str | None = None) -> None:
    """Start drafter layer i from target layer `layers[i]` (LayerSkip / Kangaroo: the target's own
    circuits, copying among them, instead of a random init): attention and MLP weights and both norms.
    The target has no q/k norm: each is set to the mean RMS of that layer's queries / keys on the
    `calibrate` sequences (their images relative to `images`), so attention starts about as sharp as the target's.
    The context projection starts as target layer layers[0]'s input: where the layer before it is one
    of the drafter's target layers, `fc` picks that layer's slice and `hidden_norm` takes the layer's
    input norm (the context rows are then exactly what target layer layers[0] reads); else it stays random."""
    text = target.parts.text_model
    c = drafter.config
    if len(layers) != c.num_hidden_layers or any(not 0 <= j < len(text.layers) for j in layers):
        raise GlanceError(f"--init-layers {','.join(map(str, layers))}: give one target layer "
                          f"(0..{len(text.layers) - 1}) per drafter layer ({c.num_hidden_layers})")
    rms: dict[tuple[int, str], list[Tensor]] = {}
    hooks = []
    for j in layers:
        attn = text.layers[j].self_attn
        for name in ("q_proj", "k_proj"):
            hooks.append(getattr(attn, name).register_forward_hook(
                lambda m, a, o, key=(j, name): rms.setdefault(key, []).append(
                    o.float().unflatten(-1, (-1, c.head_dim)).pow(2).mean(-1).sqrt().flatten())))
    try:
        for seq in calibrate:
            capture_features(target, sequence_inputs(target, seq, images), (max(layers),))
    finally:
        for h in hooks:
            h.remove()
    own = drafter.state_dict()
    with torch.no_grad():
        for i, j in enumerate(layers):
            for k, v in text.layers[j].state_dict().items():
                name = f"layers.{i}.{k}"
                if name not in own or own[name].shape != v.shape:
                    raise GlanceError(f"--init-layers: target layer {j}'s {k} {tuple(v.shape)} does not fit the "
                                      f"drafter's {tuple(own[name].shape) if name in own else 'nothing'}; the drafter "
                                      "must have the target's layer shapes (the default sizes)")
                own[name].copy_(v)
            for name in ("q", "k"):
                own[f"layers.{i}.self_attn.{name}_norm.weight"].fill_(torch.cat(rms[(j, f"{name}_proj")]).mean().item())
        below = layers[0] - 1
        if below in c.target_layer_ids:
            h, slot = c.hidden_size, c.target_layer_ids.index(below)
            own["fc.weight"].zero_()
            own["fc.weight"][:, slot * h : (slot + 1) * h].copy_(torch.eye(h))
            own["hidden_norm.weight"].copy_(text.layers[layers[0]].input_layernorm.weight)


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

    def __init__(self, target, cfg: TrainConfig, layer_ids: tuple[int, ...], vocab: Tensor | None, bf16: bool,
                 seqs: list[Sequence] = ()):
        drafter = init_drafter(target, cfg.num_layers, cfg.block_size, seed=cfg.seed, target_layer_ids=layer_ids,
                               draft_vocab_size=None if vocab is None else len(vocab),
                               mask_token_id=cfg.mask_token_id, learned_mask=cfg.learned_mask,
                               copy_head=cfg.copy_head, copy_span=cfg.copy_span)
        if vocab is not None:
            drafter.draft_vocab.copy_(vocab)
        if cfg.init_layers:
            start_from_target(drafter, target, cfg.init_layers, seqs[:8], cfg.images)
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
        self.gamma, self.distill = cfg.gamma, bool(cfg.distill)

    def loss(self, picks: list[tuple[Sequence, Tensor]], training: bool = True) -> tuple[Tensor, Tensor, int, int]:
        """(weighted CE sum, weight sum, chain accepted-length sum, chains) over the picks' blocks. With
        --distill, training's CE is against the target's top-K; validation's stays on its greedy token
        (comparable across runs)."""
        loss_sum, weight_sum, accepted = block_loss(self.model, self.embed, self.head, picks, self.gamma, self.column,
                                                    soft=training and self.distill)
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
