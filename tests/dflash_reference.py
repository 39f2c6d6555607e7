"""An independent stand-in for z-lab/dflash's reference (`DFlashDraftModel` + `dflash_generate`), written
for these tests from transformers' Qwen3 parts, to check that glance-rt's drafter folders are what that
reference loads and that it drafts the same tokens. It is deliberately not glance-rt code: it reads the
folder with transformers (`Qwen3Config.from_pretrained`), builds modules under DFlash's tensor names, loads
the weights strictly (every name and shape must match), rotates with transformers' `Qwen3RotaryEmbedding`
and decodes DFlash's way (HF target with a `DynamicCache`, one width-1 block per round, verify, crop).
"""

from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's rule: the middle layer for one draft layer, else evenly from layer 1 to L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        d = cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.heads * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, cache: list, layer: int):
        """x [1, Q, H] noise rows, ctx [1, C, H] new context rows; cos/sin cover [C + Q] positions."""
        q_len, c_len, d = x.shape[1], ctx.shape[1], self.head_dim
        q = self.q_norm(self.q_proj(x).view(1, q_len, self.heads, d)).transpose(1, 2)  # [1, nh, Q, D]
        both = torch.cat([ctx, x], 1)  # keys and values of the context rows, then of the noise rows
        k = self.k_norm(self.k_proj(both).view(1, c_len + q_len, self.kv_heads, d)).transpose(1, 2)
        v = self.v_proj(both).view(1, c_len + q_len, self.kv_heads, d).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, C+Q, D]
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        if cache[layer] is not None:
            k = torch.cat([cache[layer][0], k], 2)
            v = torch.cat([cache[layer][1], v], 2)
        cache[layer] = (k, v)
        g = self.heads // self.kv_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        w = torch.softmax((q @ k.transpose(-1, -2)).float() * d**-0.5, -1).to(q.dtype)  # no mask: all rows
        return self.o_proj((w @ v).transpose(1, 2).reshape(1, q_len, -1))


class Layer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class ReferenceDrafter(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        dflash = cfg.dflash_config
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.target_layer_ids = dflash.get("target_layer_ids",
                                           default_layer_ids(cfg.num_target_layers, cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg)
        self.fc = nn.Linear(len(self.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.block_size = cfg.block_size
        self.mask_token_id = dflash.get("mask_token_id")

    def forward(self, noise, target_hidden, position_ids, cache):
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise, position_ids)
        for i, layer in enumerate(self.layers):
            noise = layer(noise, ctx, cos, sin, cache, i)
        return self.norm(noise)


def load_reference(folder) -> ReferenceDrafter:
    """The folder as DFlash's reference loads it; strict: a missing, extra or misshapen tensor raises."""
    from safetensors.torch import load_file

    cfg = Qwen3Config.from_pretrained(folder)
    model = ReferenceDrafter(cfg).float().eval()
    model.load_state_dict({k: v.float() for k, v in load_file(Path(folder) / "model.safetensors").items()},
                          strict=True)
    return model


def hidden_features(hidden_states, layer_ids) -> torch.Tensor:
    return torch.cat([hidden_states[i + 1] for i in layer_ids], -1)  # HF: index 0 is the embeddings


@torch.inference_mode()
def reference_chain(drafter: ReferenceDrafter, model, input_ids: torch.Tensor, max_new_tokens: int):
    """DFlash's decoding loop, greedy. -> (new token ids, accepted length of every round)."""
    text = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    embed, head = text.embed_tokens, model.get_output_embeddings()
    b, n = drafter.block_size, input_ids.shape[1]
    total = n + max_new_tokens
    ids = torch.full((1, total + b), drafter.mask_token_id, dtype=torch.long)
    positions = torch.arange(total + b)[None]
    t_cache, d_cache = DynamicCache(), [None] * len(drafter.layers)
    out = model(input_ids, position_ids=positions[:, :n], past_key_values=t_cache, use_cache=True,
                output_hidden_states=True)
    ids[:, :n] = input_ids
    ids[0, n] = out.logits[0, -1].argmax()
    hidden = hidden_features(out.hidden_states, drafter.target_layer_ids)
    start, lengths = n, []
    while start < total:
        block = ids[:, start:start + b].clone()
        cached = 0 if d_cache[0] is None else d_cache[0][0].shape[2]
        h = drafter(embed(block), hidden, positions[:, cached:start + b], d_cache)
        block[:, 1:] = head(h[:, 1:]).argmax(-1)
        d_cache[:] = [(k[:, :, :start], v[:, :, :start]) for k, v in d_cache]  # drop the noise rows
        out = model(block, position_ids=positions[:, start:start + b], past_key_values=t_cache, use_cache=True,
                    output_hidden_states=True)
        post = out.logits.argmax(-1)
        acc = int((block[:, 1:] == post[:, :-1]).cumprod(1).sum())
        ids[:, start:start + acc + 1] = block[:, :acc + 1]
        ids[:, start + acc + 1] = post[:, acc]
        start += acc + 1
        extra = t_cache.get_seq_length() - start
        if extra > 0:  # drop the rejected rows (transformers 5 crops by a negative count)
            t_cache.crop(-extra)
        lengths.append(acc + 1)
        hidden = hidden_features(out.hidden_states, drafter.target_layer_ids)[:, :acc + 1]
    return ids[0, n:total].tolist(), lengths
