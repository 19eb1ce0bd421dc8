"""Incremental decoding state: each layer's keys, values and (DINT) running sums, in buffers of fixed capacity.

A forward with a cache reads the positions after the cached ones. Two kinds of call:
- a chunk (a prompt, or several tokens): every row at the same position; RoPE and the writes use a Python
  offset, and attention is the training kernels' with a bottom-right causal mask;
- a step (one token per row): each row at its own position (`positions`, a tensor), so rows of different
  lengths decode together; the writes scatter, and attention masks each row's keys past its position.
A step never changes Python state, which makes it one graph for `torch.compile` (`Decoder.compile_decoding`);
`advance` moves the positions after it.

A `static` cache allocates its whole capacity at the first write and a step attends over all of it (fixed
shapes and addresses: one compiled graph, one CUDA graph); otherwise buffers grow by doubling and a step reads
only the positions written so far.
"""

from __future__ import annotations

import itertools

import torch

_SERIALS = itertools.count()


class LayerCache:
    """One layer's named (B, ..., capacity, dim) buffers, and state that is not one entry per token (DINT's)."""

    def __init__(self, owner: DecoderCache) -> None:
        self.owner = owner
        self._buffers: dict[str, torch.Tensor] = {}
        #: per-position sums a variant keeps, (B, heads, capacity) like the buffers (DINT's column sums)
        self.state: dict[str, torch.Tensor] = {}

    @property
    def length(self) -> int:
        return self.owner.length

    @property
    def stepping(self) -> bool:
        return self.owner.stepping

    @property
    def positions(self) -> torch.Tensor:
        """(B,) the position each row's new token takes during a step."""
        return self.owner.positions

    def key_lengths(self) -> torch.Tensor | None:
        """During a step, (B,): row b reads keys 0..its position; None when every key read is visible (rows of one
        length reading only the written positions)."""
        return self.owner.key_lengths()

    def append(self, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write each named tensor's new positions (axis -2); returns the buffers up to the positions read, in
        argument order."""
        owner = self.owner
        if owner.stepping:
            full = []
            rows = owner.row_index
            for name, tensor in new.items():
                buffer = self._buffer(name, tensor)
                buffer[rows, :, owner.positions] = tensor[:, :, 0]  # row b's token at its own position
                full.append(buffer[..., : owner.read_length, :])
            return tuple(full)
        start, end = owner.length, owner.length + next(iter(new.values())).shape[-2]
        full = []
        for name, tensor in new.items():
            buffer = self._buffer(name, tensor)
            buffer[..., start:end, :] = tensor
            full.append(buffer[..., :end, :])
        return tuple(full)

    def sums(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The state buffer `name`: (B, heads, capacity), fp32 at least, zero where nothing was added; `like`
        gives B, heads, dtype and device."""
        buffer = self.state.get(name)
        if buffer is None or buffer.shape[-1] < self.owner.allocated:
            dtype = torch.promote_types(like.dtype, torch.float32)
            grown = like.new_zeros(*like.shape[:2], self.owner.allocated, dtype=dtype)
            if buffer is not None:
                grown[..., : buffer.shape[-1]] = buffer
            self.state[name] = buffer = grown
            self.owner.allocations += 1
        return buffer

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[-2] < self.owner.allocated:
            grown = like.new_zeros(*like.shape[:-2], self.owner.allocated, like.shape[-1])
            if buffer is not None:
                grown[..., : buffer.shape[-2], :] = buffer
            self._buffers[name] = buffer = grown
            self.owner.allocations += 1
        return buffer

    def rows(self) -> dict[str, torch.Tensor]:
        return {**self._buffers, **{f"state:{name}": value for name, value in self.state.items()}}

    def bytes(self, lengths: list[int]) -> int:
        """Bytes held for the written positions of each row (not the spare capacity), state included."""
        total = 0
        for buffer in self._buffers.values():
            per_position = buffer[0, ..., 0, :].numel() * buffer.element_size()
            total += per_position * sum(lengths)
        for state in self.state.values():
            total += state[0, :, 0].numel() * state.element_size() * sum(lengths)
        return total


class DecoderCache:
    """One LayerCache per decoder layer. `lengths`: the positions written per row; `length`: the longest row."""

    def __init__(self, n_layers: int, max_seq_len: int, capacity: int | None = None, static: bool = False) -> None:
        if capacity is not None and not 0 < capacity <= max_seq_len:
            raise ValueError(f"capacity={capacity}: expected 1 .. the model's max_seq_len={max_seq_len}")
        if static and capacity is None:
            raise ValueError("a static cache needs its capacity")
        self.max_seq_len = max_seq_len
        self.capacity = capacity or max_seq_len
        self.static = static
        self.serial = next(_SERIALS)  # tells caches apart where one reuses a freed one's memory (a replayed step)
        self.allocations = 0  # tensors allocated so far: a replayed step is captured again when it changes
        self.allocated = self.capacity if static else 0  # positions each buffer holds
        self.layers = [LayerCache(self) for _ in range(n_layers)]
        self._lengths: list[int] = []  # set by the first call, which fixes the batch
        self.positions: torch.Tensor | None = None
        self.row_index: torch.Tensor | None = None
        self.stepping = False
        self.read_length = 0  # positions a step reads
        self._positions_current = False  # whether `positions` holds `lengths` (kept so by `advance` after a step)

    @property
    def lengths(self) -> list[int]:
        return self._lengths

    @lengths.setter
    def lengths(self, lengths: list[int]) -> None:
        self._lengths = lengths
        self._positions_current = False

    @property
    def length(self) -> int:
        return max(self.lengths, default=0)

    @property
    def ragged(self) -> bool:
        return len(set(self.lengths)) > 1

    def check_room(self, new_positions: int) -> None:
        """A clear error before any work when the positions would pass the capacity or max_seq_len (RoPE's table)."""
        if self.length + new_positions > self.capacity:
            bound = (f"the cache's capacity={self.capacity}" if self.capacity < self.max_seq_len
                     else f"the model's max_seq_len={self.max_seq_len}")
            raise ValueError(f"{self.length} cached + {new_positions} new positions exceed {bound}")
        if self.ragged and new_positions != 1:
            raise ValueError(f"rows of different lengths ({sorted(set(self.lengths))}) decode one token at a time, "
                             f"not {new_positions}")

    def begin(self, batch: int, new_positions: int, device: torch.device, step: bool | None = None) -> None:
        """Prepare a call of `new_positions` per row (host side; a compiled step runs between begin and advance).
        step: decode one token per row at each row's own position (default: whenever new_positions is 1)."""
        if not self.lengths:
            self.lengths = [0] * batch
        elif batch != len(self.lengths):
            raise ValueError(f"this cache holds {len(self.lengths)} rows; got a batch of {batch}")
        self.check_room(new_positions)
        self.stepping = new_positions == 1 if step is None else step
        if self.length + new_positions > self.allocated:
            self.allocated = min(max(self.allocated * 2, 16, self.length + new_positions), self.capacity)
        self.read_length = self.capacity if self.static else self.length + new_positions
        if self.stepping and not self._positions_current:
            positions = torch.tensor(self.lengths, dtype=torch.long, device=device)
            if self.positions is None or self.positions.shape != positions.shape:
                self.positions = positions
                self.allocations += 1
                self.row_index = torch.arange(batch, device=device)
            else:
                self.positions.copy_(positions)
            self._positions_current = True

    def key_lengths(self) -> torch.Tensor | None:
        if not self.stepping or (not self.static and not self.ragged):
            return None
        return self.positions + 1

    def advance(self, new_positions: int) -> None:
        current = self.stepping and self._positions_current
        self.lengths = [length + new_positions for length in self.lengths]
        if current:  # moved on the device: a copy from the host would make a GPU wait for each step to finish
            self.positions.add_(new_positions)
            self._positions_current = True
        self.stepping = False

    def running_sums(self) -> list[torch.Tensor]:
        """The tensors a step adds to (DINT's column sums), where its other writes only set the new position."""
        return [t for layer in self.layers for t in layer.state.values()]

    def mark(self) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
        """A point to rewind to: the lengths and a copy of the per-layer state (O(T) numbers per head at most)."""
        length = self.length
        return list(self.lengths), [{n: s[..., :length].clone() for n, s in layer.state.items()}
                                    for layer in self.layers]

    def rewind(self, mark: tuple[list[int], list[dict[str, torch.Tensor]]]) -> None:
        """Forget every position after the mark (their buffer entries are overwritten by the next write)."""
        self.lengths, states = list(mark[0]), mark[1]
        for layer, state in zip(self.layers, states, strict=True):
            for name, buffer in layer.state.items():
                kept = state.get(name, buffer[..., :0])
                with torch.inference_mode(buffer.is_inference()):  # a cache filled under inference_mode
                    buffer[..., : kept.shape[-1]].copy_(kept)
                    buffer[..., kept.shape[-1]:].zero_()

    @classmethod
    def stack(cls, caches: list[DecoderCache]) -> DecoderCache:
        """One cache whose rows are the given caches' rows (prompts of different lengths, each prefilled alone)."""
        first = caches[0]
        joined = cls(len(first.layers), first.max_seq_len, first.capacity, first.static)
        joined.allocated = max(cache.allocated for cache in caches)
        joined.lengths = [length for cache in caches for length in cache.lengths]
        for i, layer in enumerate(joined.layers):
            for name in caches[0].layers[i]._buffers:
                parts = [_padded(cache.layers[i]._buffers[name], joined.allocated, -2) for cache in caches]
                layer._buffers[name] = torch.cat(parts)
            for name in caches[0].layers[i].state:
                layer.state[name] = torch.cat(
                    [_padded(cache.layers[i].state[name], joined.allocated, -1) for cache in caches])
        return joined

    def bytes(self) -> int:
        return sum(layer.bytes(self.lengths) for layer in self.layers)

    def bytes_per_token(self) -> float:
        """Cache bytes per cached position, over the batch (divide by the batch size for one sequence)."""
        written = sum(self.lengths)
        return self.bytes() / written * len(self.lengths) if written else 0.0


def _padded(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """tensor with zeros appended along dim up to size."""
    missing = size - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad_shape = list(tensor.shape)
    pad_shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
