"""The baseline as transformers' `LlamaForCausalLM`, and the parameter names every Llama-shaped layout shares.

Both are the same network: pre-RMSNorm blocks, SwiGLU, rotate-half RoPE, no biases, GQA with heads laid out
contiguously, so the weights map one to one. diffexp names are the Decoder's (no `model.` prefix of DiffexpLM).
"""

from __future__ import annotations

import torch

#: diffexp block parameter -> transformers' name inside `model.layers.{i}.` (the attention projections aside)
BLOCK_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "ffn.gate_proj.weight": "mlp.gate_proj.weight", "ffn.up_proj.weight": "mlp.up_proj.weight",
               "ffn.down_proj.weight": "mlp.down_proj.weight"}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def shared_config(cfg, eos_id: int | None) -> dict:
    """The config.json fields a Llama-shaped transformers model shares with diffexp's decoder."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.resolved_ffn_hidden,
            "num_hidden_layers": cfg.n_layers, "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
            "head_dim": cfg.resolved_head_dim, "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None}


def llama_config(cfg, eos_id: int | None) -> dict:
    return {**shared_config(cfg, eos_id), "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "mlp_bias": False}


def shared_weights(weights: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Embedding, norms, SwiGLU and LM head under transformers' names (the LM head left out when tied)."""
    out = {"model.embed_tokens.weight": weights["embed.weight"], "model.norm.weight": weights["final_norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = weights["lm_head.weight"]
    for i in range(cfg.n_layers):
        for ours, theirs in BLOCK_NAMES.items():
            out[f"model.layers.{i}.{theirs}"] = weights[f"blocks.{i}.{ours}"]
    return out


def shared_weights_back(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """shared_weights inverted; a tied LM head is the embedding."""
    out = {"embed.weight": hf["model.embed_tokens.weight"], "final_norm.weight": hf["model.norm.weight"],
           "lm_head.weight": hf["model.embed_tokens.weight"] if cfg.tie_embeddings else hf["lm_head.weight"]}
    for i in range(cfg.n_layers):
        for ours, theirs in BLOCK_NAMES.items():
            out[f"blocks.{i}.{ours}"] = hf[f"model.layers.{i}.{theirs}"]
    return out


def to_llama(weights: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    out = shared_weights(weights, cfg)
    for i in range(cfg.n_layers):
        for name in PROJECTIONS:
            out[f"model.layers.{i}.self_attn.{name}.weight"] = weights[f"blocks.{i}.attn.{name}.weight"]
    return out


def from_llama(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    out = shared_weights_back(hf, cfg)
    for i in range(cfg.n_layers):
        for name in PROJECTIONS:
            out[f"blocks.{i}.attn.{name}.weight"] = hf[f"model.layers.{i}.self_attn.{name}.weight"]
    return out
