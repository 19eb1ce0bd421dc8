"""LLaMA-style decoder: pre-RMSNorm blocks, SwiGLU, RoPE, no biases; attention is any variant.

    Y  = X + Attn(RMSNorm(X))
    X' = Y + SwiGLU(RMSNorm(Y)),   SwiGLU(X) = (silu(X W_G) * X W_1) W_2
"""

from __future__ import annotations

import hashlib
import inspect
import math
import types

import torch
import torch.utils.checkpoint
from torch import nn

from diffexp.kernels.registry import step_replay
from diffexp.model.attention import build_attention, variant
from diffexp.model.blocks import DecoderBlock, RMSNorm
from diffexp.model.cache import DecoderCache
from diffexp.model.compile import compile_unavailable
from diffexp.model.config import ModelConfig

#: how attention's FLOPs count keys: "causal" (T/2 per query, diffexp's) or "palm" (T, PaLM's MFU)
FLOP_CONVENTIONS = ("causal", "palm")


def named_seed(seed: int, name: str) -> int:
    """A seed for the weights of module `name` in a run seeded `seed` (stable across processes and machines)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):  # building draws nothing from the run's random stream
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.blocks = nn.ModuleList(
                DecoderBlock(cfg.d_model, cfg.resolved_ffn_hidden, cfg.norm_eps, build_attention(cfg, i))
                for i in range(cfg.n_layers))
            self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.checkpoint_activations = False  # recompute each block in the backward (set by diffexp.parallel)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each module's weights from a generator seeded by the run's seed and the module's name: variants built
        under one seed start equal wherever they share a weight by name and shape (a paired comparison), and the
        run's random stream is left as it was.

        N(0, init_std) for embeddings and linears; residual outputs scaled by 1/sqrt(2 n_layers). A linear marked
        `keep_default_init` (`AttentionBase.linear(..., default_init=True)`) keeps PyTorch's nn.Linear init; other
        modules with a `reset_parameters` (DIFF's lambda vectors, Shared DIFF's low-rank factors) draw their own.
        """
        if self.embed.weight.is_meta:  # a model for counting (diffexp params, memory plans): no values to draw
            return
        seed, std = torch.initial_seed(), self.cfg.init_std
        residual_outs = {id(m) for block in self.blocks for m in (block.attn.o_proj, block.ffn.down_proj)}
        for name, module in self.named_modules():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(named_seed(seed, name))
                if isinstance(module, nn.Linear) and getattr(module, "keep_default_init", False):
                    module.reset_parameters()
                elif isinstance(module, (nn.Linear, nn.Embedding)):
                    scale = math.sqrt(2 * self.cfg.n_layers) if id(module) in residual_outs else 1.0
                    nn.init.normal_(module.weight, 0.0, std / scale)
                elif module is not self and callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()

    def forward(self, idx: torch.Tensor, need_weights: bool = False, cache: DecoderCache | None = None,
                head: bool = True):
        """Logits (B, T, vocab); with need_weights also each layer's effective map (B, h, T, T). head=False:
        the final-normed hidden states (B, T, d_model) instead, for a loss that applies lm_head in chunks.

        With a cache (`new_cache()`), idx holds the tokens after the cached ones (a prompt, one token or a
        chunk) and the cache grows by them: prefill + decode gives the logits of one full forward."""
        if cache is not None:
            if need_weights:
                raise ValueError("need_weights reads whole maps: run a full forward, without a cache")
            cache.begin(idx.shape[0], idx.shape[1], idx.device)
            logits = self._logits(idx, cache)
            cache.advance(idx.shape[1])
            return logits
        return self._logits(idx, need_weights=need_weights, head=head)

    def _logits(self, idx: torch.Tensor, cache: DecoderCache | None = None, need_weights: bool = False,
                head: bool = True):
        x = self.embed(idx)
        maps = []
        recompute = self.checkpoint_activations and torch.is_grad_enabled() and cache is None and not need_weights
        for i, block in enumerate(self.blocks):
            if recompute:
                x, weights = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
                continue
            x, weights = block(x, need_weights, None if cache is None else cache.layers[i])
            maps.append(weights)
        logits = self.lm_head(self.final_norm(x)) if head else self.final_norm(x)
        return (logits, maps) if need_weights else logits

    def new_cache(self, capacity: int | None = None, static: bool = False) -> DecoderCache:
        """An empty decoding cache for this model (any batch size; it takes the batch of the first call).
        capacity: the positions it can hold (default max_seq_len); static: allocate them all at once, and
        decoding steps read the whole capacity (fixed shapes, as a compiled step needs)."""
        attention = type(self.blocks[0].attn)
        if "cache" not in inspect.signature(attention.forward).parameters:
            raise ValueError(f"attention {self.cfg.attention!r} ({attention.__name__}) has no decoding with a cache: "
                             "its forward takes no `cache` argument")
        return DecoderCache(self.cfg.n_layers, self.cfg.max_seq_len, capacity, static)

    def decode_step(self, token: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """Logits (B, vocab) of one token per row (B, 1) after the cache: each row at its own position, through
        the compiled step after `compile_decoding` when the cache is static."""
        cache.begin(token.shape[0], 1, token.device, step=True)
        token = token.contiguous()  # one layout for the compiled step, whatever tensor the ids were sliced from
        if self._compiled_step is None or not cache.static:  # a growing cache would recompile each step
            logits = self._step_logits(token, cache)
        elif self._replay is None:
            logits = self._compiled_step(token, cache)
        else:
            logits = self._replay(lambda ids: self._compiled_step(ids, cache), (token,),
                                  epoch=(cache.serial, cache.allocations),
                                  watched=lambda: [*self.parameters(), *self.buffers()],
                                  restored=cache.running_sums)
        cache.advance(1)
        return logits

    def _step_logits(self, token: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        return self._logits(token, cache)[:, -1]

    _compiled_step = None
    _compiled_mode: str | None = None
    _replay = None

    def compile_decoding(self, mode: str | None = None) -> str | None:
        """Compile `decode_step` with torch.compile (inductor) for static caches; mode "reduce-overhead" (the
        default on a GPU) also replays it as a CUDA graph (diffexp.kernels' step replay). Returns why it cannot run
        here, else None."""
        device = next(self.parameters()).device
        if mode is None:
            mode = "reduce-overhead" if device.type == "cuda" else "default"
        if mode not in ("default", "reduce-overhead"):
            raise ValueError(f"mode {mode!r}: expected 'default' or 'reduce-overhead'")
        if self._compiled_mode == mode:
            return None
        replay = step_replay(device.type) if mode == "reduce-overhead" else None
        if mode == "reduce-overhead" and replay is None:
            return f"no step replay (CUDA graph) for {device.type} devices"
        reason = compile_unavailable(device)
        if reason is not None:
            return reason
        self._compiled_step = torch.compile(self._own_step(), dynamic=False, fullgraph=True)
        self._replay = None if replay is None else replay()
        self._compiled_mode = mode
        return None

    def _own_step(self):
        """`_step_logits` bound to this model through a code object of its own: dynamo keeps its compiled graphs per
        code object, so models never look up (or count against the recompile limit of) each other's steps."""
        shared = Decoder._step_logits
        step = types.FunctionType(shared.__code__.replace(), shared.__globals__, shared.__name__)
        return types.MethodType(step, self)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            params.pop(id(self.embed.weight), None)
            params.pop(id(self.lm_head.weight), None)
        return sum(p.numel() for p in params.values())

    def flops_per_token(self, seq_len: int, training: bool = True, convention: str = "causal") -> float:
        """Model FLOPs per token (2 per multiply-add) at sequence length seq_len, for throughput and MFU.

        Matmuls with weights: 2 x (nn.Linear parameters). Per layer, the variant's registry entry adds what is
        not an nn.Linear (scores, attention times V, ...) over the keys a query reads: convention "causal" (diffexp's)
        counts T/2 on average, the work causal attention does; "palm" counts all T, as PaLM's 6N + 12 L H Q T (its
        appendix B) and the MFU of nanoGPT, llm-foundry and llm.c do. The logical count: FlashAttention's
        recomputation and V splitting are not counted. Training = 3 x forward.
        """
        if convention not in FLOP_CONVENTIONS:
            raise ValueError(f"convention {convention!r}: expected one of {', '.join(FLOP_CONVENTIONS)}")
        forward = self._forward_flops(keys=seq_len / 2 if convention == "causal" else seq_len)
        return forward * (3 if training else 1)

    def decode_flops_per_token(self, context: int) -> float:
        """Forward FLOPs of one token decoded with a cache of `context` positions (it reads context + 1 keys)."""
        return self._forward_flops(keys=context + 1)

    def _forward_flops(self, keys: float) -> float:
        linear = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 2 * linear + self.cfg.n_layers * variant(self.cfg.attention).attention_flops(self.cfg, keys)

    def parameter_report(self) -> dict[str, int]:
        """Parameter counts per kind of module, for the logs, the recipes' headers and Shared DIFF's claims.

        qk_projections: what makes queries and keys (every variant's `q_proj` and `k_proj`: for Shared DIFF
        the bases and the low-rank factors), the part of the attention in which Shared DIFF differs from DIFF.
        """
        attn = sum(p.numel() for b in self.blocks for p in b.attn.parameters())
        ffn = sum(p.numel() for b in self.blocks for p in b.ffn.parameters())
        qk = sum(p.numel() for b in self.blocks for name in ("q_proj", "k_proj")
                 if isinstance(getattr(b.attn, name, None), nn.Module) for p in getattr(b.attn, name).parameters())
        return {"total": self.num_parameters(), "non_embedding": self.num_parameters(True),
                "attention": attn, "ffn": ffn, "qk_projections": qk}
