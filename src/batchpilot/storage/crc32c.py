"""CRC32C of a whole object from the CRC32Cs of the ranges that tile it.

Ranks that each read part of an object (their shards' rows of a safetensors file) can check the object's
CRC32C, as GCS records it, without any of them reading all of it: each computes the CRC32C of its ranges
(`google_crc32c`), the ranges are gathered, and `combine` folds them in order. `combine(crc(A), crc(B),
len(B))` is `crc(A + B)`: zlib's `crc32_combine` (a 32 x 32 matrix over GF(2) for "append one zero bit",
squared for 2, 4, 8, ... bits), with CRC32C's reflected polynomial 0x82F63B78 in place of CRC-32's. No
maintained Python package exposes this for CRC32C, hence these few lines.
"""

from __future__ import annotations

from collections.abc import Sequence

POLYNOMIAL = 0x82F63B78
"""CRC32C (Castagnoli), reflected."""


def _times(matrix: Sequence[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _square(matrix: Sequence[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]


def combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC32C of A followed by B, from CRC32C(A), CRC32C(B) and B's length in bytes."""
    if length_b <= 0:
        return crc_a
    odd = [POLYNOMIAL] + [1 << n for n in range(31)]  # one zero bit
    even = _square(odd)  # two
    odd = _square(even)  # four
    while True:  # apply len(B) zero bytes to crc_a, a power of two at a time
        even = _square(odd)
        if length_b & 1:
            crc_a = _times(even, crc_a)
        length_b >>= 1
        if not length_b:
            break
        odd = _square(even)
        if length_b & 1:
            crc_a = _times(odd, crc_a)
        length_b >>= 1
        if not length_b:
            break
    return crc_a ^ crc_b


def of_tiling(ranges: Sequence[tuple[int, int, int]], *, size: int) -> int | None:
    """The CRC32C of an object of `size` bytes from `(start, end, crc32c)` ranges read of it (repeats and
    duplicates allowed); None when they do not tile it exactly (a gap, or two different ranges overlapping)."""
    crc, at = 0, 0
    for start, end, part in sorted(set(ranges)):
        if start == end:
            continue
        if start != at:
            return None
        crc, at = combine(crc, part, end - start), end
    return crc if at == size else None
