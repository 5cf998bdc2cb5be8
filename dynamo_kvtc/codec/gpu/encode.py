"""Encode for the fused codec: one :class:`EncodeRun` per :meth:`FusedCodec.encode_batch` call (and precision).

Stages, for all spans of the batch together (see :mod:`.fused` for the whole picture):

1. layout: every blob's raw sections (blob-major, then layer group, then sinks/k/v/window), each 16 B aligned, in one
   device buffer;
2. sinks (fp8, :mod:`dynamo_kvtc.codec.sinks`) and raw window rows gathered straight from the source;
3. ``prep`` -> ``project`` (fp16 GEMM, fp32 output) -> ``quantize`` per layer group, K then V;
4. ``entropy``: every chunk of every coded section, one batch per tag;
5. sizes (first synchronisation), compaction into the blobs' byte order, device CRCs (second synchronisation), headers
   framed by :func:`dynamo_kvtc.codec.container.frame_header`, one device-to-host copy per blob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...errors import InputError
from ..container import SectionRecord, frame_header
from ..entropy.base import CHUNK_BYTES, MAX_STORED_CHUNK, chunk_sizes
from ..model import DTYPES, dtype_name
from ..plan import iter_sections, pack_codes
from ..quant import BITS
from ..sinks import encode_sinks, sink_bytes
from .batch_entropy import EncodeOut
from .clock import Clock
from .layouts import Span, gather_tokens
from .ops import ALIGN, FLAG_F16_OVERFLOW, FLAG_NONFINITE, align

if TYPE_CHECKING:
    from .device import FusedDevice


class F16Overflow(Exception):
    """The fp16 staging of a batch overflowed: the caller re-runs the batch in bf16."""


@dataclass(eq=False)
class _Blob:
    """One blob of the batch being written: its token split, its coded rows, its sections and stored bytes."""

    T: int
    ns: int
    nw: int
    nc: int
    mode: str
    row0: int
    positions: torch.Tensor
    sections: list[dict[str, Any]] = field(default_factory=list)
    stored_off: int = 0
    stored_len: int = 0


def plan_blobs(cfg, spans: Sequence[Span]) -> tuple[list[_Blob], int]:
    """Validate each span's positions and split its tokens (``cfg``: the codec's CodecConfig); rows are the coded
    tokens of all blobs back to back."""
    blobs, row = [], 0
    for sp in spans:
        pos = torch.as_tensor(sp.positions)
        if pos.dim() != 1 or pos.numel() == 0 or pos.dtype.is_floating_point or pos.dtype == torch.bool:
            raise InputError("positions must be a non-empty 1-D integer sequence")
        pos = pos.to("cpu", torch.int64)
        T = pos.numel()
        if int(pos[0]) < 0 or (T > 1 and not bool((pos[1:] > pos[:-1]).all())) or int(pos[-1]) >= 1 << 40:
            raise InputError("positions must be >= 0, < 2^40 and strictly increasing")
        mode, ns, nw, nc = cfg.segments(pos, sp.window)
        blobs.append(_Blob(T, ns, nw, nc, mode, row, pos))
        row += nc
    return blobs, row


def _nonfinite(*ts: torch.Tensor) -> torch.Tensor:
    bad = torch.zeros((), dtype=torch.int32, device=ts[0].device)
    for t in ts:
        bad = bad | (~torch.isfinite(t)).any().to(torch.int32)
    return bad * FLAG_NONFINITE


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


class EncodeRun:
    """One batch encode at one precision (fp16 staging, or bf16 after an overflow). Owns the batch's device buffers
    (raw sections, compressed chunks, stored bytes) and the blobs' section tables; never touches the source's memory
    beyond reading the spans' tokens, and never writes to ``host_out`` past the bytes the blobs need."""

    def __init__(self, fc: FusedDevice, source, spans: Sequence[Span], *, bf16: bool) -> None:
        self.fc, self.source, self.spans, self.bf16 = fc, source, spans, bf16
        self.dev = fc.device
        self.clock = Clock(self.dev)
        self.clock.mark("start")
        self.blobs, self.R = plan_blobs(fc.cfg, spans)
        self.toffs = [source.token_offsets(sp.seq, sp.start, b.T) for sp, b in zip(spans, self.blobs)]
        self.flag = torch.zeros(1, dtype=torch.int32, device=self.dev)

    def run(self, host_out: torch.Tensor | None, views: bool = False) -> list[bytes] | list[tuple[int, int]]:
        """Encode the batch; raises :class:`F16Overflow` if the fp16 staging overflowed (re-run with bf16).
        ``views``: blobs as memoryviews into the codec's reusable pinned buffer (see FusedCodec.encode_batch)."""
        self._layout()
        self._sinks_and_window()
        self.clock.mark("sinks_window")
        if self.R:
            self._project_and_quantize()
        ent = self._entropy()
        self.clock.mark("entropy")
        self._check_sizes_and_flags(ent)
        stored = self._compact_and_crc(ent)
        self.clock.mark("finish_device")
        return self._to_host([self._frame(b) for b in self.blobs], stored, host_out, views)

    # ------------------------------------------------------------------------------------------------ layout
    def _layout(self) -> None:
        """Raw section layout: blob-major, then group, then sinks/k/v/window; each section 16 B aligned."""
        fp, cfg = self.fc.fp, self.fc.cfg
        H, D = fp.num_kv_heads, fp.head_dim
        item = DTYPES[dtype_name(self.source.dtype)].itemsize
        raw_len = 0
        for b in self.blobs:
            for gi, tab in enumerate(self.fc.tables):
                Lg = tab.layers[1] - tab.layers[0]
                for part in ("sinks", "k", "v", "window"):
                    if part == "sinks":
                        n = sink_bytes(Lg, b.ns, H, D)
                    elif part == "window":
                        n = 2 * Lg * b.nw * H * D * item
                    else:
                        plans = tab.k_plans if part == "k" else tab.v_plans
                        n = plans[cfg.ratio].nbytes(b.nc) if b.nc else 0
                    tag = cfg.tag if part in ("k", "v") else "store"
                    b.sections.append({"name": f"{gi}.{part}", "tag": tag, "raw_len": n, "off": raw_len, "g": gi})
                    raw_len = align(raw_len + n)
        self.raw = torch.zeros(max(raw_len, ALIGN), dtype=torch.uint8, device=self.dev)

    def _sinks_and_window(self) -> None:
        """Sinks and window (small: torch), every blob's tokens gathered at once per layer group."""
        for gi, tab in enumerate(self.fc.tables):
            l0, l1 = tab.layers
            for part in ("sinks", "window"):
                picks = []  # (blob index, section, first token, count)
                for bi, b in enumerate(self.blobs):
                    n = b.ns if part == "sinks" else b.nw
                    if n:
                        sec = next(x for x in b.sections if x["name"] == f"{gi}.{part}")
                        picks.append((bi, sec, 0 if part == "sinks" else b.T - b.nw, n))
                if not picks:
                    continue
                offs = torch.cat([self.toffs[bi][a : a + n] for bi, _, a, n in picks])
                K, V = gather_tokens(self.source, l0, l1, offs)  # [Lg, sum n, H, D]
                self.flag |= _nonfinite(K, V)
                at = 0
                for _, sec, _, n in picks:
                    k, v = K[:, at : at + n], V[:, at : at + n]
                    at += n
                    data = encode_sinks(k, v) if part == "sinks" else torch.cat((_bytes(k), _bytes(v)))
                    self.raw[sec["off"] : sec["off"] + data.numel()] = data

    # ------------------------------------------------------------------------------------------------ coded rows
    def _project_and_quantize(self) -> None:
        """Per layer group: prep -> GEMM -> quantize/pack, K then V."""
        fc, src, dev, R = self.fc, self.source, self.dev, self.R
        H, D = fc.fp.num_kv_heads, fc.fp.head_dim
        HD = H * D
        roff = torch.cat([t[b.ns : b.ns + b.nc] for t, b in zip(self.toffs, self.blobs)])
        pos_rows = torch.cat([b.positions[b.ns : b.ns + b.nc] for b in self.blobs]).to(dev)
        rope_cache: dict = {}
        cdt = torch.bfloat16 if self.bf16 else torch.float16
        for gi, tab in enumerate(fc.tables):
            l0, l1 = tab.layers
            for kind in ("k", "v"):
                mean = tab.k_mean if kind == "k" else tab.v_mean
                plan = (tab.k_plans if kind == "k" else tab.v_plans)[fc.cfg.ratio]
                X = torch.empty(R, (l1 - l0) * HD, dtype=cdt, device=dev)
                for layer in range(l0, l1):
                    kv = src.layer(layer)
                    rope = None
                    if kind == "k" and fc.codec.rope_removed:
                        rope = fc.rope(rope_cache, layer, pos_rows, inverse=True)
                    col0 = (layer - l0) * HD
                    fc.run_stage(
                        "prep", kv[0 if kind == "k" else 1], roff, X, col0, mean[col0 : col0 + HD], rope, self.flag,
                        H, D, src.stride_h, src.stride_d, bf16=self.bf16,
                    )  # fmt: skip
                self.clock.mark("prep")
                C = fc.projector.encode(X, tab, kind, plan.rank)
                del X
                self.clock.mark("project")
                for b in self.blobs:
                    if not b.nc:
                        continue
                    sec = next(s for s in b.sections if s["name"] == f"{gi}.{kind}")
                    self._quantize_blob(C[b.row0 : b.row0 + b.nc], b.nc, plan, sec["off"], tab, kind)
                del C
                self.clock.mark("quantize")

    def _quantize_blob(self, C, nc, plan, sec_off, tab, kind) -> None:
        raw = self.raw
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
            if per == 1 or nc % per == 0:
                self.fc.run_stage(
                    "quantize", C, nc, bk.kind, bk.size, starts, shift, scale, raw[codes_off : base + nb], True
                )
            else:
                scratch = torch.empty(n * bk.size * nc, dtype=torch.uint8, device=self.dev)
                self.fc.run_stage("quantize", C, nc, bk.kind, bk.size, starts, shift, scale, scratch, False)
                p = pack_codes(scratch, bits)
                raw[codes_off : codes_off + p.numel()] = p
            used = (n * bk.size * nc * bits + 7) // 8
            if used < codes_len:  # the even-length padding byte
                raw[codes_off + used : codes_off + codes_len] = 0

    # ------------------------------------------------------------------------------------------------ entropy
    def _entropy(self) -> dict[str, tuple[list, EncodeOut]]:
        """Every chunk of every coded section, one batch per tag."""
        by_tag: dict[str, list[tuple[dict, int, int]]] = {}
        for b in self.blobs:
            for s in b.sections:
                if s["tag"] == "store" or not s["raw_len"]:
                    continue
                s["first_item"] = len(by_tag.setdefault(s["tag"], []))
                for ci, n in enumerate(chunk_sizes(s["raw_len"])):
                    by_tag[s["tag"]].append((s, ci, n))
        ent: dict[str, tuple[list, EncodeOut]] = {}
        for tag, items in by_tag.items():
            offs = [s["off"] + ci * CHUNK_BYTES for s, ci, _ in items]
            ent[tag] = (items, self.fc.entropy.encode(tag, self.raw, offs, [n for _, _, n in items]))
        return ent

    def _check_sizes_and_flags(self, ent: dict[str, tuple[list, EncodeOut]]) -> None:
        """Compressed sizes (first synchronisation), then the input flags."""
        for tag, (items, res) in ent.items():
            sizes = res.sizes()
            for (s, ci, _), n in zip(items, sizes):
                if not 0 < n <= MAX_STORED_CHUNK:
                    raise RuntimeError(f"{tag} chunk compressed to {n} bytes, outside the format's limit")
                s.setdefault("chunks", {})[ci] = n
        bad = int(self.flag.item())
        if bad & FLAG_NONFINITE:
            raise InputError("keys or values contain NaN or Inf; refusing to store them")
        if bad & FLAG_F16_OVERFLOW and not self.bf16:
            raise F16Overflow()

    # ------------------------------------------------------------------------------------------------ finish
    def _compact_and_crc(self, ent: dict[str, tuple[list, EncodeOut]]) -> torch.Tensor:
        """Compaction into blob order and the device CRC of every section (second synchronisation)."""
        stored_total = 0
        copies_raw: list[tuple[int, int, int]] = []
        copies_ent: dict[str, list[tuple[int, int, int]]] = {t: [] for t in ent}
        for b in self.blobs:
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
        stored = torch.empty(max(stored_total, 1), dtype=torch.uint8, device=self.dev)
        if copies_raw:
            self.fc.run_stage("copy_chunks", self.raw, stored, *zip(*copies_raw))
        for tag, cps in copies_ent.items():
            if cps:
                self.fc.run_stage("copy_chunks", ent[tag][1].out, stored, *zip(*cps))
        secs = [s for b in self.blobs for s in b.sections]
        crcs = self.fc.run_stage("crc", stored, [s["stored_off"] for s in secs], [s["stored_len"] for s in secs])
        for s, c in zip(secs, crcs):
            s["crc"] = c
        return stored

    def _frame(self, b: _Blob) -> bytes:
        """The prefix and header of one blob (the container writes them)."""
        header = self.fc.codec.blob_header(self.source.dtype, b.positions, b.mode, b.ns, b.nw)
        table = [SectionRecord(s["name"], s["tag"], s["raw_len"], s["crc"], tuple(s["lens"])) for s in b.sections]
        return frame_header(header, table)

    def _to_host(self, heads: list[bytes], stored: torch.Tensor, host_out: torch.Tensor | None, views: bool = False):
        """Device -> host, one copy per blob into its final place; stage timings."""
        total = sum(len(h) + b.stored_len for h, b in zip(heads, self.blobs))
        own = host_out is None
        host = self.fc.pinned_buf(total, "encode_views" if views else "encode") if own else host_out
        if host.numel() < total:
            raise InputError(f"host_out holds {host.numel()} bytes, the blobs need {total}")
        placed, off = [], 0
        for h, b in zip(heads, self.blobs):
            host[off : off + len(h)] = torch.frombuffer(bytearray(h), dtype=torch.uint8)
            a = off + len(h)
            if b.stored_len:
                host[a : a + b.stored_len].copy_(stored[b.stored_off : b.stored_off + b.stored_len], non_blocking=True)
            placed.append((off, len(h) + b.stored_len))
            off += len(h) + b.stored_len
        self.clock.mark("d2h")
        if self.dev.type == "cuda":
            torch.cuda.current_stream(self.dev).synchronize()
        st = self.clock.stages()
        timings = {f"encode_{k}_s": v for k, v in st.items() if k != "start"}
        timings["encode_total_s"] = sum(v for k, v in st.items() if k != "start")
        timings["encode_bf16_retry"] = float(self.bf16)
        self.fc.last_timings = timings
        if not own:
            return placed
        mv = host.numpy()
        if views:  # no copy: a fresh bytes object of a raw-size blob costs ~1 s of page faults per GB
            return [memoryview(mv[o : o + n]) for o, n in placed]
        return [mv[o : o + n].tobytes() for o, n in placed]
