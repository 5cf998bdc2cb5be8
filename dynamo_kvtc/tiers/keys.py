"""Block keys compatible with Dynamo's KV-aware router.

Dynamo hashes each full block of ``block_size`` tokens with XXH3-64 (seed 1337) over the tokens as little-endian
uint32 (``dynamo.llm.compute_block_hash_for_seq``), and chains them into sequence hashes: the first block's sequence
hash is its block hash, each next one is XXH3-64 (seed 1337) of the little-endian pair (parent, block hash). A sequence
hash therefore names a block *and its whole prefix*, which is what a KV cache block depends on.

When ai-dynamo-runtime is installed its function computes the block hashes; otherwise the same algorithm runs here
(tests check both give equal results). Router events take signed 64-bit integers: see :func:`to_signed`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

SEED = 1337


def _dynamo_block_hashes():
    try:
        from dynamo.llm import compute_block_hash_for_seq
    except Exception:  # not installed, or its native module cannot load here
        return None
    return compute_block_hash_for_seq


def block_hashes(tokens: Sequence[int], block_size: int, *, use_dynamo: bool = True) -> list[int]:
    """One unsigned 64-bit hash per full block (a partial tail block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    fn = _dynamo_block_hashes() if use_dynamo else None
    if fn is not None:
        return [int(h) for h in fn([int(t) for t in tokens], block_size)]
    n = len(tokens) // block_size
    fmt = f"<{block_size}I"
    return [
        xxhash.xxh3_64_intdigest(struct.pack(fmt, *tokens[i * block_size : (i + 1) * block_size]), seed=SEED)
        for i in range(n)
    ]


def chain(block_hashes_: Sequence[int], parent: int | None = None) -> list[int]:
    """Sequence hashes from block hashes (optionally continuing after ``parent``)."""
    out: list[int] = []
    prev = parent
    for h in block_hashes_:
        prev = h if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, h), seed=SEED)
        out.append(prev)
    return out


def sequence_hashes(tokens: Sequence[int], block_size: int, *, use_dynamo: bool = True) -> list[int]:
    """The chained sequence hash of every full block of ``tokens``: the tier's block keys."""
    return chain(block_hashes(tokens, block_size, use_dynamo=use_dynamo))


def to_signed(h: int) -> int:
    """Unsigned 64-bit hash -> the signed value Dynamo's KvEventPublisher expects."""
    return h - (1 << 64) if h >= (1 << 63) else h
