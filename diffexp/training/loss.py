"""Next-token cross-entropy from the final hidden states, a chunk of rows at a time: the fp32 logits of the whole
micro-batch (8 x 2048 rows x 32K vocab: 2 GiB) never exist at once.

Each chunk's LM-head product and fp32 cross-entropy run under activation checkpointing, so the forward keeps
only the chunk's inputs and the backward recomputes one chunk's logits at a time (one more LM-head product, as
torchtitan's and Liger-Kernel's chunked losses pay). Per-row losses are the plain loss's: each row's logits are
the same product; the LM head's gradient is summed over chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: logits per chunk (32M: 128 MiB in fp32; 1,024 rows of a 32K vocabulary)
CHUNK_LOGITS = 2**25


def _chunk_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none")


def chunk_rows(vocab_size: int, chunk_logits: int | None = None) -> int:
    """Rows of logits per chunk (CHUNK_LOGITS unless given); the memory estimate counts one chunk's."""
    return max(1, (CHUNK_LOGITS if chunk_logits is None else chunk_logits) // vocab_size)


def token_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                 chunk_logits: int | None = None) -> torch.Tensor:
    """Per-target losses (fp32, targets' shape) of logits = hidden @ weight.T, as
    F.cross_entropy(logits.float(), targets, reduction="none") gives them, computed in chunks of rows."""
    rows = chunk_rows(weight.shape[0], chunk_logits)
    flat_hidden, flat_targets = hidden.flatten(0, -2), targets.flatten()
    if flat_hidden.shape[0] <= rows:
        return _chunk_losses(flat_hidden, weight, flat_targets).view_as(targets)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    losses = [checkpoint(_chunk_losses, h, weight, t, use_reentrant=False) if recompute
              else _chunk_losses(h, weight, t)
              for h, t in zip(flat_hidden.split(rows), flat_targets.split(rows))]
    return torch.cat(losses).view_as(targets)
