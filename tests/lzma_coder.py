"""``lzma``: an entropy coder that exists only in the tests (raw LZMA2 from the standard library, CPU only). It shows
what a new coder is: one small class, and one ``register`` line (in :func:`registered`) makes the codecs, the fused
batch stage and the container take it."""

from __future__ import annotations

import lzma
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from dynamo_kvtc.codec.entropy import Coder, map_chunks, register, unregister
from dynamo_kvtc.errors import CorruptBlobError

FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 0}]


def _compress(chunk: memoryview) -> bytes:
    return lzma.compress(chunk, format=lzma.FORMAT_RAW, filters=FILTERS)


def _decompress(args: tuple[bytes, int]) -> bytes:
    data, expected = args
    d = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=FILTERS)
    try:
        out = d.decompress(data, max_length=expected)  # never more than the header's size
    except lzma.LZMAError as e:
        raise CorruptBlobError(f"LZMA stream is corrupt: {e}") from None
    if len(out) != expected or not d.eof or d.unused_data:
        raise CorruptBlobError(f"LZMA chunk decoded to {len(out)} bytes, expected {expected} (or did not end)")
    return out


class Lzma(Coder):
    tag = "lzma"
    max_expansion = 64  # LZMA2 stores an incompressible 64 KiB as one uncompressed chunk: 3 header bytes and the end

    def encode(self, chunks: Sequence[memoryview]) -> list[bytes]:
        return map_chunks(_compress, chunks)

    def decode(self, chunks: Sequence[bytes], sizes: Sequence[int]) -> list[bytes]:
        return map_chunks(_decompress, list(zip(chunks, sizes)))


@contextmanager
def registered() -> Iterator[str]:
    """The ``lzma`` tag, known while the block runs."""
    register(Lzma())  # the one line a new coder needs (a built-in one: in codec/entropy/registry.py)
    try:
        yield Lzma.tag
    finally:
        unregister(Lzma.tag)
