"""The fused GPU codec: many spans per call, fp16 tensor-core projections, fused stages, batched nvCOMP, one stream.

It reads and writes exactly the blob format of :class:`~dynamo_kvtc.codec.kvtc.KvtcCodec` (docs/format.md, version 1):
a blob from either path decodes on the other, and the CPU reads its Deflate blobs. What differs is how the work runs:

Encode (:meth:`FusedCodec.encode_batch`), for all spans of a batch together:

1. ``prep``: for each layer, K (then V) rows of every span's coded tokens are gathered straight from where the
   engine keeps them (paged blocks or a dense tensor), RoPE removed, the calibration mean subtracted and written as
   fp16 into one ``[rows, p]`` matrix (fp32 arithmetic; non-finite input and fp16 overflow are flagged on the device,
   overflow re-runs the batch in bf16);
2. ``project``: one fp16 x fp16 GEMM with fp32 accumulation and fp32 output onto the plan's leading components
   (the fp16 basis is exactly what the calibration stores);
3. ``quantize``: each plan bucket quantized straight from the GEMM output and packed into its blob's section layout;
4. ``entropy``: all chunks of all sections in one nvCOMP batch call with preallocated outputs on the stream;
5. ``finish``: one synchronisation for the compressed sizes, compaction into the blobs' byte order, CRC-32 of every
   section on the device, one more synchronisation for the CRCs, headers on the host, one device-to-host copy per blob.

Restore (:meth:`FusedCodec.open` then :meth:`RestoreJob.layers`), for all blobs of a batch together:

1. headers parsed and checked on the host (the reference checks), section bytes copied host->device (pinned sources
   copy asynchronously), every section's CRC-32 computed on the device and compared before anything is decoded;
2. compressed chunks realigned for nvCOMP and inflated in one batch call per codec tag, sync-free (decompression
   configuration built from the sizes the header gives; fallbacks recorded in ``nvcomp_mode``);
3. ``dequantize`` into one fp16 coefficient matrix per K/V and layer group;
4. per layer: ``Y = D @ V[cols_l]^T`` (fp16 GEMM, fp32 output), then ``post``: + mean, RoPE re-applied, cast, and
   scattered straight into the destination rows (engine blocks or per-layer buffers); sinks and window rows follow.

The reference path (``KvtcCodec`` with ``fused=False``) stays the CPU path and the definition of the format.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from ...errors import ConfigError, CorruptBlobError, InputError
from ..container import FORMAT_VERSION, MAGIC, MAX_HEADER_BYTES, PREFIX, positions_to_runs, runs_to_positions
from ..entropy import CHUNK_BYTES, GPU_ONLY_TAGS, _deflate, _inflate, _map, chunk_sizes, nvcomp_available
from ..model import DTYPES, dtype_name
from ..plan import iter_sections
from ..quant import BITS, FP8_MAX
from .ops import FLAG_F16_OVERFLOW, FLAG_NONFINITE, TorchOps, flat_view, get_ops, rope_tables

log = logging.getLogger(__name__)

ALIGN = 16
_NVCOMP_ALGO = {"deflate": "Deflate", "gdeflate": "GDeflate", "ans": "ANS"}
MAX_STORED_CHUNK = 2 * CHUNK_BYTES + 64  # what parse_blob accepts


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


# =================================================================================================== KV layouts
class DenseKV:
    """Keys/values ``[L, T_total, H, D]`` (one tensor each); sequence ``i`` starts at token ``seq_starts[i]``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, seq_starts: Sequence[int] = (0,)) -> None:
        if keys.shape != values.shape or keys.stride() != values.stride() or keys.dtype != values.dtype:
            raise InputError("keys and values must share shape, strides and dtype")
        self.keys, self.values = keys, values
        self.num_layers, _, self.heads, self.head_dim = keys.shape
        self.dtype, self.device = keys.dtype, keys.device
        self.stride_h, self.stride_d = keys.stride(2), keys.stride(3)
        self.seq_starts = list(seq_starts)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]

    def token_offsets(self, seq: int, start: int, n: int) -> torch.Tensor:
        t0 = self.seq_starts[seq] + start
        return torch.arange(t0, t0 + n, dtype=torch.int64, device=self.device) * self.keys.stride(1)


