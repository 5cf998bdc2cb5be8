"""Entropy coding of many sections' chunks in one call: nvCOMP on CUDA, a coder's CPU path otherwise (the fused codec's
stage 4)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ...errors import CorruptBlobError, DecodeError, InputError
from ..entropy.base import CHUNK_BYTES, Coder
from ..entropy.nvcomp import nvcomp_available, nvcomp_codec
from ..entropy.registry import coder, known
from .ops import align

log = logging.getLogger(__name__)


class EncodeOut:
    """The result of one batch encode: chunk ``i`` lies at ``out[i * cap:]``; :meth:`sizes` synchronises (nvCOMP)."""

    def __init__(self, out: torch.Tensor, cap: int, sizes: Callable[[], list[int]], keep: Any = None) -> None:
        self.out, self.cap, self._sizes, self.keep = out, cap, sizes, keep

    def sizes(self) -> list[int]:
        return self._sizes()


class BatchEntropy:
    """Chunks of many sections in one call: nvCOMP on CUDA for a coder with an nvCOMP algorithm (stream-ordered,
    preallocated outputs), the coder's CPU path otherwise (CPU devices, CUDA without nvCOMP, a CPU-only coder). One
    nvCOMP ``Codec`` per thread, tag and stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.nvcomp = device.type == "cuda" and nvcomp_available()
        self._codecs: dict[tuple, Any] = {}
        self._caps: dict[str, int] = {}
        self.decode_mode = ""  # which nvCOMP decode call worked last: "config", "out", "views"

    def _codec(self, tag: str):
        stream = torch.cuda.current_stream(self.device).cuda_stream
        key = (threading.get_ident(), tag, stream)
        got = self._codecs.get(key)
        if got is None:
            got = self._codecs[key] = nvcomp_codec(coder(tag), stream)
        return got[0], got[1], stream

    def _on_gpu(self, tag: str) -> bool:
        """Whether ``tag``'s chunks go through nvCOMP here (else through its coder's CPU path)."""
        return self.nvcomp and coder(tag).nvcomp is not None

    def _cpu(self, tag: str) -> Coder:
        c = coder(tag, InputError)
        if not c.cpu:
            raise InputError(f"entropy codec {tag!r} needs nvCOMP on a CUDA device")
        return c

    def cap(self, tag: str) -> int:
        if tag not in self._caps:
            cap = 2 * CHUNK_BYTES + 4096
            if self._on_gpu(tag):
                try:
                    nvcomp, codec, stream = self._codec(tag)
                    probe = torch.zeros(CHUNK_BYTES, dtype=torch.uint8, device=self.device)
                    cap = int(codec.get_max_comp_buffer_size(nvcomp.as_array(probe, cuda_stream=stream)))
                except Exception as e:  # older bindings: keep the generous bound
                    log.debug("nvCOMP max compressed size unavailable (%s)", e)
            self._caps[tag] = align(max(cap, CHUNK_BYTES + 1024))
        return self._caps[tag]

    def usable(self, tag: str) -> bool:
        """Whether chunks of ``tag`` can be coded here (nvCOMP, or the coder's CPU path)."""
        return known(tag) and (self._on_gpu(tag) or coder(tag).cpu)

    # ------------------------------------------------------------------------------------ encode
    def encode(self, tag: str, src: torch.Tensor, offs: list[int], sizes: list[int]) -> EncodeOut:
        n = len(sizes)
        cap = self.cap(tag)
        if self._on_gpu(tag):
            nvcomp, codec, stream = self._codec(tag)
            out = torch.empty(max(1, n) * cap, dtype=torch.uint8, device=self.device)
            if n == 0:
                return EncodeOut(out, cap, lambda: [])
            batch = nvcomp.as_arrays(src, offs, sizes, cuda_stream=stream)
            outb = nvcomp.as_arrays(out, [i * cap for i in range(n)], [cap] * n, cuda_stream=stream)
            enc = codec.encode(batch, out=outb, compression_config=codec.compression_config(sizes))
            return EncodeOut(out, cap, lambda: [int(s) for s in enc.buffer_sizes], keep=(batch, outb, enc))
        c = self._cpu(tag)
        host = src.cpu().numpy() if src.device.type != "cpu" else src.numpy()
        comp = c.encode([memoryview(host[o : o + s]) for o, s in zip(offs, sizes)])
        cap = align(max([cap, *(len(x) for x in comp)]))  # a chunk past the format's limit: the caller refuses it
        buf = torch.zeros(max(1, n) * cap, dtype=torch.uint8)
        for i, x in enumerate(comp):
            buf[i * cap : i * cap + len(x)] = torch.frombuffer(bytearray(x), dtype=torch.uint8)
        got = [len(x) for x in comp]
        return EncodeOut(buf.to(self.device), cap, lambda: got)

    # ------------------------------------------------------------------------------------ decode
    def decode(
        self,
        tag: str,
        src: torch.Tensor,
        offs: list[int],
        sizes: list[int],
        dst: torch.Tensor,
        dst_offs: list[int],
        dst_sizes: list[int],
    ) -> Callable[[], None]:
        """Inflate chunk i of ``src`` into ``dst[dst_offs[i]:+dst_sizes[i]]``; returns a check to call once the
        stream has finished (raises CorruptBlobError if a chunk did not decode to its size). A chunk that does not
        decode never raises here: bytes not yet CRC-checked may be corrupt, and the restore reports that first."""
        if not sizes:
            return lambda: None
        if self._on_gpu(tag):
            return self._nvcomp_decode(tag, src, offs, sizes, dst, dst_offs, dst_sizes)
        c = self._cpu(tag)
        host = src.cpu().numpy() if src.device.type != "cpu" else src.numpy()  # (the CPU coder: synchronises)
        try:
            outs = c.decode([bytes(host[o : o + s]) for o, s in zip(offs, sizes)], dst_sizes)
            if [len(x) for x in outs] != list(dst_sizes):
                raise CorruptBlobError("decoded chunk sizes differ from the header's")
        except DecodeError as e:  # reported by the check, like nvCOMP's: the caller's CRC verdict decides first
            err = CorruptBlobError(f"{tag} chunk did not inflate: {e}")

            def failed() -> None:
                raise err

            return failed
        for o, raw in zip(dst_offs, outs):
            dst[o : o + len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return lambda: None

    def _nvcomp_decode(self, tag, src, offs, sizes, dst, dst_offs, dst_sizes):
        nvcomp, codec, stream = self._codec(tag)
        batch = nvcomp.as_arrays(src, offs, sizes, cuda_stream=stream)
        outb = nvcomp.as_arrays(dst, dst_offs, dst_sizes, cuda_stream=stream)
        dec, errors = None, []
        try:  # sync-free: the decompression configuration comes from the sizes the blob header gives
            dc = codec.decompression_config(codec.compression_config(dst_sizes))
            dec = codec.decode(batch, out=outb, decompression_config=dc)
            self.decode_mode = "config"
        except Exception as e:  # noqa: BLE001 - binding differences; the fallbacks below are known to work
            errors.append(f"config: {type(e).__name__}: {e}")
        if dec is None:
            try:
                dec = codec.decode(batch, out=outb)
                self.decode_mode = "out"
            except (RuntimeError, ValueError) as e:
                errors.append(f"out: {type(e).__name__}: {e}")
        if dec is None:
            views = [src[o : o + s] for o, s in zip(offs, sizes)]
            outs = [dst[o : o + s] for o, s in zip(dst_offs, dst_sizes)]
            try:
                dec = codec.decode(
                    nvcomp.as_arrays(views, cuda_stream=stream),
                    data_type="|u1",
                    out=nvcomp.as_arrays(outs, cuda_stream=stream),
                )
                self.decode_mode = "views"
            except (RuntimeError, ValueError) as e:
                raise CorruptBlobError(f"nvCOMP {tag} decode failed: {e}; earlier attempts: {errors}") from None
        keep = (batch, outb, dec)

        def check() -> None:
            got = [int(x) for x in getattr(keep[2], "buffer_sizes", dst_sizes)]
            if got != list(dst_sizes):
                raise CorruptBlobError(f"nvCOMP {tag} decoded chunk sizes differ from the header's")

        return check
