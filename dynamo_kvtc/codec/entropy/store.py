"""``store``: no entropy coding (raw window tokens, sinks, tiny sections); a chunk's stored bytes are its raw bytes."""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import CorruptBlobError
from .base import Coder


class Store(Coder):
    tag = "store"
    max_expansion = 0

    def fits(self, stored: int, raw: int) -> bool:
        return stored == raw

    def encode(self, chunks: Sequence[memoryview]) -> list[bytes]:
        return [bytes(c) for c in chunks]

    def decode(self, chunks: Sequence[bytes], sizes: Sequence[int]) -> list[bytes]:
        for c, s in zip(chunks, sizes):
            if len(c) != s:
                raise CorruptBlobError(f"stored chunk has {len(c)} bytes, expected {s}")
        return list(chunks)
