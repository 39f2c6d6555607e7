"""An independent EAGLE-3 head for the tests, built from transformers' Llama parts (its RMSNorm, MLP,
rotary embedding, `apply_rotary_pos_emb` and `repeat_kv`) and laid out with the published checkpoints'
tensor names, so a checkpoint's state dict loads into it strictly. It runs a causal sequence of rows
the way the reference trainers do: q, k and v from cat(input_layernorm(embedding), hidden_norm(state)),
the state as the residual (hidden_norm(state) where the config sets `norm_before_residual`, as vLLM's
llama_eagle3 picks `_norm_before_residual` / `_norm_after_residual`), the MLP, then `norm` and
`lm_head`."""

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)


class ReferenceAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.cfg = cfg

    def forward(self, x, cos, sin):  # x [B, T, 2H]
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        scores = q @ k.transpose(-1, -2) / c.head_dim**0.5
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, t, -1))


class ReferenceLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = ReferenceAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if getattr(cfg, "norm_before_residual", False):  # vLLM's choice, made once at construction
            self.residual_norm = self.norm_before_residual
        else:
            self.residual_norm = self.norm_after_residual

    def norm_before_residual(self, hidden_states):  # -> (hidden_norm'd state, residual)
        hidden_states = self.hidden_norm(hidden_states)
        residual = hidden_states
        return hidden_states, residual

    def norm_after_residual(self, hidden_states):
        residual = hidden_states
        hidden_states = self.hidden_norm(hidden_states)
        return hidden_states, residual


class ReferenceEagle3(nn.Module):
    def __init__(self, cfg: LlamaConfig, target_hidden_size: int, draft_vocab_size: int):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = ReferenceLayer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(self, embeds, state, positions):
        """embeds, state [B, T, H] (state: fc of the target's features, or the head's own), positions
        [B, T] -> (next states [B, T, H], logits [B, T, Vd])."""
        layer = self.midlayer
        cos, sin = self.rotary(embeds, positions)
        normed, residual = layer.residual_norm(state)
        x = torch.cat([layer.input_layernorm(embeds), normed], -1)
        h = residual + layer.self_attn(x, cos, sin)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, self.lm_head(self.norm(h))


def reference_config(c) -> LlamaConfig:
    """The LlamaConfig a reference of glance's `Eagle3Config` c runs."""
    return LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                       head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size,
                       max_position_embeddings=c.max_position_embeddings, hidden_act="silu",
                       rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                       norm_before_residual=c.norm_before_residual)


def reference_from_folder(path) -> tuple[ReferenceEagle3, list[int]]:
    """A folder read as vLLM reads it, with transformers' own config and safetensors: the reference head
    (a strict load of every tensor) and the target layers whose outputs it fuses (vLLM's top-level
    `eagle_aux_hidden_state_layer_ids` are hidden_states indices: j is layer j - 1's output)."""
    from safetensors.torch import load_file

    cfg = LlamaConfig.from_pretrained(path)
    ref = ReferenceEagle3(cfg, cfg.target_hidden_size, cfg.draft_vocab_size)
    ref.load_state_dict(load_file(f"{path}/model.safetensors"), strict=True)
    return ref.eval(), [j - 1 for j in cfg.eagle_aux_hidden_state_layer_ids]
