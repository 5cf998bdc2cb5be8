"""``deflate``: raw DEFLATE (RFC 1951, no zlib header), one complete stream per chunk, so the same bytes decode on
either side. CPU: ``zlib`` with ``wbits=-15``, level 1, Huffman-only (as good as LZ matching on quantized codes and
2.5-4x faster). GPU: nvCOMP ``Deflate``. The tag every reader decodes."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from ...errors import CorruptBlobError
from .base import Coder, map_chunks

DEFLATE_MAX_RATIO = 1032  # the most raw bytes one DEFLATE-coded byte can stand for (zlib FAQ; length 258 per ~2 bits)


def deflate_chunk(chunk: bytes | memoryview) -> bytes:
    """One raw DEFLATE stream of one chunk (level 1, Huffman only): the CPU writer of the ``deflate`` tag."""
    c = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return c.compress(chunk) + c.flush()


def inflate_chunk(args: tuple[bytes, int]) -> bytes:
    """Inflate ``(stored bytes, expected raw length)``; CorruptBlobError unless it is one whole stream of that size."""
    data, expected = args
    d = zlib.decompressobj(-15)
    try:
        out = d.decompress(data, expected)
    except zlib.error as e:
        if "Error -4" in str(e):  # Z_MEM_ERROR: the machine is short of memory, the blob may be fine
            raise MemoryError(f"zlib could not allocate while inflating: {e}") from None
        raise CorruptBlobError(f"DEFLATE stream is corrupt: {e}") from None
    if len(out) != expected or not d.eof or d.unconsumed_tail or d.unused_data:
        raise CorruptBlobError(
            f"DEFLATE chunk decoded to {len(out)} bytes (expected {expected}, stream "
            f"{'complete' if d.eof else 'truncated'}, {len(d.unconsumed_tail) + len(d.unused_data)} bytes left over)"
        )
    return out


class Deflate(Coder):
    tag = "deflate"
    nvcomp = "Deflate"
    nvcomp_options = {"algorithm_type": 0}
    max_ratio = DEFLATE_MAX_RATIO
    max_expansion = 64  # zlib's worst case on 64 KiB: 5 bytes per stored block of at most 16 KiB, plus the end

    def encode(self, chunks: Sequence[memoryview]) -> list[bytes]:
        return map_chunks(deflate_chunk, chunks)

    def decode(self, chunks: Sequence[bytes], sizes: Sequence[int]) -> list[bytes]:
        return map_chunks(inflate_chunk, list(zip(chunks, sizes)))
