"""Megatron-LM indexed datasets written byte by byte for tests, from the documented layout.

`PREFIX.idx`, little-endian: the 9-byte magic `MMIDIDX\\x00\\x00`; the version (uint64, 1); the dtype code
(uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16); the sequence count n
(uint64); the document-index count d (uint64); n int32 sequence lengths; n int64 byte pointers into the
`.bin`; d int64 document indices (0 first, n last: document k is sequences [idx[k], idx[k+1])).
`PREFIX.bin`: the tokens of every sequence back to back.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}


def megatron_bytes(
    documents: list[list[list[int]]],
    *,
    dtype: str = "uint16",
    magic: bytes = b"MMIDIDX\x00\x00",
    version: int = 1,
    code: int | None = None,
    pointer_shift: int = 0,
) -> tuple[bytes, bytes]:
    """(.idx, .bin) of `documents`, each a list of sequences of token ids; the keywords break one field."""
    sequences = [sequence for document in documents for sequence in document]
    lengths = np.array([len(s) for s in sequences], dtype="<i4")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]).astype("<i8") * itemsize
    pointers[1:] += pointer_shift
    doc_indices = np.cumsum([0] + [len(d) for d in documents]).astype("<i8")
    header = struct.pack(
        "<9sQBQQ", magic, version, CODES[dtype] if code is None else code, len(sequences), len(doc_indices)
    )
    idx = header + lengths.tobytes() + pointers.tobytes() + doc_indices.tobytes()
    tokens = [np.array(s, dtype=np.dtype(dtype).newbyteorder("<")) for s in sequences]
    return idx, b"".join(t.tobytes() for t in tokens)


def write_megatron(prefix: Path, documents: list[list[list[int]]], **fields: object) -> Path:
    """Writes PREFIX.idx and PREFIX.bin (see `megatron_bytes`); returns `prefix`."""
    idx, data = megatron_bytes(documents, **fields)  # type: ignore[arg-type]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_name(prefix.name + ".idx").write_bytes(idx)
    prefix.with_name(prefix.name + ".bin").write_bytes(data)
    return prefix


def corpus(
    num_documents: int, *, seed: int, vocab_size: int, eod: int | None = None
) -> list[list[list[int]]]:
    """Documents of 1-3 sequences of 5-60 random ids below `vocab_size`, each ending with `eod` if given."""
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(num_documents):
        sequences = [
            rng.integers(0, vocab_size, rng.integers(5, 60)).tolist() for _ in range(rng.integers(1, 4))
        ]
        if eod is not None:
            sequences[-1].append(eod)
        documents.append(sequences)
    return documents
