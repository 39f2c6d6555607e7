"""The EAGLE-3 baseline head's training objective: training-time test.

EAGLE-3 drafts from its own states after the first step, so it is trained on them: the head is unrolled
`steps` times over a sequence, each step's rows reading the states the step before produced, with a
cross-entropy loss at every step. Step 0's row t pairs fc of the target's features at t with token t+1
and predicts token t+2; step k's row t pairs step k-1's output of row t with token t+1+k at RoPE
position t+k and predicts token t+2+k. Row t at step k attends the step-0 rows up to t (the committed
context) and its own rows of steps 1..k (its draft ancestors): exactly what `Eagle3Pass` shows the same
row when it drafts those tokens, so a head trained here drafts as it was trained (tested against a
from-scratch recomputation). The targets are the response store's tokens (the target's greedy answers),
as for the GLANCE drafter; step k's loss is weighted `decay ** k` (EAGLE-3's 0.8).

The same sequences, layers and steps as a GLANCE run; two choices are this baseline's own (docs/usage.md):
the head's output norm and lm_head start from the target's (EAGLE-3's reference starts its lm_head at
random; at a few thousand steps the target's rows are a large head start), and a GLANCE block's anchor
is matched: a chain starts at a response token (row t >= prompt_len - 1).
"""

import copy

import torch
import torch.nn.functional as F
from torch import Tensor

from glance_rt.errors import GlanceError
from glance_rt.models.drafter import rope, rope_tables
from glance_rt.models.eagle3 import Eagle3Drafter, Eagle3Head, init_eagle3, read_eagle3, save_eagle3
from glance_rt.tools.training.config import TrainConfig
from glance_rt.tools.training.data import Sequence


def ttt_forward(head: Eagle3Head, embed: Tensor, features: Tensor, ids: Tensor, steps: int,
                rows: Tensor | None = None) -> list[Tensor]:
    """The unrolled pass over one sequence: features [L, 3Ht] (the target's fused layer outputs at every
    token), ids [L] -> each step's output states: step 0's [R, H] over every row (R = L-1), each later
    step's [N, H] over the sorted `rows` [N] (default: every row). Row t of step k predicts ids[t+2+k];
    rows past the sequence's end read padding and are the loss's to ignore. A row left out of `rows` is
    computed at step 0 only, as the others' context: nothing a kept row computes reads its later steps.
    `embed`: the token embedding [V, H]."""
    c = head.config
    n = ids.shape[0] - 1  # row t pairs the state at t with token t+1
    dev, dtype = features.device, head.fc.weight.dtype
    inv_freq, scaling = rope(c)
    groups = c.num_attention_heads // c.num_key_value_heads
    every = torch.arange(n, device=dev)
    rows = every if rows is None else rows.to(dev)
    causal = every[None, :] <= every[:, None]  # [R, R]: step 0's rows up to t
    own = torch.eye(rows.shape[0], dtype=torch.bool, device=dev)  # [N, N]: a later step's row t itself
    keys, values, outs = [], [], []
    state = head.fuse(features[:n])[None]  # [1, R, H]
    padded = torch.cat([ids, ids.new_zeros(steps)])  # tokens past the end: padding (no loss reads them)
    for k in range(steps):
        at = every if k == 0 else rows
        if k == 1:
            state = state[:, rows]  # [1, N, H]
        cos, sin = rope_tables(inv_freq.to(dev), at + k, dtype, scaling)
        tokens = embed[padded[at + 1 + k]][None].to(dtype)  # [1, T, H]: token t+1+k
        mask = torch.cat([causal[at], *([own] * k)], 1)[None, None]  # [1, 1, T, R + k N]

        def attend(q, key, value, mask=mask):  # step k's keys join the earlier steps'
            keys.append(key)
            values.append(value)
            kk = torch.cat(keys, 2).repeat_interleave(groups, 1)
            vv = torch.cat(values, 2).repeat_interleave(groups, 1)
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

        state = head.step(tokens, state, cos, sin, attend)
        outs.append(state[0])
    return outs


