"""A Llama shaped like Hugging Face's ``LlamaForCausalLM``, for ``python -m benchmarks --model hf-llama``.

The benchmark's own model (fsdp_compile/models.py) calls each block as ``block(x, cos, sin)`` and gets
a tensor back. Real Hugging Face blocks are called differently, and the FSDP hooks around them see
that: this model copies the structure and calling convention of transformers' modeling_llama.py
(v4.5x), without depending on transformers (which the project does not install):

- ``LlamaForCausalLM`` (``model``, ``lm_head``) over ``LlamaModel`` (``embed_tokens``, ``layers``,
  ``norm``, ``rotary_emb``), so the decoder layers are ``model.model.layers``;
- the root computes once per forward what every layer takes: ``position_ids`` (``cache_position``
  unsqueezed), the rotary ``position_embeddings = (cos, sin)`` from ``LlamaRotaryEmbedding`` (in
  float32 under a disabled autocast, per position id, as HF does), and a 4-D boolean causal mask;
- each ``LlamaDecoderLayer`` is called with keyword arguments only: ``hidden_states=``,
  ``attention_mask=``, ``position_ids=``, ``past_key_values=None``, ``use_cache=False``,
  ``cache_position=``, ``position_embeddings=(cos, sin)`` (a tuple of tensors), and returns a tuple
  ``(hidden_states,)``, of which the root takes ``[0]``;
- attention is grouped-query (``num_key_value_heads < num_attention_heads``): k and v are projected to
  the key-value heads and ``repeat_kv``'d up to the query heads before
  ``F.scaled_dot_product_attention`` with the mask as ``attn_mask`` (HF's SDPA path when it does not
  drop the mask), returning ``(attn_output, attn_weights=None)``;
- ``LlamaRMSNorm`` (float32 variance, weight times the input dtype), rotary by ``rotate_half`` (halves,
  not interleaved pairs), SiLU-gated MLP (``gate_proj``, ``up_proj``, ``down_proj``), no biases,
  weights initialized normal(0, 0.02) as HF's ``_init_weights``.

``forward(input_ids)`` returns the logits tensor (not a ``CausalLMOutputWithPast``), so the benchmark's
step and loss are the same for both models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["HFLlamaConfig", "LlamaForCausalLM", "LlamaDecoderLayer", "TP_PLAN"]


@dataclass(frozen=True)
class HFLlamaConfig:
    """The fields of transformers.LlamaConfig this model reads (HF's names)."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 0  # 0: 8/3 * hidden rounded up to a multiple of 16, as the benchmark's own model
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    @property
    def intermediate(self) -> int:
        return self.intermediate_size or 16 * math.ceil(8 * self.hidden_size / 3 / 16)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    # The names the benchmark's report reads off either model's config.
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers


# Tensor parallelism with torchtitan's styles on HF's names (colwise q/k/v and gate/up, rowwise o and
# down); the attention takes its local head counts from the projections' widths.
TP_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config: HFLlamaConfig) -> None:
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0  # "default" rope type

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        device_type = x.device.type if isinstance(x.device.type, str) and x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):  # force float32
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[batch, kv_heads, seq, head_dim] -> [batch, kv_heads * n_rep, seq, head_dim]."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def sdpa_attention_forward(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, **kwargs):
    """HF's ``sdpa_attention_forward``: repeat_kv, then SDPA with the mask (or is_causal without one)."""
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    attn_output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
    )
    return attn_output.transpose(1, 2).contiguous(), None


class LlamaAttention(nn.Module):
    def __init__(self, config: HFLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = 0.0
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, past_key_values=None, cache_position=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            raise NotImplementedError("no KV cache: the benchmark trains")
        attn_output, attn_weights = sdpa_attention_forward(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class LlamaMLP(nn.Module):
    def __init__(self, config: HFLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate, bias=False)
        self.down_proj = nn.Linear(config.intermediate, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: HFLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        cache_position: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor]:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache, cache_position=cache_position,
            position_embeddings=position_embeddings, **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return (hidden_states,)


def causal_mask(cache_position: torch.Tensor, batch: int, dtype_device: torch.Tensor) -> torch.Tensor:
    """HF's ``sdpa_mask`` when it keeps the mask: ``[batch, 1, q_len, kv_len]`` bool, True where attended."""
    kv = torch.arange(cache_position.shape[0], device=dtype_device.device)
    mask = kv[None, :] <= cache_position[:, None]
    return mask[None, None, :, :].expand(batch, 1, -1, -1)


class LlamaModel(nn.Module):
    def __init__(self, config: HFLlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache_position: torch.Tensor | None = None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        inputs_embeds = self.embed_tokens(input_ids)
        if cache_position is None:
            cache_position = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        attention_mask = causal_mask(cache_position, inputs_embeds.shape[0], inputs_embeds)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            layer_outputs = decoder_layer(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=None,
                use_cache=use_cache,
                cache_position=cache_position,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            hidden_states = layer_outputs[0]
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]``; the decoder layers are ``model.layers``
    (the benchmark shards and compiles ``blocks(model)``: ``model.model.layers`` here).

    Example::

        model = LlamaForCausalLM(HFLlamaConfig(hidden_size=64, num_hidden_layers=2))
        logits = model(torch.randint(0, 256, (2, 16)))
    """

    def __init__(self, config: HFLlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, LlamaRMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden_states = self.model(input_ids=input_ids, **kwargs)
        return self.lm_head(hidden_states)
