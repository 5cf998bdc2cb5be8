"""Restore for the fused codec: many blobs in one job, checked before anything is decoded, then layer by layer.

:meth:`FusedCodec.open <dynamo_kvtc.codec.gpu.FusedCodec.open>` builds a :class:`RestoreJob`: headers parsed and
checked on the host (the reference checks), section bytes copied host->device (pinned sources asynchronously), every
section's CRC-32 computed on the device and compared. :meth:`RestoreJob.layers` then inflates every chunk (one nvCOMP
batch per tag), dequantizes into one fp16 coefficient matrix per K/V and layer group, and per layer projects back,
adds the mean, re-applies RoPE and scatters the rows into the destination; sinks and window rows follow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...errors import CorruptBlobError, InputError
from ..container import runs_to_positions
from ..model import DTYPES
from ..plan import iter_sections
from ..sinks import decode_sinks
from ..tags import CHUNK_BYTES, chunk_sizes
from .clock import Clock
from .layouts import scatter_rows
from .ops import ALIGN, align

if TYPE_CHECKING:
    from .fused import FusedCodec


class RestoreJob:
    """One restore of many blobs (:meth:`FusedCodec.open`): owns the staged section bytes on the device and the
    decode of them. Construction validates every blob (structure, calibration, every section CRC) and raises
    DecodeError before anything is decoded; :meth:`layers` decodes, :meth:`finish` waits and reports timings. It never
    writes outside the destination rows it is given."""

    def __init__(self, fc: FusedCodec, blobs: Sequence[Any]) -> None:
        self.fc = fc
        codec = fc.codec
        dev = fc.device
        self.clock = Clock(dev)
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
            h, recs = codec.check_blob(mv)
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
        with fc.restore_lock:  # the pinned staging buffer is reused: held until the CRC step has synchronised
            self._stage_and_check(srcs, spans, total)
        self._checks: list[Callable[[], None]] = []
        self.timings: dict[str, float] = {}

    def _stage_and_check(self, srcs, spans, total) -> None:
        fc, dev = self.fc, self.fc.device
        stage = None
        if dev.type == "cuda" and any(t is None or not t.is_pinned() for t, *_ in srcs):
            stage = fc.pinned_buf(total, "restore")
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
        got = fc.run_stage("crc", self.staged, offs, lens)
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
                raw_len = align(raw_len + row["rec"].raw_len)
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
            fc.run_stage("copy_chunks", self.staged, self.raw, *zip(*store_cp))
        for tag, items in comp.items():
            if not fc.entropy.usable(tag):
                raise CorruptBlobError(f"entropy codec {tag!r} cannot be decoded here")
            aligned_offs, total = [], 0
            for _, n, _, _ in items:
                aligned_offs.append(total)
                total = align(total + n)
            aligned = torch.empty(max(total, ALIGN), dtype=torch.uint8, device=dev)
            fc.run_stage(
                "copy_chunks", self.staged, aligned, [i[0] for i in items], aligned_offs, [i[1] for i in items]
            )
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
                            fc.run_stage("dequant", codes, shift, scale, bk.kind, bk.size, starts, view, nc)
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
                    sk, sv = decode_sinks(buf, Lg, ns, H, D)
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
                        mean = (tab.k_mean if kind == "k" else tab.v_mean)[cols]
                        Y = fc.projector.restore(rg["coeffs"][gi][kind], tab, kind, cols)
                        rope = None
                        if kind == "k" and fc.codec.rope_removed:
                            rope = fc.rope(rg["rope"], layer, rg["pos"], inverse=False)
                        fc.run_stage("post", Y, rg["doff"], dst, mean, rope, H, D, sh, sd)
                if toks:
                    i = layer - l0
                    scatter_rows(kdst, extra_off, torch.cat([k[i] for k in ks]), H, D, sh, sd)
                    scatter_rows(vdst, extra_off, torch.cat([v[i] for v in vs]), H, D, sh, sd)
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


def _ncs(job: RestoreJob, rg: dict) -> list[tuple[int, int]]:
    return [(bi, job.heads[bi]["tokens"] - job.heads[bi]["sinks"] - job.heads[bi]["window"]) for bi in rg["blobs"]]
