"""storage/crc32c.py: the CRC32C of concatenated bytes from the parts' CRC32Cs (checked against
google_crc32c over the whole), and a file's CRC32C from ranges that tile it, refused when they do not."""

from __future__ import annotations

import random

import google_crc32c
import pytest

from batchpilot.storage.crc32c import combine, of_tiling


@pytest.mark.parametrize(("first", "second"), [(0, 5), (5, 0), (1, 1), (13, 1000), (4096, 77_777)])
def test_combine_is_the_crc32c_of_the_concatenation(first, second):
    rng = random.Random(first * 100_003 + second)
    a, b = rng.randbytes(first), rng.randbytes(second)
    assert combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == google_crc32c.value(a + b)


def test_ranges_that_tile_a_file_give_its_crc32c_and_others_give_none():
    data = random.Random(7).randbytes(10_000)

    def part(start, end):
        return (start, end, google_crc32c.value(data[start:end]))

    tiling = [part(0, 8), part(8, 5000), part(5000, 10_000), part(8, 5000)]  # a range read by two ranks
    assert of_tiling(tiling, size=10_000) == google_crc32c.value(data)
    assert of_tiling(tiling[:2], size=10_000) is None  # a gap at the end
    assert of_tiling([part(0, 8), part(9, 10_000)], size=10_000) is None  # a gap inside
    assert of_tiling([part(0, 6000), part(5000, 10_000)], size=10_000) is None  # overlapping ranges