def ttt_loss(head: Eagle3Head, embed: Tensor, features: Tensor, ids: Tensor, loss_from: int, steps: int,
             decay: float, column: Tensor | None = None, rows: Tensor | None = None) -> tuple[Tensor, Tensor, int, int]:
    """Training-time test's loss for one sequence: at step k, CE of row t's draft logits against
    ids[t+2+k], for the rows t of `rows` [N] (sorted; default: every row whose steps reach the response)
    and predicted positions t+2+k >= `loss_from` inside the sequence whose token is in the draft
    vocabulary, weighted decay**k. Logits are computed for those rows only. `column` [V]: target id -> draft
    row, -1 outside the draft vocabulary (None: from the head's d2t).
    -> (weighted CE sum, weight sum, chain accepted-length sum, chains): a chain is a row of `rows` whose
    step-0 prediction is in the response, its accepted length 1 + the steps its top-1 gets right in a row."""
    length = ids.shape[0]
    total, weights = features.new_zeros((), dtype=torch.float32), features.new_zeros((), dtype=torch.float32)
    if loss_from >= length:  # nothing to predict
        return total, weights, 0, 0
    if rows is None:  # a row before this predicts only prompt tokens at every step
        rows = torch.arange(max(loss_from - 1 - steps, 0), length - 1, device=ids.device)
    if rows.numel() == 0:
        return total, weights, 0, 0
    if column is None:
        column = draft_columns(head)
    hits = []
    for k, state in enumerate(ttt_forward(head, embed, features, ids, steps, rows)):
        state = state[rows] if k == 0 else state  # [N, H]
        pos = rows + 2 + k  # the token each row predicts
        inside = (pos < length) & (pos >= loss_from)
        target = column[ids[pos.clamp(max=length - 1)]]
        valid = inside & (target >= 0)
        logits = head.lm_head(head.norm(state[inside])).float()  # [n, Vd]
        ce = F.cross_entropy(logits, target[inside].clamp(min=0), reduction="none")
        total = total + decay**k * (ce * valid[inside]).sum()
        weights = weights + decay**k * valid.sum()
        right = torch.zeros_like(valid)
        right[inside] = logits.argmax(-1) == target[inside]
        hits.append(right & valid)
    chain = (rows + 2 >= loss_from) & (rows + 2 < length)  # [N]: step 0 predicts a response token
    accepted = int(chain.sum()) + int(torch.stack(hits)[:, chain].long().cumprod(0).sum())
    return total, weights, accepted, int(chain.sum())


def draft_columns(head: Eagle3Head) -> Tensor:
    """[V]: target token id -> its row of the head's lm_head, -1 where the draft vocabulary lacks it."""
    c = head.config
    column = torch.full((c.vocab_size,), -1, dtype=torch.long, device=head.d2t.device)
    rows = torch.arange(c.draft_vocab_size, device=head.d2t.device)
    column[head.target_ids(rows)] = rows
    return column


def start_from(head: Eagle3Head, path) -> None:
    """Copy an EAGLE-3 folder's weights into `head` (the same config but for its vocabulary map)."""
    src = read_eagle3(path)
    a, b = src.config, head.config
    differ = [k for k in a.__dataclass_fields__ if getattr(a, k) != getattr(b, k)]
    if differ:
        raise GlanceError(f"--init-from {path}: its {', '.join(differ)} differ from this run's; pick an EAGLE-3 "
                          "head of the same shape, target layers and draft vocabulary size")
    with torch.no_grad():
        head.load_state_dict(src.state_dict())


class Eagle3Objective:
    """The EAGLE-3 head a run trains (`model`: fc, one decoder layer, norm, lm_head over the draft
    vocabulary), the target's frozen embedding, and training-time test's `loss`."""

    def __init__(self, target, cfg: TrainConfig, layer_ids: tuple[int, ...], vocab: Tensor | None, bf16: bool,
                 seqs: list[Sequence] = ()):  # seqs: unused (GLANCE's --init-layers calibrates on them)
        head = init_eagle3(target, None if vocab is None else len(vocab), seed=cfg.seed,
                           target_layer_ids=layer_ids).head.float()
        if vocab is not None:
            head.use_vocabulary(vocab)
        with torch.no_grad():  # the target's output layer, restricted to the draft vocabulary
            rows = head.target_ids(torch.arange(head.config.draft_vocab_size))
            head.lm_head.weight.copy_(target.parts.lm_head.weight.detach()[rows.to(target.device)].float().cpu())
            head.norm.weight.copy_(target.parts.text_model.norm.weight.detach().float().cpu())
        if cfg.init_from:
            start_from(head, cfg.init_from)
        self.model = head.train().requires_grad_(True)
        self.embed = target.parts.text_model.embed_tokens.weight.detach().float()  # [V, H]
        self.column = draft_columns(head)
        self.steps, self.decay, self.anchored = cfg.ttt_steps, cfg.ttt_decay, cfg.ttt_positions == "anchors"

    def loss(self, picks: list[tuple[Sequence, Tensor]], training: bool = True) -> tuple[Tensor, Tensor, int, int]:
        """(weighted CE sum, weight sum, chain accepted-length sum, chains) over the picks' sequences: at
        every response position (EAGLE-3's), or (`ttt_positions="anchors"`) at the GLANCE picks' anchors
        only: a chain from anchor a is row a-1, and predicts the tokens a GLANCE block there does."""
        out = [ttt_loss(self.model, self.embed, seq.features, seq.ids, seq.prompt_len + 1, self.steps, self.decay,
                        self.column, anchors - 1 if self.anchored else None) for seq, anchors in picks]
        return (sum(o[0] for o in out), sum(o[1] for o in out), sum(o[2] for o in out), sum(o[3] for o in out))

    @staticmethod
    def save(model, path, dtype: torch.dtype) -> None:
        save_eagle3(model, path, dtype=dtype)

    @staticmethod
    def read(path, target, dtype: torch.dtype = torch.float32) -> Eagle3Head:
        return read_eagle3(path, target.text_config.num_hidden_layers, dtype=dtype)

    @staticmethod
    def drafter(model, target) -> Eagle3Drafter:
        """What `Decoder` drafts with: EAGLE-3's trees from a copy in the target's dtype."""
        head = copy.deepcopy(model).to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        return Eagle3Drafter(head)
