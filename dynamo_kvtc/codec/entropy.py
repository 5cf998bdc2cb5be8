"""Lossless entropy stage (paper §3.3): raw DEFLATE in chunks of at most 64 KiB.

Codec tags recorded in every blob section (defined in :mod:`.tags`, re-exported here):

- ``store``    no entropy coding (raw window tokens, tiny sections).
- ``deflate``  raw DEFLATE (RFC 1951, no zlib header). CPU: ``zlib`` with ``wbits=-15``, level 1, Huffman-only
               (as good as LZ matching on quantized codes and 2.5-4x faster). GPU: nvCOMP ``Deflate`` with
               ``BitstreamKind.RAW``. Each chunk is one complete raw stream, so the same bytes decode on either.
- ``gdeflate`` / ``ans``  GPU-only nvCOMP codecs (much faster GPU decode). A CPU-only reader refuses them with
               :class:`~dynamo_kvtc.errors.UnsupportedCodecError`.

Every decoder call knows the exact decompressed length of each chunk from the container header and never inflates
past it.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

from ..errors import ConfigError, CorruptBlobError, UnsupportedCodecError
from .entropy_tags import CHUNK_BYTES, GPU_ONLY_TAGS, TAGS, chunk_sizes

__all__ = [
    "CHUNK_BYTES",
    "GPU_ONLY_TAGS",
    "NVCOMP_ALGO",
    "TAGS",
    "EntropyCoder",
    "check_readable",
    "chunk_sizes",
    "deflate_chunk",
    "inflate_chunk",
    "map_chunks",
    "nvcomp_available",
    "set_cpu_threads",
]

NVCOMP_ALGO = {"deflate": "Deflate", "gdeflate": "GDeflate", "ans": "ANS"}  # tag -> nvCOMP algorithm name


_THREADS = [0]  # 0: one zlib worker per CPU


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    n = _THREADS[0] or max(1, os.cpu_count() or 1)
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvtc-zlib")


def set_cpu_threads(n: int) -> None:
    """Number of zlib worker threads (0: one per CPU); benchmarks use it to pin the CPU path to N cores."""
    old = _pool() if _pool.cache_info().currsize else None
    _THREADS[0] = max(0, int(n))
    _pool.cache_clear()
    if old is not None:
        old.shutdown(wait=False)


def map_chunks(fn, items: Sequence) -> list:
    """``[fn(x) for x in items]`` on the zlib worker threads (zlib releases the GIL: threads scale across cores)."""
    if len(items) <= 2:
        return [fn(x) for x in items]
    return list(_pool().map(fn, items))


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


def nvcomp_available() -> bool:
    """True when nvCOMP imports and a CUDA device is usable."""
    if not torch.cuda.is_available():
        return False
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


class EntropyCoder:
    """Compress and decompress sections chunk by chunk for one codec tag on one device."""

    def __init__(self, tag: str = "deflate", device: str | torch.device = "cpu") -> None:
        if tag not in TAGS:
            raise ConfigError(f"unknown entropy codec tag {tag!r}; choose one of {TAGS}")
        self.tag = tag
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda" and tag != "store" and nvcomp_available()
        if tag in GPU_ONLY_TAGS and not self.gpu:
            raise ConfigError(f"entropy codec {tag!r} is GPU-only (nvCOMP); it needs CUDA and nvidia-nvcomp-cu13")

    # ------------------------------------------------------------------ encode
    def compress(self, data: torch.Tensor) -> list[bytes]:
        """Compress a flat uint8 tensor into chunks (list of stored bytes, one per <=64 KiB raw chunk)."""
        n = data.numel()
        if n == 0:
            return []
        if self.tag == "store":
            raw = data.cpu().numpy().tobytes()
            return [raw[i : i + CHUNK_BYTES] for i in range(0, n, CHUNK_BYTES)]
        if self.gpu:
            return self._nvcomp_compress(data)
        raw = memoryview(data.cpu().numpy().tobytes())
        return map_chunks(deflate_chunk, [raw[i : i + CHUNK_BYTES] for i in range(0, n, CHUNK_BYTES)])

    # ------------------------------------------------------------------ decode
    def decompress(self, chunks: Sequence[bytes], raw_len: int) -> torch.Tensor:
        """Decompress chunks back into a flat uint8 tensor of exactly ``raw_len`` bytes on this coder's device."""
        sizes = chunk_sizes(raw_len)
        if len(sizes) != len(chunks):
            raise CorruptBlobError(f"section has {len(chunks)} chunks, expected {len(sizes)} for {raw_len} bytes")
        if raw_len == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        if self.tag == "store":
            for c, s in zip(chunks, sizes):
                if len(c) != s:
                    raise CorruptBlobError(f"stored chunk has {len(c)} bytes, expected {s}")
            out = bytearray().join(chunks)
        elif self.gpu:
            return self._nvcomp_decompress(chunks, sizes)
        else:
            out = bytearray().join(map_chunks(inflate_chunk, list(zip(chunks, sizes))))
        t = torch.frombuffer(out, dtype=torch.uint8)
        return t.to(self.device) if self.device.type != "cpu" else t

    # ------------------------------------------------------------------ nvCOMP (GPU)
    def _codec(self):
        from nvidia import nvcomp

        kw = {"algorithm": NVCOMP_ALGO[self.tag], "cuda_stream": torch.cuda.current_stream(self.device).cuda_stream}
        if self.tag in ("deflate", "gdeflate"):
            kw["bitstream_kind"] = nvcomp.BitstreamKind.RAW
            kw["algorithm_type"] = 0
        else:
            kw["bitstream_kind"] = nvcomp.BitstreamKind.RAW
            kw["data_type"] = "|u1"
        return nvcomp, nvcomp.Codec(**kw)

    def _nvcomp_compress(self, data: torch.Tensor) -> list[bytes]:
        nvcomp, codec = self._codec()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        data = data.to(self.device).contiguous()
        views = [data[i : i + CHUNK_BYTES] for i in range(0, data.numel(), CHUNK_BYTES)]
        batch = nvcomp.as_arrays(views, cuda_stream=stream)
        # preallocated outputs owned by torch (worst case per chunk), so the compressed bytes can be gathered on the
        # device and copied to the host once
        cap = 2 * CHUNK_BYTES + 4096
        out = torch.empty(len(views), cap, dtype=torch.uint8, device=self.device)
        try:
            enc = codec.encode(batch, out=nvcomp.as_arrays(list(out), cuda_stream=stream))
        except (TypeError, ValueError):
            enc = codec.encode(batch)
            sizes = [int(s) for s in enc.buffer_sizes]
            return [bytes(enc[i].cpu())[: sizes[i]] for i in range(len(views))]
        sizes = [int(s) for s in enc.buffer_sizes]
        if any(s > cap for s in sizes):
            raise RuntimeError(f"nvCOMP {self.tag} output exceeded its {cap}-byte buffer")
        host = torch.cat([out[i, : sizes[i]] for i in range(len(views))]).cpu().numpy().tobytes()
        chunks, off = [], 0
        for n in sizes:
            chunks.append(host[off : off + n])
            off += n
        return chunks

    def _nvcomp_decompress(self, chunks: Sequence[bytes], sizes: list[int]) -> torch.Tensor:
        nvcomp, codec = self._codec()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        # nvCOMP needs each compressed input aligned (4 bytes for Deflate, 16 for ANS): lay chunks out on 16 B
        offsets, off = [], 0
        for c in chunks:
            offsets.append(off)
            off += (len(c) + 15) // 16 * 16
        host = torch.zeros(off, dtype=torch.uint8)
        for o, c in zip(offsets, chunks):
            host[o : o + len(c)] = torch.frombuffer(bytearray(c), dtype=torch.uint8)
        dev = host.pin_memory().to(self.device, non_blocking=True)
        views = [dev[o : o + len(c)] for o, c in zip(offsets, chunks)]
        out = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        outs, off = [], 0
        for s in sizes:
            outs.append(out[off : off + s])
            off += s
        try:
            dec = codec.decode(
                nvcomp.as_arrays(views, cuda_stream=stream),
                data_type="|u1",
                out=nvcomp.as_arrays(outs, cuda_stream=stream),
            )
            got = [int(x) for x in getattr(dec, "buffer_sizes", sizes)]
        except (RuntimeError, ValueError) as e:
            raise CorruptBlobError(f"nvCOMP {self.tag} decode failed: {e}") from None
        if got != sizes:
            raise CorruptBlobError(f"nvCOMP {self.tag} decoded chunk sizes {got[:4]}... differ from the header's")
        return out


def check_readable(tag: str, device: str | torch.device) -> None:
    """Raise :class:`UnsupportedCodecError` if a blob section with ``tag`` cannot be decoded on ``device``."""
    if tag not in TAGS:
        raise UnsupportedCodecError(f"unknown entropy codec tag {tag!r}")
    if tag in GPU_ONLY_TAGS and not (torch.device(device).type == "cuda" and nvcomp_available()):
        raise UnsupportedCodecError(
            f"blob uses the GPU-only entropy codec {tag!r} (nvCOMP); this reader runs on {device} without it. "
            "Decode on a CUDA machine with nvidia-nvcomp-cu13, or re-encode with tag 'deflate'."
        )
