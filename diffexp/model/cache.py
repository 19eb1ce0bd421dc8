"""Incremental decoding state: each layer's keys, values and (DINT) running sums of past tokens.

A forward with a cache reads positions cache.length .. cache.length + T - 1: RoPE rotates the new
queries and keys at those positions, the new keys and values are appended, and the new queries attend
to every cached key. Prefill (the prompt at once), single tokens and chunks are the same call.
What a variant caches is its own business (`LayerCache.append(name=tensor, ...)`); the buffers grow
by doubling, so appending a token costs O(1) amortised instead of a copy of the whole history.
"""

from __future__ import annotations

import torch


class LayerCache:
    """Named (B, heads, T, dim) tensors of one layer, grown along T, plus per-layer extra state."""

    def __init__(self) -> None:
        self.length = 0
        self._buffers: dict[str, torch.Tensor] = {}
        #: state of a variant that is not one entry per cached token and head (DINT's column sums are)
        self.state: dict[str, torch.Tensor] = {}

    def append(self, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append each named tensor's T new positions; returns the full tensors (views), in argument order."""
        steps = {t.shape[-2] for t in new.values()}
        if len(steps) != 1:
            raise ValueError(f"appending different numbers of positions at once: {sorted(steps)}")
        step = steps.pop()
        end = self.length + step
        full = []
        for name, tensor in new.items():
            buffer = self._buffers.get(name)
            if buffer is None or buffer.shape[-2] < end:
                buffer = self._grow(buffer, tensor, end)
                self._buffers[name] = buffer
            buffer[..., self.length:end, :] = tensor
            full.append(buffer[..., :end, :])
        self.length = end
        return tuple(full)

    def _grow(self, buffer: torch.Tensor | None, like: torch.Tensor, needed: int) -> torch.Tensor:
        capacity = max(needed, 2 * (buffer.shape[-2] if buffer is not None else 0), 16)
        grown = like.new_empty(*like.shape[:-2], capacity, like.shape[-1])
        if buffer is not None:
            grown[..., : self.length, :] = buffer[..., : self.length, :]
        return grown

    def mark(self) -> tuple[int, dict[str, torch.Tensor]]:
        """A point to rewind to: the length and a copy of the state (O(T) numbers per head at most)."""
        return self.length, {name: state.clone() for name, state in self.state.items()}

    def rewind(self, mark: tuple[int, dict[str, torch.Tensor]]) -> None:
        """Forget every position after the mark (their buffer entries are overwritten by the next append)."""
        self.length, state = mark
        self.state = {name: value.clone() for name, value in state.items()}

    def bytes(self) -> int:
        """Bytes held for the cached positions (not the spare capacity), state included."""
        held = sum(b[..., : self.length, :].numel() * b.element_size() for b in self._buffers.values())
        return held + sum(s.numel() * s.element_size() for s in self.state.values())


class DecoderCache:
    """One LayerCache per decoder layer; `length` is the number of positions decoded so far."""

    def __init__(self, n_layers: int, max_seq_len: int) -> None:
        self.layers = [LayerCache() for _ in range(n_layers)]
        self.max_seq_len = max_seq_len

    @property
    def length(self) -> int:
        return self.layers[0].length

    def check_room(self, new_positions: int) -> None:
        """A clear error before any work when the positions would pass the model's max_seq_len (RoPE's table)."""
        if self.length + new_positions > self.max_seq_len:
            raise ValueError(f"{self.length} cached + {new_positions} new positions exceed the model's "
                             f"max_seq_len={self.max_seq_len}")

    def mark(self) -> list:
        """A point to rewind to (a benchmark decodes the same tokens again after one prefill)."""
        return [layer.mark() for layer in self.layers]

    def rewind(self, mark: list) -> None:
        for layer, layer_mark in zip(self.layers, mark, strict=True):
            layer.rewind(layer_mark)

    def bytes(self) -> int:
        return sum(layer.bytes() for layer in self.layers)

    def bytes_per_token(self) -> float:
        """Cache bytes per cached position, over the batch (divide by the batch size for one sequence)."""
        return self.bytes() / self.length if self.length else 0.0
