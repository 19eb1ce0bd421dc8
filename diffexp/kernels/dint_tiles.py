"""The tiles of DINT's Triton integral (triton_dint.py) and the scratch they imply, without importing Triton: the
kernel, its ahead-of-time compile test and the memory estimate read the same rule."""

from __future__ import annotations


def tile_width(n: int) -> int:
    """A power-of-two tile width >= n; at least 16, the smallest tl.dot operand on GPUs."""
    return max(16, 1 << (n - 1).bit_length())


def tiles(d: int, dv: int) -> tuple[int, int]:
    """The query and key tile sizes the Triton integral takes unless given, for head widths d (q1, k1) and dv (v).
    Untuned: 64 x 64, the query tile halved past dv 128 (two fp32 accumulators of width dv fit), the key tile past
    d 64. tests/test_triton_aot.py compiles every kernel at these tiles for an H100."""
    return (64 if tile_width(dv) <= 128 else 32), (64 if tile_width(d) <= 64 else 32)


def scratch_bytes(batch: int, heads: int, seq_len: int, d: int, dv: int) -> tuple[int, int]:
    """(kept, backward) bytes of the Triton integral's fp32 buffers in one layer, at its default tiles: PREFIX
    (B, h, T / query tile, T), kept from the forward for the backward; CARRY (the same) and ROWPART
    (B, h, T / key tile, T), made in the backward. T^2 / 64 floats a head each: the memory estimate adds them."""
    block_m, block_n = tiles(d, dv)
    row = 4 * batch * heads * seq_len
    prefix = row * -(-seq_len // block_m)
    return prefix, prefix + row * -(-seq_len // block_n)