class PagedBlocks:
    """Engine blocks: ``layer_views(l) -> (k, v)`` each ``[num_blocks, block_size, H, D]`` (any strides, K and V
    alike); sequence ``i`` is ``block_ids[i]`` in order (token t in block ``t // block_size``)."""

    def __init__(
        self,
        layer_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        num_layers: int,
        block_ids: Sequence[Sequence[int]],
    ) -> None:
        k, v = layer_views(0)
        if k.stride() != v.stride() or k.shape != v.shape:
            raise InputError("paged K and V views must share shape and strides")
        self._views = layer_views
        self.num_layers = num_layers
        _, self.block_size, self.heads, self.head_dim = k.shape
        self.dtype, self.device = k.dtype, k.device
        self.stride_block, self.stride_tok, self.stride_h, self.stride_d = k.stride()
        self.block_ids = [torch.as_tensor(list(b), dtype=torch.int64) for b in block_ids]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._views(layer)

    def token_offsets(self, seq: int, start: int, n: int) -> torch.Tensor:
        t = torch.arange(start, start + n, dtype=torch.int64)
        blocks = self.block_ids[seq][t // self.block_size]
        off = blocks * self.stride_block + (t % self.block_size) * self.stride_tok
        return off.to(self.device, non_blocking=True)


@dataclass
class Span:
    """One blob to encode: tokens ``[start, start + len(positions))`` of sequence ``seq`` of the source."""

    seq: int
    start: int
    positions: torch.Tensor
    window: int | None = None


# =================================================================================================== entropy
class _EncodeOut:
    def __init__(self, out: torch.Tensor, cap: int, sizes: Callable[[], list[int]], keep: Any = None) -> None:
        self.out, self.cap, self._sizes, self.keep = out, cap, sizes, keep

    def sizes(self) -> list[int]:
        return self._sizes()


class BatchEntropy:
    """Chunks of many sections in one call: nvCOMP on CUDA (stream-ordered, preallocated outputs), zlib otherwise
    (CPU devices and CUDA without nvCOMP; Deflate only). One nvCOMP ``Codec`` per thread, tag and stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.nvcomp = device.type == "cuda" and nvcomp_available()
        self._codecs: dict[tuple, Any] = {}
        self._caps: dict[str, int] = {}
        self.decode_mode = ""  # which nvCOMP decode call worked last: "config", "out", "views"

    def _codec(self, tag: str):
        from nvidia import nvcomp

        stream = torch.cuda.current_stream(self.device).cuda_stream
        key = (threading.get_ident(), tag, stream)
        c = self._codecs.get(key)
        if c is None:
            kw: dict[str, Any] = {
                "algorithm": _NVCOMP_ALGO[tag],
                "cuda_stream": stream,
                "bitstream_kind": nvcomp.BitstreamKind.RAW,
            }
            if tag == "ans":
                kw["data_type"] = "|u1"
            else:
                kw["algorithm_type"] = 0
            c = self._codecs[key] = nvcomp.Codec(**kw)
        return nvcomp, c, stream

    def cap(self, tag: str) -> int:
        if tag not in self._caps:
            cap = 2 * CHUNK_BYTES + 4096
            if self.nvcomp:
                try:
                    nvcomp, codec, stream = self._codec(tag)
                    probe = torch.zeros(CHUNK_BYTES, dtype=torch.uint8, device=self.device)
                    cap = int(codec.get_max_comp_buffer_size(nvcomp.as_array(probe, cuda_stream=stream)))
                except Exception as e:  # older bindings: keep the generous bound
                    log.debug("nvCOMP max compressed size unavailable (%s)", e)
            self._caps[tag] = _align(max(cap, CHUNK_BYTES + 1024))
        return self._caps[tag]

    def usable(self, tag: str) -> bool:
        return self.nvcomp or tag == "deflate"

    # ------------------------------------------------------------------------------------ encode
    def encode(self, tag: str, src: torch.Tensor, offs: list[int], sizes: list[int]) -> _EncodeOut:
        n = len(sizes)
        cap = self.cap(tag)
        if self.nvcomp:
            nvcomp, codec, stream = self._codec(tag)
            out = torch.empty(max(1, n) * cap, dtype=torch.uint8, device=self.device)
            if n == 0:
                return _EncodeOut(out, cap, lambda: [])
            batch = nvcomp.as_arrays(src, offs, sizes, cuda_stream=stream)
            outb = nvcomp.as_arrays(out, [i * cap for i in range(n)], [cap] * n, cuda_stream=stream)
            enc = codec.encode(batch, out=outb, compression_config=codec.compression_config(sizes))
            return _EncodeOut(out, cap, lambda: [int(s) for s in enc.buffer_sizes], keep=(batch, outb, enc))
        if tag != "deflate":
            raise InputError(f"entropy codec {tag!r} needs nvCOMP on a CUDA device")
        host = src.cpu().numpy() if src.device.type != "cpu" else src.numpy()
        comp = _map(_deflate, [memoryview(host[o : o + s]) for o, s in zip(offs, sizes)])
        buf = torch.zeros(max(1, n) * cap, dtype=torch.uint8)
        for i, c in enumerate(comp):
            buf[i * cap : i * cap + len(c)] = torch.frombuffer(bytearray(c), dtype=torch.uint8)
        got = [len(c) for c in comp]
        return _EncodeOut(buf.to(self.device), cap, lambda: got)

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
        stream has finished (raises CorruptBlobError if a chunk did not decode to its size)."""
        if not sizes:
            return lambda: None
        if self.nvcomp:
            return self._nvcomp_decode(tag, src, offs, sizes, dst, dst_offs, dst_sizes)
        if tag != "deflate":
            raise InputError(f"entropy codec {tag!r} needs nvCOMP on a CUDA device")
        host = src.cpu().numpy() if src.device.type != "cpu" else src.numpy()
        outs = _map(_inflate, [(bytes(host[o : o + s]), n) for o, s, n in zip(offs, sizes, dst_sizes)])
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


# =================================================================================================== timing
class _Clock:
    """Stage marks on the stream (CUDA events: no synchronisation) or the host clock (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def stages(self) -> dict[str, float]:
        """Seconds between consecutive marks, keyed by the later mark's name (summed when a name repeats)."""
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[name] = out.get(name, 0.0) + dt
        return out

    def since_start(self, name: str) -> float | None:
        first = self.marks[0][1]
        for n, ev in self.marks:
            if n == name:
                return first.elapsed_time(ev) / 1e3 if self.cuda else ev - first
        return None


# =================================================================================================== the codec
@dataclass(eq=False)
class _Blob:
    T: int
    ns: int
    nw: int
    nc: int
    mode: str
    row0: int
    positions: torch.Tensor
    ratio: float | None = None
    sections: list[dict[str, Any]] = field(default_factory=list)
    stored_off: int = 0
    stored_len: int = 0


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with 16-bit operands, fp32 accumulation and fp32 output."""
    if a.is_cuda:
        if _MM_OUT_DTYPE[0]:
            try:
                return torch.mm(a, b, out_dtype=torch.float32)
            except (TypeError, RuntimeError, NotImplementedError) as e:
                _MM_OUT_DTYPE[0] = False
                log.warning("torch.mm(out_dtype=float32) unavailable (%s); using bf16 GEMM outputs", e)
        return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16)).float()
    return a.float() @ b.float()


_MM_OUT_DTYPE = [True]


class _GroupTables:
    def __init__(self, g, device: torch.device) -> None:
        self.layers = g.layers
        self.k_mean = g.k_mean.to(device, torch.float32).contiguous()
        self.v_mean = g.v_mean.to(device, torch.float32).contiguous()
        self.k_basis = g.k_basis.to(device, torch.float16).contiguous()  # exactly the calibration's fp16 basis
        self.v_basis = g.v_basis.to(device, torch.float16).contiguous()
        self.k_plans, self.v_plans = g.k_plans, g.v_plans
        self._starts: dict[tuple, torch.Tensor] = {}

    def starts(self, kind: str, ratio: float, bucket_index: int, bucket) -> torch.Tensor:
        key = (kind, ratio, bucket_index)
        t = self._starts.get(key)
        if t is None:
            t = self._starts[key] = torch.tensor(bucket.starts, dtype=torch.int64, device=self.k_mean.device)
        return t


class FusedCodec:
    """Batch encode/restore for one :class:`~dynamo_kvtc.codec.kvtc.KvtcCodec` (its calibration, ratio, sinks,
    window, min_tokens and entropy tag) on its device. Work is queued on the current CUDA stream."""

    def __init__(self, codec, *, ops: str = "auto") -> None:
        self.codec = codec
        self.device = codec.device
        self.cfg = codec.config
        self.fp = codec.fp
        if ops == "auto" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            ops = "torch"  # Triton kernels run on CUDA, or on the CPU only under its interpreter
        self.ops = get_ops(ops)
        self.torch_ops = TorchOps()
        self.entropy = BatchEntropy(self.device)
        self.tables = [_GroupTables(g, self.device) for g in codec.cal.groups]
        self._rope_cfgs = list(self.fp.rotary)
        self.last_timings: dict[str, float] = {}
        self.kernel_errors: list[str] = []
        self._pinned: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # one encode at a time (its pinned buffer)
        self._restore_lock = threading.Lock()  # one restore staging at a time

    # ------------------------------------------------------------------------------------------ helpers
    def _run(self, name: str, *args, **kw):
        """Run a stage with the Triton op; if it fails to compile or launch, switch to torch for good."""
        if self.ops.name == "triton":
            try:
                return getattr(self.ops, name)(*args, **kw)
            except Exception as e:  # noqa: BLE001 - compilation/launch problems of an optional backend
                if os.environ.get("DYN_KVTC_FUSED_STRICT") == "1":
                    raise
                msg = f"triton {name} failed ({type(e).__name__}: {e}); using torch ops"
                self.kernel_errors.append(msg)
                log.warning("kvtc fused codec: %s", msg)
                self.ops = self.torch_ops
        return getattr(self.torch_ops, name)(*args, **kw)

    def _pinned_buf(self, n: int, purpose: str) -> torch.Tensor:
        buf = self._pinned.get(purpose)
        if buf is None or buf.numel() < n:
            pin = self.device.type == "cuda"
            buf = self._pinned[purpose] = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=pin)
        return buf

    def _rope(self, cache: dict, layer: int, pos: torch.Tensor, inverse: bool):
        cfg = self._rope_cfgs[layer]
        key = (cfg, inverse)
        if key not in cache:
            cache[key] = rope_tables(cfg, pos, self.fp.head_dim, inverse=inverse)
        return cache[key]

    def _plan_blobs(self, spans: Sequence[Span]) -> tuple[list[_Blob], int]:
        cfg = self.cfg
        blobs, row = [], 0
        for sp in spans:
            pos = torch.as_tensor(sp.positions)
            if pos.dim() != 1 or pos.numel() == 0 or pos.dtype.is_floating_point or pos.dtype == torch.bool:
                raise InputError("positions must be a non-empty 1-D integer sequence")
            pos = pos.to("cpu", torch.int64)
            T = pos.numel()
            if int(pos[0]) < 0 or (T > 1 and not bool((pos[1:] > pos[:-1]).all())) or int(pos[-1]) >= 1 << 40:
                raise InputError("positions must be >= 0, < 2^40 and strictly increasing")
            if sp.window is not None and sp.window < 0:
                raise InputError(f"window must be >= 0, got {sp.window}")
            ns = int((pos < cfg.sinks).sum())
            nw = min(cfg.window if sp.window is None else sp.window, T - ns)
            nc = T - ns - nw
            mode = "kvtc"
            if nc < cfg.min_tokens:
                mode, ns, nw, nc = "raw", 0, T, 0
            blobs.append(_Blob(T, ns, nw, nc, mode, row, pos, cfg.ratio if mode == "kvtc" else None))
            row += nc
        return blobs, row

    # ============================================================================================ encode
    def encode_batch(
        self, source, spans: Sequence[Span], *, host_out: torch.Tensor | None = None
    ) -> list[bytes] | list[tuple[int, int]]:
        """Encode every span of ``source`` (:class:`DenseKV`, :class:`PagedBlocks`) into one blob each.

        Returns the blobs as ``bytes``, or, with ``host_out`` (a CPU uint8 tensor, pinned for asynchronous copies),
        writes them back to back into it and returns ``(offset, length)`` per blob."""
        fp = self.fp
        if (source.num_layers, source.heads, source.head_dim) != (fp.num_layers, fp.num_kv_heads, fp.head_dim):
            raise InputError(
                f"KV shape (layers={source.num_layers}, kv_heads={source.heads}, head_dim={source.head_dim}) "
                f"does not match the calibration's ({fp.num_layers}, {fp.num_kv_heads}, {fp.head_dim})"
            )
        if source.dtype not in DTYPES.values():
            raise InputError(f"KV dtype {source.dtype} not supported (bfloat16, float16, float32)")
        if self.cfg.tag in GPU_ONLY_TAGS and not self.entropy.nvcomp:
            raise ConfigError(
                f"entropy codec {self.cfg.tag!r} is GPU-only (nvCOMP); it needs CUDA and nvidia-nvcomp-cu13"
            )
        with self._lock:
            try:
                return self._encode(source, spans, host_out, bf16=False)
            except _Retry:
                return self._encode(source, spans, host_out, bf16=True)

    def _encode(self, source, spans, host_out, *, bf16: bool):
        dev = self.device
        clock = _Clock(dev)
        clock.mark("start")
        fp, cfg = self.fp, self.cfg
        L, H, D = fp.num_layers, fp.num_kv_heads, fp.head_dim
        HD = H * D
        blobs, R = self._plan_blobs(spans)
        toffs = [source.token_offsets(sp.seq, sp.start, b.T) for sp, b in zip(spans, blobs)]
        roff = torch.cat([t[b.ns : b.ns + b.nc] for t, b in zip(toffs, blobs)]) if R else None
        pos_rows = torch.cat([b.positions[b.ns : b.ns + b.nc] for b in blobs]).to(dev) if R else None
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        item = DTYPES[dtype_name(source.dtype)].itemsize

        # ---- raw section layout: blob-major, then group, then sinks/k/v/window; each section 16 B aligned
        raw_len = 0
        for b in blobs:
            for gi, tab in enumerate(self.tables):
                Lg = tab.layers[1] - tab.layers[0]
                for part in ("sinks", "k", "v", "window"):
                    if part == "sinks":
                        n = 2 * Lg * b.ns * H * (D + 2)
                    elif part == "window":
                        n = 2 * Lg * b.nw * H * D * item
                    else:
                        plans = tab.k_plans if part == "k" else tab.v_plans
                        n = plans[cfg.ratio].nbytes(b.nc) if b.nc else 0
                    tag = cfg.tag if part in ("k", "v") else "store"
                    b.sections.append({"name": f"{gi}.{part}", "tag": tag, "raw_len": n, "off": raw_len, "g": gi})
                    raw_len = _align(raw_len + n)
        raw = torch.zeros(max(raw_len, ALIGN), dtype=torch.uint8, device=dev)

        # ---- sinks and window (small: torch), every blob's tokens gathered at once per layer group
        for gi, tab in enumerate(self.tables):
            l0, l1 = tab.layers
            for part in ("sinks", "window"):
                picks = []  # (blob index, section, first token, count)
                for bi, b in enumerate(blobs):
                    n = b.ns if part == "sinks" else b.nw
                    if n:
                        sec = next(x for x in b.sections if x["name"] == f"{gi}.{part}")
                        picks.append((bi, sec, 0 if part == "sinks" else b.T - b.nw, n))
                if not picks:
                    continue
                offs = torch.cat([toffs[bi][a : a + n] for bi, _, a, n in picks])
                K, V = _gather_tokens(source, l0, l1, offs)  # [Lg, sum n, H, D]
                flag |= _nonfinite(K, V)
                at = 0
                for _, sec, _, n in picks:
                    k, v = K[:, at : at + n], V[:, at : at + n]
                    at += n
                    data = _encode_sinks_dev(k, v) if part == "sinks" else torch.cat((_bytes(k), _bytes(v)))
                    _write(raw, sec["off"], data)
        clock.mark("sinks_window")

        # ---- per layer group: prep -> GEMM -> quantize/pack, K then V
        if R:
            rope_cache: dict = {}
            cdt = torch.bfloat16 if bf16 else torch.float16
            for gi, tab in enumerate(self.tables):
                l0, l1 = tab.layers
                pg = (l1 - l0) * HD
                for kind in ("k", "v"):
                    mean = tab.k_mean if kind == "k" else tab.v_mean
                    basis = tab.k_basis if kind == "k" else tab.v_basis
                    plan = (tab.k_plans if kind == "k" else tab.v_plans)[cfg.ratio]
                    X = torch.empty(R, pg, dtype=cdt, device=dev)
                    for layer in range(l0, l1):
                        kv = source.layer(layer)
                        rope = None
                        if kind == "k" and self.codec.rope_removed:
                            rope = self._rope(rope_cache, layer, pos_rows, inverse=True)
                        col0 = (layer - l0) * HD
                        self._run(
                            "prep", kv[0 if kind == "k" else 1], roff, X, col0, mean[col0 : col0 + HD], rope, flag,
                            H, D, source.stride_h, source.stride_d, bf16=bf16,
                        )  # fmt: skip
                    clock.mark("prep")
                    C = _mm_f32(X, basis[:, : plan.rank].to(cdt))
                    del X
                    clock.mark("project")
                    for b in blobs:
                        if not b.nc:
                            continue
                        sec = next(s for s in b.sections if s["name"] == f"{gi}.{kind}")
                        self._quantize_blob(C[b.row0 : b.row0 + b.nc], b.nc, plan, raw, sec["off"], tab, kind)
                    del C
                    clock.mark("quantize")

        # ---- entropy: every chunk of every coded section, one batch per tag
        ent: dict[str, tuple[list, _EncodeOut]] = {}
        by_tag: dict[str, list[tuple[dict, int, int]]] = {}
        for b in blobs:
            for s in b.sections:
                if s["tag"] == "store" or not s["raw_len"]:
                    continue
                s["first_item"] = len(by_tag.setdefault(s["tag"], []))
                for ci, n in enumerate(chunk_sizes(s["raw_len"])):
                    by_tag[s["tag"]].append((s, ci, n))
        for tag, items in by_tag.items():
            offs = [s["off"] + ci * CHUNK_BYTES for s, ci, _ in items]
            ent[tag] = (items, self.entropy.encode(tag, raw, offs, [n for _, _, n in items]))
        clock.mark("entropy")

        # ---- sizes (first synchronisation), flags
        for tag, (items, res) in ent.items():
            sizes = res.sizes()
            for (s, ci, _), n in zip(items, sizes):
                if not 0 < n <= MAX_STORED_CHUNK:
                    raise RuntimeError(f"{tag} chunk compressed to {n} bytes, outside the format's limit")
                s.setdefault("chunks", {})[ci] = n
        bad = int(flag.item())
        if bad & FLAG_NONFINITE:
            raise InputError("keys or values contain NaN or Inf; refusing to store them")
        if bad & FLAG_F16_OVERFLOW and not bf16:
            raise _Retry()

        # ---- compaction into blob order, device CRCs (second synchronisation), headers
        stored_total = 0
        copies_raw: list[tuple[int, int, int]] = []
        copies_ent: dict[str, list[tuple[int, int, int]]] = {t: [] for t in ent}
        for b in blobs:
            b.stored_off = stored_total
            for s in b.sections:
                s["stored_off"] = stored_total
                if s["tag"] == "store" or not s["raw_len"]:
                    lens = chunk_sizes(s["raw_len"])
                    if s["raw_len"]:
                        copies_raw.append((s["off"], stored_total, s["raw_len"]))
                else:
                    lens = [s["chunks"][ci] for ci in range(len(s["chunks"]))]
                    res = ent[s["tag"]][1]
                    pos = stored_total
                    base = s["first_item"]
                    for ci, n in enumerate(lens):
                        copies_ent[s["tag"]].append(((base + ci) * res.cap, pos, n))
                        pos += n
                s["lens"] = lens
                s["stored_len"] = sum(lens)
                stored_total += s["stored_len"]
            b.stored_len = stored_total - b.stored_off
        stored = torch.empty(max(stored_total, 1), dtype=torch.uint8, device=dev)
        if copies_raw:
            self._run("copy_chunks", raw, stored, *zip(*copies_raw))
        for tag, cps in copies_ent.items():
            if cps:
                self._run("copy_chunks", ent[tag][1].out, stored, *zip(*cps))
        secs = [s for b in blobs for s in b.sections]
        crcs = self._run("crc", stored, [s["stored_off"] for s in secs], [s["stored_len"] for s in secs])
        for s, c in zip(secs, crcs):
            s["crc"] = c
        clock.mark("finish_device")

        heads = []
        for b, _sp in zip(blobs, spans):
            table = [
                [s["name"], s["tag"], int(s["raw_len"]), int(s["crc"]), [int(n) for n in s["lens"]]] for s in b.sections
            ]
            header = {
                "cal": self.codec.cal.id,
                "layers": L,
                "heads": H,
                "head_dim": D,
                "dtype": dtype_name(source.dtype),
                "tokens": b.T,
                "positions": positions_to_runs(b.positions.tolist()),
                "mode": b.mode,
                "ratio": b.ratio,
                "sinks": b.ns,
                "window": b.nw,
                "groups": [list(t.layers) for t in self.tables],
                "sections": table,
            }
            hdr = msgpack.packb(header, use_bin_type=True)
            if len(hdr) > MAX_HEADER_BYTES:
                raise InputError(f"header of {len(hdr)} bytes exceeds {MAX_HEADER_BYTES}; use shorter spans")
            heads.append(PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(hdr), zlib.crc32(hdr)) + hdr)

        # ---- device -> host, one copy per blob into its final place
        total = sum(len(h) + b.stored_len for h, b in zip(heads, blobs))
        own = host_out is None
        host = self._pinned_buf(total, "encode") if own else host_out
        if host.numel() < total:
            raise InputError(f"host_out holds {host.numel()} bytes, the blobs need {total}")
        placed, off = [], 0
        for h, b in zip(heads, blobs):
            host[off : off + len(h)] = torch.frombuffer(bytearray(h), dtype=torch.uint8)
            a = off + len(h)
            if b.stored_len:
                host[a : a + b.stored_len].copy_(stored[b.stored_off : b.stored_off + b.stored_len], non_blocking=True)
            placed.append((off, len(h) + b.stored_len))
            off += len(h) + b.stored_len
        clock.mark("d2h")
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        st = clock.stages()
        self.last_timings = {f"encode_{k}_s": v for k, v in st.items() if k != "start"}
        self.last_timings["encode_total_s"] = sum(v for k, v in st.items() if k != "start")
        self.last_timings["encode_bf16_retry"] = float(bf16)
        if not own:
            return placed
        mv = host.numpy()
        return [mv[o : o + n].tobytes() for o, n in placed]

    def _quantize_blob(self, C, nc, plan, raw, sec_off, tab, kind) -> None:
        dev = self.device
        for bi, (bk, boff, nb) in enumerate(iter_sections(plan, nc)):
            n = len(bk.starts)
            base = sec_off + boff
            shift = raw[base : base + 2 * n * nc].view(torch.float16)
            scale = raw[base + 2 * n * nc : base + 4 * n * nc].view(torch.float16)
            codes_off = base + 4 * n * nc
            codes_len = nb - 4 * n * nc
            bits = BITS[bk.kind]
            per = 8 // bits
            starts = tab.starts(kind, plan.ratio, bi, bk)
            pack = per == 1 or nc % per == 0
            if pack:
                self._run("quantize", C, nc, bk.kind, bk.size, starts, shift, scale, raw[codes_off : base + nb], True)
            else:
                scratch = torch.empty(n * bk.size * nc, dtype=torch.uint8, device=dev)
                self._run("quantize", C, nc, bk.kind, bk.size, starts, shift, scale, scratch, False)
                from ..plan import pack_codes

                p = pack_codes(scratch, bits)
                raw[codes_off : codes_off + p.numel()] = p
            used = (n * bk.size * nc * bits + 7) // 8
            if used < codes_len:  # the even-length padding byte
                raw[codes_off + used : codes_off + codes_len] = 0

    # ============================================================================================ restore
    def open(self, blobs: Sequence[Any]) -> RestoreJob:
        """Parse, copy to the device and CRC-check every blob (raises DecodeError before anything is decoded).

        A blob is ``bytes``/``bytearray``/``memoryview``, or ``(tensor, offset, length)`` with a CPU uint8 tensor
        (pinned: the host->device copy is asynchronous)."""
        return RestoreJob(self, blobs)


class _Retry(Exception):
    pass


# =================================================================================================== restore job
class RestoreJob:
    def __init__(self, fc: FusedCodec, blobs: Sequence[Any]) -> None:
        self.fc = fc
        codec = fc.codec
        dev = fc.device
        self.clock = _Clock(dev)
        self.clock.mark("start")
        self.heads: list[dict[str, Any]] = []
        self.recs: list[list] = []
        srcs = []
        for b in blobs:
            if isinstance(b, tuple):
                t, off, n = b
                mv = memoryview(t.numpy())[off : off + n]
                srcs.append((t, off, n, mv))
            else:
                mv = memoryview(b).cast("B")
                srcs.append((None, 0, len(mv), mv))
            h, recs = codec._open(mv)
            self.heads.append(h)
            self.recs.append(recs)
        self.tokens = [h["tokens"] for h in self.heads]
        self.bases = []
        acc = 0
        for T in self.tokens:
            self.bases.append(acc)
            acc += T
        self.total_tokens = acc
        # ---- host -> device: each blob's section bytes, back to back
        spans, total = [], 0
        for (_, _, n, _), recs in zip(srcs, self.recs):
            first = recs[0].offset if recs else n
            spans.append((total, first, n - first))
            total += n - first
        self.staged = torch.empty(max(total, 1), dtype=torch.uint8, device=dev)
        self.spans = spans
        with fc._restore_lock:  # the pinned staging buffer is reused: held until the CRC step has synchronised
            self._stage_and_check(srcs, spans, total)
        self._checks: list[Callable[[], None]] = []
        self.timings: dict[str, float] = {}

    def _stage_and_check(self, srcs, spans, total) -> None:
        fc, dev = self.fc, self.fc.device
        stage = None
        if dev.type == "cuda" and any(t is None or not t.is_pinned() for t, *_ in srcs):
            stage = fc._pinned_buf(total, "restore")
        for (t, off, _, mv), (dst, first, ln) in zip(srcs, spans):
            if not ln:
                continue
            if t is not None and (dev.type != "cuda" or t.is_pinned()):
                self.staged[dst : dst + ln].copy_(t[off + first : off + first + ln], non_blocking=True)
            else:
                host = stage if stage is not None else self.staged
                host[dst : dst + ln].numpy()[:] = np.frombuffer(mv[first : first + ln], dtype=np.uint8)
                if stage is not None:
                    self.staged[dst : dst + ln].copy_(stage[dst : dst + ln], non_blocking=True)
        self.clock.mark("h2d")
        # ---- CRC of every section on the device (one synchronisation), before anything is inflated
        self.sec: list[list[dict[str, Any]]] = []
        offs, lens, want = [], [], []
        for (dst, first, _), recs in zip(spans, self.recs):
            rows = []
            for r in recs:
                so = dst + r.offset - first
                rows.append({"rec": r, "staged_off": so})
                offs.append(so)
                lens.append(r.stored_len)
                want.append(r.crc)
            self.sec.append(rows)
        got = fc._run("crc", self.staged, offs, lens)
        for g, w, (bi, r) in zip(got, want, [(i, r) for i, rs in enumerate(self.recs) for r in rs]):
            if g != w:
                raise CorruptBlobError(f"blob {bi} section {r.name!r} checksum mismatch (corrupted bytes)")
        self.clock.mark("crc")

    # ------------------------------------------------------------------------------------------------ decode
    def _inflate(self) -> None:
        """Realign compressed chunks, inflate them (one nvCOMP batch per tag) into 16 B aligned raw sections."""
        fc, dev = self.fc, self.fc.device
        raw_len = 0
        for rows in self.sec:
            for row in rows:
                row["raw_off"] = raw_len
                raw_len = _align(raw_len + row["rec"].raw_len)
        self.raw = torch.zeros(max(raw_len, ALIGN), dtype=torch.uint8, device=dev)
        store_cp: list[tuple[int, int, int]] = []
        comp: dict[str, list[tuple[int, int, int, int]]] = {}  # tag -> (staged_off, stored_len, raw_off, raw_len)
        for rows in self.sec:
            for row in rows:
                r = row["rec"]
                if not r.raw_len:
                    continue
                if r.tag == "store":
                    store_cp.append((row["staged_off"], row["raw_off"], r.raw_len))
                    continue
                so = row["staged_off"]
                for ci, (n, raw_n) in enumerate(zip(r.chunks, chunk_sizes(r.raw_len))):
                    comp.setdefault(r.tag, []).append((so, n, row["raw_off"] + ci * CHUNK_BYTES, raw_n))
                    so += n
        if store_cp:
            fc._run("copy_chunks", self.staged, self.raw, *zip(*store_cp))
        for tag, items in comp.items():
            if not fc.entropy.usable(tag):
                raise CorruptBlobError(f"entropy codec {tag!r} cannot be decoded here")
            aligned_offs, total = [], 0
            for _, n, _, _ in items:
                aligned_offs.append(total)
                total = _align(total + n)
            aligned = torch.empty(max(total, ALIGN), dtype=torch.uint8, device=dev)
            fc._run("copy_chunks", self.staged, aligned, [i[0] for i in items], aligned_offs, [i[1] for i in items])
            self._checks.append(
                fc.entropy.decode(
                    tag,
                    aligned,
                    aligned_offs,
                    [i[1] for i in items],
                    self.raw,
                    [i[2] for i in items],
                    [i[3] for i in items],
                )
            )
        self.clock.mark("entropy")

    def _dequant(self) -> None:
        fc, dev = self.fc, self.fc.device
        H, D = fc.fp.num_kv_heads, fc.fp.head_dim
        # coded rows: per DP plan (ratio), the concatenation of its blobs' coded tokens -> one matrix per K/V/group
        self.rgroups: list[dict[str, Any]] = []
        by_ratio: dict[float, list[int]] = {}
        for bi, h in enumerate(self.heads):
            if h["mode"] == "kvtc" and h["tokens"] - h["sinks"] - h["window"]:
                by_ratio.setdefault(float(h["ratio"]), []).append(bi)
        for ratio, members in sorted(by_ratio.items()):
            rows0, R, pos_rows = {}, 0, []
            for bi in members:
                h = self.heads[bi]
                nc = h["tokens"] - h["sinks"] - h["window"]
                rows0[bi] = R
                R += nc
                pos = torch.tensor(runs_to_positions(h["positions"]), dtype=torch.int64)
                pos_rows.append(pos[h["sinks"] : h["sinks"] + nc])
            rg = {"ratio": ratio, "blobs": members, "rows0": rows0, "R": R, "pos": torch.cat(pos_rows).to(dev)}
            rg["coeffs"] = []
            for gi, tab in enumerate(fc.tables):
                out = {}
                for kind in ("k", "v"):
                    plan = (tab.k_plans if kind == "k" else tab.v_plans)[ratio]
                    Dm = torch.zeros(R, plan.rank, dtype=torch.float16, device=dev)
                    for bi in members:
                        h = self.heads[bi]
                        nc = h["tokens"] - h["sinks"] - h["window"]
                        row = next(x for x in self.sec[bi] if x["rec"].name == f"{gi}.{kind}")
                        base0 = row["raw_off"]
                        view = Dm[rows0[bi] : rows0[bi] + nc]
                        for bki, (bk, boff, nb) in enumerate(iter_sections(plan, nc)):
                            n = len(bk.starts)
                            base = base0 + boff
                            shift = self.raw[base : base + 2 * n * nc].view(torch.float16)
                            scale = self.raw[base + 2 * n * nc : base + 4 * n * nc].view(torch.float16)
                            codes = self.raw[base + 4 * n * nc : base + nb]
                            starts = tab.starts(kind, ratio, bki, bk)
                            fc._run("dequant", codes, shift, scale, bk.kind, bk.size, starts, view, nc)
                    out[kind] = Dm
                rg["coeffs"].append(out)
            self.rgroups.append(rg)
        # sinks (fp8 -> float) and window rows, all blobs, all layers: [L, n_extra, H, D] in each blob's dtype
        self.extra = []
        for gi, tab in enumerate(fc.tables):
            l0, l1 = tab.layers
            Lg = l1 - l0
            ks, vs, toks = [], [], []
            for bi, (h, rows) in enumerate(zip(self.heads, self.sec)):
                dtype = DTYPES[h["dtype"]]
                ns, nw, T = h["sinks"], h["window"], h["tokens"]
                if ns:
                    row = next(x for x in rows if x["rec"].name == f"{gi}.sinks")
                    buf = self.raw[row["raw_off"] : row["raw_off"] + row["rec"].raw_len]
                    sk, sv = _decode_sinks_dev(buf, Lg, ns, H, D)
                    ks.append(sk.to(dtype))
                    vs.append(sv.to(dtype))
                    toks.append((bi, 0, ns))
                if nw:
                    row = next(x for x in rows if x["rec"].name == f"{gi}.window")
                    item = dtype.itemsize
                    half = Lg * nw * H * D * item
                    a = row["raw_off"]
                    ks.append(self.raw[a : a + half].view(dtype).view(Lg, nw, H, D))
                    vs.append(self.raw[a + half : a + 2 * half].view(dtype).view(Lg, nw, H, D))
                    toks.append((bi, T - nw, nw))
            self.extra.append((ks, vs, toks))
        self.clock.mark("dequantize")

    def layers(self, dest=None, targets: Sequence[tuple[int, int]] | None = None, keep=None) -> Iterator:
        """Decode layer by layer. With ``dest`` (:class:`DenseKV` / :class:`PagedBlocks`), blob i is written to
        tokens ``targets[i] = (seq, start)`` onwards (``keep[i] = (a, b)``: only its tokens a..b-1) and
        ``layer`` is yielded once its writes are queued; without, yields ``(layer, k, v)`` with fresh
        ``[total_tokens, H, D]`` tensors (blob i at rows ``bases[i]``...). Call :meth:`finish` afterwards."""
        fc, dev = self.fc, self.fc.device
        fp = fc.fp
        H, D = fp.num_kv_heads, fp.head_dim
        HD = H * D
        self._inflate()
        self._dequant()
        dtypes = {DTYPES[h["dtype"]] for h in self.heads}
        if dest is None:
            if len(dtypes) != 1:
                raise InputError("blobs of different dtypes need a destination")
            out_dtype = dtypes.pop()
            sh, sd = D, 1
            offs = [torch.arange(b, b + T, dtype=torch.int64, device=dev) * HD for b, T in zip(self.bases, self.tokens)]
        else:
            sh, sd = dest.stride_h, dest.stride_d
            targets = targets or [(i, 0) for i in range(len(self.heads))]
            offs = []
            for i, ((seq, start), T) in enumerate(zip(targets, self.tokens)):
                o = dest.token_offsets(seq, start, T)
                if keep is not None and keep[i] is not None:
                    a, b = keep[i]
                    m = torch.ones(T, dtype=torch.bool, device=o.device)
                    m[a:b] = False
                    o = torch.where(m, torch.full_like(o, -1), o)
                offs.append(o)
        for rg in self.rgroups:
            rg["doff"] = torch.cat(
                [offs[bi][self.heads[bi]["sinks"] : self.heads[bi]["sinks"] + rg_nc] for bi, rg_nc in _ncs(self, rg)]
            )
            rg["rope"] = {}
        for gi, tab in enumerate(fc.tables):
            l0, l1 = tab.layers
            ks, vs, toks = self.extra[gi]
            extra_off = torch.cat([offs[bi][a : a + n] for bi, a, n in toks]) if toks else None
            for layer in range(l0, l1):
                if dest is None:
                    kbuf = torch.empty(self.total_tokens, H, D, dtype=out_dtype, device=dev)
                    vbuf = torch.empty_like(kbuf)
                    kdst, vdst = kbuf, vbuf
                else:
                    kdst, vdst = dest.layer(layer)
                cols = slice((layer - l0) * HD, (layer - l0 + 1) * HD)
                for rg in self.rgroups:
                    for kind, dst in (("k", kdst), ("v", vdst)):
                        basis = tab.k_basis if kind == "k" else tab.v_basis
                        mean = (tab.k_mean if kind == "k" else tab.v_mean)[cols]
                        Dm = rg["coeffs"][gi][kind]
                        Y = _mm_f32(Dm, basis[cols, : Dm.shape[1]].t())
                        rope = None
                        if kind == "k" and fc.codec.rope_removed:
                            rope = fc._rope(rg["rope"], layer, rg["pos"], inverse=False)
                        fc._run("post", Y, rg["doff"], dst, mean, rope, H, D, sh, sd)
                if toks:
                    i = layer - l0
                    _scatter_rows(kdst, extra_off, torch.cat([k[i] for k in ks]), H, D, sh, sd)
                    _scatter_rows(vdst, extra_off, torch.cat([v[i] for v in vs]), H, D, sh, sd)
                self.clock.mark(f"layer{layer}")
                yield (layer, kbuf, vbuf) if dest is None else layer

    def finish(self) -> dict[str, float]:
        """Wait for the stream, run the deferred nvCOMP size checks, return stage timings (seconds)."""
        if self.fc.device.type == "cuda":
            torch.cuda.current_stream(self.fc.device).synchronize()
        for check in self._checks:
            check()
        st = self.clock.stages()
        layers = sum(v for k, v in st.items() if k.startswith("layer"))
        out = {f"decode_{k}_s": v for k, v in st.items() if not k.startswith("layer") and k != "start"}
        out["decode_project_s"] = layers
        out["decode_first_layer_s"] = self.clock.since_start("layer0") or 0.0
        out["decode_total_s"] = sum(st.values())
        self.timings = out
        self.fc.last_timings = dict(out)
        return out


# =================================================================================================== small helpers
def _ncs(job: RestoreJob, rg: dict) -> list[tuple[int, int]]:
    return [(bi, job.heads[bi]["tokens"] - job.heads[bi]["sinks"] - job.heads[bi]["window"]) for bi in rg["blobs"]]


def _write(buf: torch.Tensor, off: int, data: torch.Tensor) -> None:
    buf[off : off + data.numel()] = data


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _nonfinite(*ts: torch.Tensor) -> torch.Tensor:
    bad = torch.zeros((), dtype=torch.int32, device=ts[0].device)
    for t in ts:
        bad = bad | (~torch.isfinite(t)).any().to(torch.int32)
    return bad * FLAG_NONFINITE


def _gather_tokens(source, l0: int, l1: int, toff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[l1-l0, n, H, D]`` of the tokens at element offsets ``toff`` (same for every layer)."""
    H, D = source.heads, source.head_dim
    idx = (torch.arange(H, device=toff.device) * source.stride_h)[:, None] + (
        torch.arange(D, device=toff.device) * source.stride_d
    )[None, :]
    idx = toff[:, None, None] + idx[None]
    ks, vs = [], []
    for layer in range(l0, l1):
        k, v = source.layer(layer)
        ks.append(flat_view(k)[idx])
        vs.append(flat_view(v)[idx])
    return torch.stack(ks), torch.stack(vs)


def _scatter_rows(dst: torch.Tensor, off: torch.Tensor, vals: torch.Tensor, H, D, sh, sd) -> None:
    keep = off >= 0
    idx = (torch.arange(H, device=off.device) * sh)[:, None] + (torch.arange(D, device=off.device) * sd)[None, :]
    flat_view(dst)[off[keep][:, None, None] + idx[None]] = vals[keep].to(dst.dtype)


def _encode_sinks_dev(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """As ``kvtc._encode_sinks`` (fp8 E4M3 codes, then fp16 scales, K then V) but left on the device."""
    parts = []
    for x in (k, v):
        xf = x.float()
        scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(max=65504.0).to(torch.float16)
        sf = scale.float()
        inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
        codes = (xf * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        parts += [codes.reshape(-1), scale.contiguous().view(torch.uint8).reshape(-1)]
    return torch.cat(parts)


def _decode_sinks_dev(buf: torch.Tensor, Lg: int, ns: int, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_codes, n_scale = Lg * ns * H * D, Lg * ns * H * 2
    out, off = [], 0
    for _ in range(2):
        codes = buf[off : off + n_codes].view(torch.float8_e4m3fn).float().view(Lg, ns, H, D)
        off += n_codes
        scale = buf[off : off + n_scale].contiguous().view(torch.float16).float().view(Lg, ns, H, 1)
        off += n_scale
        out.append(codes * scale)
    return out[0], out[1]


def fused_status(device: str | torch.device) -> dict[str, Any]:
    """What the fused path would use on ``device``: ops backend, nvCOMP, the GEMM output mode."""
    from .ops import triton_status

    dev = torch.device(device)
    ok, why = triton_status()
    return {
        "device": str(dev),
        "ops": "triton" if (ok and dev.type == "cuda") else "torch",
        "triton": why,
        "nvcomp": dev.type == "cuda" and nvcomp_available(),
        "env_disabled": os.environ.get("DYN_KVTC_FUSED", "1") == "0",
    }
