"""DIFF V1 as transformers' `DiffLlamaForCausalLM`, where its flags allow (otherwise: --remote-code).

DiffLlama computes the same head, (1 - lambda_init) Norm((A1 - lambda A2) V), in its own layout (its
modeling_diffllama.py): with H = 2h query heads and 2h_kv key heads of dim d,
- query heads 0..h-1 are the first maps and h..2h-1 the second maps (diffexp interleaves: 2p and 2p + 1), and
  likewise for keys with h_kv;
- V has 2h_kv heads of dim d: head g holds the first half of diffexp's 2d-wide V of group g, head h_kv + g the
  second half;
- its head norm has no weight, so diffexp's (one weight shared by all heads, after the norm and before o_proj)
  is folded into o_proj's columns; reading back gives a weight of ones and the folded o_proj;
- lambda_init is always 0.8 - 0.6 exp(-0.3 l), and the head norm's epsilon is rms_norm_eps.
"""

from __future__ import annotations

import torch

from diffexp.hf.llama import shared_config, shared_weights, shared_weights_back

#: diffexp's head norm epsilon (diffexp.model.attention.differential); DiffLlama uses rms_norm_eps for it
HEAD_NORM_EPS = 1e-5


def unrepresentable(cfg) -> list[tuple[str, object, str]]:
    """(key, value, what DiffLlama has instead) for each setting DiffLlama cannot compute."""
    problems = []
    if cfg.lambda_init != "depth":
        problems.append(("model.arch.lambda_init", cfg.lambda_init, "DiffLlama's lambda_init is always 'depth'"))
    if not cfg.head_norm:
        problems.append(("model.arch.head_norm", cfg.head_norm, "DiffLlama always normalises each head"))
    if cfg.norm_eps != HEAD_NORM_EPS:
        problems.append(("model.arch.norm_eps", cfg.norm_eps, f"DiffLlama's head norm uses rms_norm_eps, diffexp's "
                                                             f"{HEAD_NORM_EPS:g}, so they must be equal"))
    return problems


def diff_llama_config(cfg, eos_id: int | None) -> dict:
    return {**shared_config(cfg, eos_id), "model_type": "diffllama", "architectures": ["DiffLlamaForCausalLM"],
            "num_attention_heads": 2 * cfg.n_heads, "num_key_value_heads": 2 * cfg.kv_heads,
            "attention_dropout": 0.0, "lambda_std_dev": 0.1}


def _maps_apart(weight: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """Rows of 2 * heads interleaved heads (map 1, map 2 of head 0, ...) -> all first maps, then all second."""
    per_head = weight.view(heads, 2, d, -1)
    return torch.cat([per_head[:, 0], per_head[:, 1]]).reshape(2 * heads * d, -1)


def _maps_interleaved(weight: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """_maps_apart inverted."""
    first, second = weight.view(2, heads, d, -1)
    return torch.stack([first, second], dim=1).reshape(2 * heads * d, -1)


def to_diff_llama(weights: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    h, h_kv, d = cfg.n_heads, cfg.kv_heads, cfg.resolved_head_dim
    out = shared_weights(weights, cfg)
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.attn.", f"model.layers.{i}.self_attn."
        out[theirs + "q_proj.weight"] = _maps_apart(weights[ours + "q_proj.weight"], h, d)
        out[theirs + "k_proj.weight"] = _maps_apart(weights[ours + "k_proj.weight"], h_kv, d)
        v = weights[ours + "v_proj.weight"].view(h_kv, 2, d, -1)  # each group's 2d: two halves
        out[theirs + "v_proj.weight"] = torch.cat([v[:, 0], v[:, 1]]).reshape(2 * h_kv * d, -1)
        norm_weight = weights[ours + "head_norm.weight"].repeat(h)  # one weight for every head's 2d columns
        out[theirs + "o_proj.weight"] = weights[ours + "o_proj.weight"] * norm_weight
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            out[theirs + name] = weights[f"{ours}lambda_.{name}"]
    return out


def from_diff_llama(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    h, h_kv, d = cfg.n_heads, cfg.kv_heads, cfg.resolved_head_dim
    out = shared_weights_back(hf, cfg)
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.attn.", f"model.layers.{i}.self_attn."
        out[ours + "q_proj.weight"] = _maps_interleaved(hf[theirs + "q_proj.weight"], h, d)
        out[ours + "k_proj.weight"] = _maps_interleaved(hf[theirs + "k_proj.weight"], h_kv, d)
        first, second = hf[theirs + "v_proj.weight"].view(2, h_kv, d, -1)
        out[ours + "v_proj.weight"] = torch.stack([first, second], dim=1).reshape(h_kv * 2 * d, -1)
        out[ours + "o_proj.weight"] = hf[theirs + "o_proj.weight"]
        out[ours + "head_norm.weight"] = torch.ones(2 * d, dtype=hf[theirs + "o_proj.weight"].dtype)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            out[f"{ours}lambda_.{name}"] = hf[theirs + name]
    return out
