"""The EAGLE-3 head's training pass and loss: training-time test (issue 38, the baseline's half of
`glance-rt train`; the loop that runs it is still GLANCE's alone).

EAGLE-3 drafts from its own states after the first step, so it is trained on them: the head is unrolled
`steps` times over a sequence, each step's rows reading the states the step before produced, with a
cross-entropy loss at every step. Step 0's row t pairs fc of the target's features at t with token t+1
and predicts token t+2; step k's row t pairs step k-1's output of row t with token t+1+k at RoPE
position t+k and predicts token t+2+k. Row t at step k attends the step-0 rows up to t (the committed
context) and its own rows of steps 1..k (its draft ancestors): exactly what `Eagle3Pass` shows the same
row when it drafts those tokens, so a head trained here drafts as it was trained (tested against a
from-scratch recomputation). The targets are the response store's tokens (the target's greedy answers),
as for the GLANCE drafter; step k's loss is weighted `decay ** k` (EAGLE-3's 0.8).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from glance_rt.models.drafter import rope, rope_tables
from glance_rt.models.eagle3 import Eagle3Head

DEFAULT_STEPS = 7  # EAGLE-3's unroll (SpecForge's ttt_length)
DEFAULT_DECAY = 0.8


def ttt_forward(head: Eagle3Head, embed: Tensor, features: Tensor, ids: Tensor, steps: int) -> list[Tensor]:
    """The unrolled pass over one sequence: features [L, 3Ht] (the target's fused layer outputs at every
    token), ids [L] -> each step's output states [L-1, H] (row t of step k predicts ids[t+2+k]; rows past
    the sequence's end read padding and are the loss's to ignore). `embed`: the token embedding [V, H]."""
    c = head.config
    rows = ids.shape[0] - 1  # row t pairs the state at t with token t+1
    dev, dtype = features.device, head.fc.weight.dtype
    inv_freq, scaling = rope(c)
    groups = c.num_attention_heads // c.num_key_value_heads
    t = torch.arange(rows, device=dev)
    causal = t[None, :] <= t[:, None]  # [R, R]: step 0's rows up to t
    own = torch.eye(rows, dtype=torch.bool, device=dev)  # [R, R]: a later step's row t itself
    keys, values, outs = [], [], []
    state = head.fuse(features[:rows])[None]  # [1, R, H]
    padded = torch.cat([ids, ids.new_zeros(steps)])  # tokens past the end: padding (no loss reads them)
    for k in range(steps):
        cos, sin = rope_tables(inv_freq.to(dev), t + k, dtype, scaling)
        tokens = embed[padded[1 + k : 1 + k + rows]][None].to(dtype)  # [1, R, H]: token t+1+k

        mask = torch.cat([causal, *([own] * k)], 1)[None, None]  # [1, 1, R, (k+1)R]

        def attend(q, key, value, mask=mask):  # step k's keys join the earlier steps'
            keys.append(key)
            values.append(value)
            kk = torch.cat(keys, 2).repeat_interleave(groups, 1)
            vv = torch.cat(values, 2).repeat_interleave(groups, 1)
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

        state, _ = head(tokens, state, cos, sin, attend)
        outs.append(state[0])
    return outs


def ttt_loss(head: Eagle3Head, embed: Tensor, features: Tensor, ids: Tensor, loss_from: int, steps: int = DEFAULT_STEPS,
             decay: float = DEFAULT_DECAY) -> tuple[Tensor, Tensor, Tensor]:
    """Training-time test's loss for one sequence: at step k, CE of row t's draft logits against
    ids[t+2+k] for the predicted positions t+2+k >= `loss_from` (the response) inside the sequence, whose
    token is in the draft vocabulary, weighted decay**k. -> (weighted CE sum, weight sum, top-1 correct
    per step [steps] (the chain's per-depth accuracy))."""
    rows = ids.shape[0] - 1
    column = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
    column[head.target_ids(torch.arange(head.config.draft_vocab_size, device=ids.device))] = torch.arange(
        head.config.draft_vocab_size, device=ids.device)  # target id -> draft row (-1: not draftable)
    total, weights, correct = features.new_zeros((), dtype=torch.float32), 0.0, []
    for k, state in enumerate(ttt_forward(head, embed, features, ids, steps)):
        pos = torch.arange(rows, device=ids.device) + 2 + k  # the token each row predicts
        inside = pos < ids.shape[0]
        target = column[ids[pos.clamp(max=ids.shape[0] - 1)]]
        valid = inside & (pos >= loss_from) & (target >= 0)
        logits = head.lm_head(head.norm(state)).float()  # [R, Vd]
        ce = F.cross_entropy(logits, target.clamp(min=0), reduction="none")
        total = total + decay**k * (ce * valid).sum()
        weights += decay**k * float(valid.sum())
        correct.append(((logits.argmax(-1) == target) & valid).sum())
    return total, torch.tensor(weights), torch.stack(correct)
