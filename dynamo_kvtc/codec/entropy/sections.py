"""The entropy stage of one section on one device (the reference and sharded codecs): :class:`EntropyCoder` splits a
section into chunks and runs its tag's coder on them, nvCOMP on a CUDA device where the coder has an algorithm there,
the coder's CPU path otherwise; :func:`check_readable` says whether a tag decodes on a device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import ConfigError, CorruptBlobError, UnsupportedCodecError
from .base import CHUNK_BYTES, chunk_sizes
from .nvcomp import nvcomp_available, nvcomp_codec
from .registry import PORTABLE, coder


class EntropyCoder:
    """Compress and decompress sections chunk by chunk for one codec tag on one device."""

    def __init__(self, tag: str = PORTABLE, device: str | torch.device = "cpu") -> None:
        self.coder = coder(tag, ConfigError)
        self.tag = tag
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda" and self.coder.nvcomp is not None and nvcomp_available()
        if not (self.coder.cpu or self.gpu):
            raise ConfigError(f"entropy codec {tag!r} is GPU-only (nvCOMP); it needs CUDA and nvidia-nvcomp-cu13")

    # ------------------------------------------------------------------ encode
    def compress(self, data: torch.Tensor) -> list[bytes]:
        """Compress a flat uint8 tensor into chunks (list of stored bytes, one per <=64 KiB raw chunk)."""
        n = data.numel()
        if n == 0:
            return []
        if self.gpu:
            return self._nvcomp_compress(data)
        raw = memoryview(data.cpu().numpy().tobytes())
        return self.coder.encode([raw[i : i + CHUNK_BYTES] for i in range(0, n, CHUNK_BYTES)])

    # ------------------------------------------------------------------ decode
    def decompress(self, chunks: Sequence[bytes], raw_len: int) -> torch.Tensor:
        """Decompress chunks back into a flat uint8 tensor of exactly ``raw_len`` bytes on this coder's device."""
        sizes = chunk_sizes(raw_len)
        if len(sizes) != len(chunks):
            raise CorruptBlobError(f"section has {len(chunks)} chunks, expected {len(sizes)} for {raw_len} bytes")
        if raw_len == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        if self.gpu:
            return self._nvcomp_decompress(chunks, sizes)
        out = bytearray().join(self.coder.decode(chunks, sizes))
        if len(out) != raw_len:  # a coder's own check missed it: never hand on a section of the wrong size
            raise CorruptBlobError(f"{self.tag} section decoded to {len(out)} bytes, expected {raw_len}")
        t = torch.frombuffer(out, dtype=torch.uint8)
        return t.to(self.device) if self.device.type != "cpu" else t

    # ------------------------------------------------------------------ nvCOMP (GPU)
    def _codec(self):
        return nvcomp_codec(self.coder, torch.cuda.current_stream(self.device).cuda_stream)

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
    c = coder(tag)
    if not c.cpu and not (c.nvcomp and torch.device(device).type == "cuda" and nvcomp_available()):
        raise UnsupportedCodecError(
            f"blob uses the GPU-only entropy codec {tag!r} (nvCOMP); this reader runs on {device} without it. "
            f"Decode on a CUDA machine with nvidia-nvcomp-cu13, or re-encode with tag {PORTABLE!r}."
        )
