"""Restore for the fused codec: many blobs in one job, streamed layer group by layer group, no host synchronisation.

:meth:`FusedCodec.open <dynamo_kvtc.codec.gpu.FusedCodec.open>` builds a :class:`RestoreJob`: headers parsed and
checked on the host (the reference checks), then the section bytes are queued host->device group by group (all
blobs' ``{g}.*`` sections for g = 0, 1, ...; pinned sources copy directly, others through a pinned bounce buffer) on
a copy stream, one CUDA event per group. :meth:`RestoreJob.layers` then, on the caller's stream:

1. waits for group 0's bytes (only those), computes their CRC-32s on the device, inflates group 0's chunks (one
   nvCOMP batch per tag) and dequantizes them into one fp16 coefficient matrix per K/V and DP plan — while later
   groups still copy;
2. per layer of group 0: projects back, adds the mean, re-applies RoPE and scatters the rows into the destination,
   then the sinks and window rows — every write through offsets that the verdict so far (a device boolean: every
   section of groups 0..g of every blob intact) turns to -1 (skipped) otherwise;
3. groups 1, 2, ... the same way (wait for its bytes, CRC, inflate, dequantize, project), so layer 0 waits only for
   group 0's bytes and work. Only verified bytes are ever written: if group g of some blob is corrupt, the layers of
   groups < g hold correct KV, groups >= g are untouched, and the job reports the failure (the caller recomputes).

Blobs already in device memory (``(cuda tensor, offset, length)``: a hand-off's receive buffer) are not copied through
the host: their headers come over in two small reads, their sections are gathered device to device into the staged
buffer, group by group on the caller's stream. An arriving :class:`~dynamo_kvtc.codec.blob.BlobView` is such a blob
(host or device) whose bytes are still landing: the job waits, on the host, for the byte ranges holding a group just
before that group's CRCs (its headers before parsing), so group 0 is decoded while later groups still move. The ranges a
peer declared are never trusted for more than when to wait: a group is read only after every range up to the one holding
its last byte has landed.

Nothing on that path reads a device value back: the host learns the verdict in :meth:`RestoreJob.finish`, which
synchronises and raises CorruptBlobError naming the blob and section. ``verify="eager"`` keeps the old contract
(every CRC checked, with one synchronisation, before the constructor returns). Without a destination (fresh
tensors handed to the caller) nothing can be gated on the device, so the verdict is read before the first yield.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...errors import CorruptBlobError, InputError
from ..blob import BlobView
from ..container import runs_to_positions
from ..entropy.base import CHUNK_BYTES, chunk_sizes
from ..model import DTYPES
from ..plan import iter_sections
from ..sinks import decode_sinks
from .clock import Clock
from .headers import header_view
from .ops import ALIGN, align, device_tensor
from .projection import layers_per_gemm

if TYPE_CHECKING:
    from .device import FusedDevice

VERIFY_MODES = ("device", "eager")


class RestoreJob:
    """One restore of many blobs (:meth:`FusedCodec.open`): owns the staged section bytes on the device, their
    CRC verdict (a device boolean) and the group-by-group decode of them. Construction validates every header on
    the host (DecodeError before anything is queued) and queues the host->device copies; with ``verify="eager"`` it
    also checks every section CRC (one synchronisation). :meth:`layers` decodes; :meth:`finish` waits, raises
    CorruptBlobError for a corrupt section and reports timings. It never writes outside the destination rows it is
    given, and never writes them at all unless every section of every blob passed its CRC."""

    gemm_bytes = 512 << 20  # scratch for one chunk's projection outputs (K and V of every plan): see _layers_per_gemm

    def __init__(self, fc: FusedDevice, blobs: Sequence[Any], verify: str = "device") -> None:
        if verify not in VERIFY_MODES:
            raise InputError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.fc, self.verify = fc, verify
        codec = fc.codec
        self.clock = Clock(fc.device)
        self.clock.mark("start")
        self.heads: list[dict[str, Any]] = []
        self.recs: list[list] = []
        srcs = [BlobView.of(b) for b in blobs]
        for src in srcs:
            h, recs = codec.check_blob(header_view(src))
            self.heads.append(h)
            self.recs.append(recs)
        self.tokens = [h["tokens"] for h in self.heads]
        self.bases, acc = [], 0
        for T in self.tokens:
            self.bases.append(acc)
            acc += T
        self.total_tokens = acc
        self.bad_blobs: list[int] = []  # after finish() (or an eager open): the blobs with a corrupt section
        self.timings: dict[str, float] = {}
        self._checks: list[Callable[[], None]] = []
        self._ok: torch.Tensor | None = None  # every section intact (device bool), once every CRC is queued
        self._crc_ok: list[torch.Tensor] = []
        self._crc_rows: list[dict[str, Any]] = []
        self._crc_done = 0
        self._layout()
        self._stage(srcs)
        if verify == "eager":
            self._crc_upto(len(fc.tables))
            self._raise_if_corrupt()

    # ------------------------------------------------------------------------------------------ staging
    def _layout(self) -> None:
        """Staged byte order: group 0's sections of every blob, then group 1's, ... (each blob's group sections are
        one contiguous range of the blob)."""
        G = len(self.fc.tables)
        self.rows: list[list[dict[str, Any]]] = [[] for _ in range(G)]  # per group: its sections, blob by blob
        self.sec: list[dict[str, dict[str, Any]]] = [{} for _ in self.recs]  # per blob: section name -> row
        self.pieces: list[list[tuple[int, int, int, int]]] = [[] for _ in range(G)]  # (blob, src, dst, n)
        total = 0
        for g in range(G):
            for bi, recs in enumerate(self.recs):
                mine = [r for r in recs if int(r.name.split(".", 1)[0]) == g]
                if not mine:
                    continue
                lo = min(r.offset for r in mine)
                hi = max(r.offset + r.stored_len for r in mine)
                self.pieces[g].append((bi, lo, total, hi - lo))
                for r in mine:
                    row = {"bi": bi, "rec": r, "staged_off": total + r.offset - lo}
                    self.rows[g].append(row)
                    self.sec[bi][r.name] = row
                total += hi - lo
        self.staged = torch.empty(max(total, 1), dtype=torch.uint8, device=self.fc.device)

    def _stage(self, srcs) -> None:
        """Queue the host->device copies group by group; ``self._copied[g]``: the event after group g's copies.
        Blobs in device memory and arriving blobs are staged later, group by group (:meth:`_stage_lazy`)."""
        dev = self.fc.device
        self._copied: list[Any] = []
        self._srcs = srcs
        self._lazy = {bi for bi, b in enumerate(srcs) if b.host_view() is None or b.arriving}
        eager = [[p for p in pieces if p[0] not in self._lazy] for pieces in self.pieces]
        if dev.type != "cuda":
            for pieces in eager:
                for bi, lo, dst, n in pieces:
                    mv = srcs[bi].host_view()
                    self.staged[dst : dst + n].numpy()[:] = np.frombuffer(mv[lo : lo + n], dtype=np.uint8)
            return
        if not any(eager):
            return
        pinned = [b.pinned for b in srcs]
        bounce_n = sum(n for pieces in eager for bi, _, _, n in pieces if not pinned[bi])
        # a fresh pinned buffer from torch's caching host allocator: it is reused only once these copies are done
        bounce = torch.empty(bounce_n, dtype=torch.uint8, pin_memory=True) if bounce_n else None
        main = torch.cuda.current_stream(dev)
        cs = torch.cuda.Stream(device=dev)
        cs.wait_stream(main)  # the staged buffer may reuse memory the caller's stream still reads
        self.staged.record_stream(cs)
        b0 = 0
        for pieces in eager:
            with torch.cuda.stream(cs):
                for bi, lo, dst, n in pieces:
                    if pinned[bi]:
                        src = srcs[bi].slice()[lo : lo + n]
                    else:
                        mv = srcs[bi].host_view()
                        bounce[b0 : b0 + n].numpy()[:] = np.frombuffer(mv[lo : lo + n], dtype=np.uint8)
                        src, b0 = bounce[b0 : b0 + n], b0 + n
                    self.staged[dst : dst + n].copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(cs)
            self._copied.append(ev)

    def _stage_lazy(self, g: int) -> None:
        """Stage group g's sections of the blobs in device memory (one device-to-device copy per blob, on the
        caller's stream) and of arriving blobs (after the ranges holding them landed). After the last group every
        arriving blob is marked read out."""
        if not self._lazy:
            return
        for bi, lo, dst, n in self.pieces[g]:
            if bi not in self._lazy:
                continue
            b = self._srcs[bi]
            b.wait_for(lo + n)
            t, out = b.slice(), self.staged[dst : dst + n]  # lazy blobs are tensor views (device or arriving)
            if t.is_cuda:  # the buffer's memory must outlive this stream's reads even if its owner drops it
                t.record_stream(torch.cuda.current_stream(t.device))
            if not t.is_cuda and not out.is_cuda:
                out.numpy()[:] = t[lo : lo + n].numpy()
            else:
                # asynchronous only device to device or from pinned memory: a copy to the host must have landed
                fast = out.is_cuda and (t.is_cuda or b.pinned)
                out.copy_(t[lo : lo + n], non_blocking=fast)
        if g == len(self.pieces) - 1:
            ev = None
            if self.fc.device.type == "cuda":
                ev = torch.cuda.Event()
                ev.record()
            for b in self._srcs:
                b.consumed(ev)

    def _crc_upto(self, groups: int) -> None:
        """Queue (on the caller's stream) the CRC check of every section of groups < ``groups`` not yet checked."""
        a = self._crc_done
        if groups <= a:
            return
        if self._copied:
            main = torch.cuda.current_stream(self.fc.device)
            for ev in self._copied[a:groups]:
                main.wait_event(ev)
        for g in range(a, groups):
            self._stage_lazy(g)
        self.clock.mark("h2d")
        rows = [row for g in range(a, groups) for row in self.rows[g]]
        recs = [row["rec"] for row in rows]
        ok = self.fc.run_stage(
            "crc_check",
            self.staged,
            [row["staged_off"] for row in rows],
            [r.stored_len for r in recs],
            [r.crc for r in recs],
        )
        self._crc_ok.append(ok)
        self._crc_rows.extend(rows)
        self._crc_done = groups
        if groups == len(self.fc.tables):
            self._ok = torch.cat(self._crc_ok).all()
        self.clock.mark("crc")

    def _raise_if_corrupt(self) -> None:
        """Read the CRC verdicts back (synchronises up to the CRC kernels) and raise for the first corrupt section."""
        self._crc_upto(len(self.fc.tables))
        ok = torch.cat(self._crc_ok).cpu().tolist() if self._crc_ok else []
        bad = [row for row, good in zip(self._crc_rows, ok) if not good]
        self.bad_blobs = sorted({row["bi"] for row in bad})
        if bad:
            row = min(bad, key=lambda r: (r["bi"], r["rec"].offset))
            raise CorruptBlobError(f"blob {row['bi']} section {row['rec'].name!r} checksum mismatch (corrupted bytes)")

    # ------------------------------------------------------------------------------------------ decode
    def _inflate(self, g: int) -> torch.Tensor:
        """Group g's sections, realigned and inflated (one nvCOMP batch per tag) into 16 B aligned raw sections of
        a new buffer (returned); each row gets its ``raw_off``."""
        fc, dev = self.fc, self.fc.device
        raw_len = 0
        for row in self.rows[g]:
            row["raw_off"] = raw_len
            raw_len = align(raw_len + row["rec"].raw_len)
        raw = torch.zeros(max(raw_len, ALIGN), dtype=torch.uint8, device=dev)
        store_cp: list[tuple[int, int, int]] = []
        comp: dict[str, list[tuple[int, int, int, int]]] = {}  # tag -> (staged_off, stored_len, raw_off, raw_len)
        for row in self.rows[g]:
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
            fc.run_stage("copy_chunks", self.staged, raw, *zip(*store_cp))
        for tag, items in comp.items():
            if not fc.entropy.usable(tag):
                raise CorruptBlobError(f"entropy codec {tag!r} cannot be decoded here")
            aligned_offs, total = [], 0
            for _, n, _, _ in items:
                aligned_offs.append(total)
                total = align(total + n)
            aligned = torch.empty(max(total, ALIGN), dtype=torch.uint8, device=dev)
            sizes = [i[1] for i in items]
            fc.run_stage("copy_chunks", self.staged, aligned, [i[0] for i in items], aligned_offs, sizes)
            self._checks.append(
                fc.entropy.decode(tag, aligned, aligned_offs, sizes, raw, [i[2] for i in items], [i[3] for i in items])
            )
        self.clock.mark("entropy")
        return raw

    def _plan_rows(self) -> None:
        """Coded rows: per DP plan (ratio), the concatenation of its blobs' coded tokens (one GEMM per plan)."""
        self.rgroups: list[dict[str, Any]] = []
        by_ratio: dict[float, list[int]] = {}
        for bi, h in enumerate(self.heads):
            if h["mode"] == "kvtc" and h["tokens"] - h["sinks"] - h["window"]:
                by_ratio.setdefault(float(h["ratio"]), []).append(bi)
        for ratio, members in sorted(by_ratio.items()):
            rows0, R, pos = {}, 0, []
            for bi in members:
                h = self.heads[bi]
                nc = h["tokens"] - h["sinks"] - h["window"]
                rows0[bi] = R
                R += nc
                pos.append(_positions(h["positions"], self.fc.device)[h["sinks"] : h["sinks"] + nc])
            pos_t = torch.cat(pos)
            self.rgroups.append({"ratio": ratio, "blobs": members, "rows0": rows0, "R": R, "pos": pos_t, "rope": {}})

    def _dequant(self, g: int, raw: torch.Tensor) -> None:
        """Group g's coefficient matrices (``rg["coeffs"][kind]``) and its sinks/window rows (``self.extra``)."""
        fc, dev = self.fc, self.fc.device
        H, D = fc.fp.num_kv_heads, fc.fp.head_dim
        tab = fc.tables[g]
        for rg in self.rgroups:
            ratio, out = rg["ratio"], {}
            for kind in ("k", "v"):
                plan = (tab.k_plans if kind == "k" else tab.v_plans)[ratio]
                Dm = torch.zeros(rg["R"], plan.rank, dtype=torch.float16, device=dev)
                for bi in rg["blobs"]:
                    h = self.heads[bi]
                    nc = h["tokens"] - h["sinks"] - h["window"]
                    base0 = self.sec[bi][f"{g}.{kind}"]["raw_off"]
                    view = Dm[rg["rows0"][bi] : rg["rows0"][bi] + nc]
                    for bki, (bk, boff, nb) in enumerate(iter_sections(plan, nc)):
                        n = len(bk.starts)
                        base = base0 + boff
                        shift = raw[base : base + 2 * n * nc].view(torch.float16)
                        scale = raw[base + 2 * n * nc : base + 4 * n * nc].view(torch.float16)
                        codes = raw[base + 4 * n * nc : base + nb]
                        starts = tab.starts(kind, ratio, bki, bk)
                        fc.run_stage("dequant", codes, shift, scale, bk.kind, bk.size, starts, view, nc)
                out[kind] = Dm
            rg["coeffs"] = out
        # sinks (fp8 -> float) and window rows of every blob: [Lg, n_extra, H, D] in each blob's dtype
        Lg = tab.layers[1] - tab.layers[0]
        ks, vs = [], []
        for bi, h in enumerate(self.heads):
            dtype = DTYPES[h["dtype"]]
            ns, nw = h["sinks"], h["window"]
            if ns:
                row = self.sec[bi][f"{g}.sinks"]
                sk, sv = decode_sinks(raw[row["raw_off"] : row["raw_off"] + row["rec"].raw_len], Lg, ns, H, D)
                ks.append(sk.to(dtype))
                vs.append(sv.to(dtype))
            if nw:
                a = self.sec[bi][f"{g}.window"]["raw_off"]
                half = Lg * nw * H * D * dtype.itemsize
                ks.append(raw[a : a + half].view(dtype).view(Lg, nw, H, D))
                vs.append(raw[a + half : a + 2 * half].view(dtype).view(Lg, nw, H, D))
        self.extra = (ks, vs)
        self.clock.mark("dequantize")

    # ------------------------------------------------------------------------------------------ layers
    def _offsets(self, dest, targets, keep) -> list[torch.Tensor]:
        """Per blob, one element offset per token into the destination (-1: not written)."""
        dev = self.fc.device
        if dest is None:
            HD = self.fc.fp.num_kv_heads * self.fc.fp.head_dim
            return [torch.arange(b, b + T, dtype=torch.int64, device=dev) * HD for b, T in zip(self.bases, self.tokens)]
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
        return offs

    def _gate(self, offs: list[torch.Tensor]) -> None:
        """Route the next group's writes through the CRC verdict so far (device mode: offsets become -1 unless every
        section checked up to now — this group's and the earlier ones' — is intact) and build the per-plan and
        sinks/window offset vectors."""
        if self.verify == "device":
            ok = torch.cat(self._crc_ok).all() if len(self._crc_ok) > 1 else self._crc_ok[0].all()
            offs = [torch.where(ok, o, -1) for o in offs]
        for rg in self.rgroups:
            ns = [self.heads[bi]["sinks"] for bi in rg["blobs"]]
            rg["doff"] = torch.cat([offs[bi][a : a + n] for (bi, n), a in zip(_ncs(self, rg), ns)])
        parts = []
        for bi, h in enumerate(self.heads):
            T, ns, nw = h["tokens"], h["sinks"], h["window"]
            if ns:
                parts.append(offs[bi][:ns])
            if nw:
                parts.append(offs[bi][T - nw :])
        self.extra_off = torch.cat(parts) if parts else None

    def layers(self, dest=None, targets: Sequence[tuple[int, int]] | None = None, keep=None) -> Iterator:
        """Decode layer by layer, group by group. With ``dest`` (:class:`DenseKV` / :class:`PagedBlocks`), blob i is
        written to tokens ``targets[i] = (seq, start)`` onwards (``keep[i] = (a, b)``: only its tokens a..b-1) and
        ``layer`` is yielded once its writes are queued (sync-free; nothing is written if a section is corrupt, and
        :meth:`finish` raises); without, yields ``(layer, k, v)`` with fresh ``[total_tokens, H, D]`` tensors (blob
        i at rows ``bases[i]``...; the CRC verdict is read, and CorruptBlobError raised, before the first yield).
        Call :meth:`finish` afterwards."""
        fc = self.fc
        out_dtype = None
        if dest is None:
            dtypes = {DTYPES[h["dtype"]] for h in self.heads}
            if len(dtypes) != 1:
                raise InputError("blobs of different dtypes need a destination")
            out_dtype = dtypes.pop()
        offs = self._offsets(dest, targets, keep)
        self._plan_rows()
        if dest is None and self.verify == "device":
            self._raise_if_corrupt()  # tensors handed out cannot be gated: read the verdict first
        for g in range(len(fc.tables)):
            self._crc_upto(g + 1)  # group g's bytes landed and checked; later groups still copying
            raw = self._inflate(g)
            self._dequant(g, raw)
            self._gate(offs)  # the writes of group g need every section of groups 0..g intact
            yield from self._project(g, dest, out_dtype)
            del raw
        self.extra = ([], [])
        for rg in self.rgroups:
            rg.pop("coeffs", None)

    def _layers_per_gemm(self, n_layers: int, HD: int) -> int:
        """Layers of a group per projection GEMM under :attr:`gemm_bytes` (:func:`.projection.layers_per_gemm`)."""
        rows = sum(rg["R"] for rg in self.rgroups) * HD
        return layers_per_gemm(n_layers, rows, getattr(self.fc.projector, "out_dtype", None), self.gemm_bytes)

    def _project(self, g: int, dest, out_dtype) -> Iterator:
        fc, dev = self.fc, self.fc.device
        H, D = fc.fp.num_kv_heads, fc.fp.head_dim
        HD = H * D
        sh, sd = (D, 1) if dest is None else (dest.stride_h, dest.stride_d)
        tab = fc.tables[g]
        l0, l1 = tab.layers
        ks, vs = self.extra
        kx, vx = (_rows(ks), _rows(vs)) if ks else (None, None)  # sinks + window rows: [Lg, n, H, D], once a group
        per = self._layers_per_gemm(l1 - l0, HD)
        ys: dict[tuple[int, str], torch.Tensor] = {}
        c0 = 0
        for layer in range(l0, l1):
            i = layer - l0
            if i % per == 0:  # the next chunk of layers: one GEMM per plan and kind covers all of them
                c0, c1 = i, min(l1 - l0, i + per)
                ys = {
                    (ri, kind): fc.projector.restore(rg["coeffs"][kind], tab, kind, slice(c0 * HD, c1 * HD))
                    for ri, rg in enumerate(self.rgroups)
                    for kind in ("k", "v")
                }
            if dest is None:
                kbuf = torch.empty(self.total_tokens, H, D, dtype=out_dtype, device=dev)
                vbuf = torch.empty_like(kbuf)
                kdst, vdst = kbuf, vbuf
            else:
                kdst, vdst = dest.layer(layer)
            cols = slice(i * HD, (i + 1) * HD)
            ycols = slice((i - c0) * HD, (i - c0 + 1) * HD)
            for ri, rg in enumerate(self.rgroups):
                for kind, dst in (("k", kdst), ("v", vdst)):
                    mean = (tab.k_mean if kind == "k" else tab.v_mean)[cols]
                    Y = ys[(ri, kind)][:, ycols]
                    rope = None
                    if kind == "k" and fc.codec.rope_removed:
                        rope = fc.rope(rg["rope"], layer, rg["pos"], inverse=False)
                    fc.run_stage("post", Y, rg["doff"], dst, mean, rope, H, D, sh, sd)
            if kx is not None:
                fc.run_stage("scatter", kx[i], self.extra_off, kdst, H, D, sh, sd)
                fc.run_stage("scatter", vx[i], self.extra_off, vdst, H, D, sh, sd)
            self.clock.mark(f"layer{layer}")
            yield (layer, kbuf, vbuf) if dest is None else layer
        ys.clear()

    def finish(self) -> dict[str, float]:
        """Wait for the stream; raise CorruptBlobError (blob and section named, ``bad_blobs`` set) if a section
        failed its CRC — then nothing was written — and run the deferred nvCOMP size checks; return stage timings
        (seconds)."""
        self._crc_upto(len(self.fc.tables))
        if self.fc.device.type == "cuda":
            torch.cuda.current_stream(self.fc.device).synchronize()
        self._raise_if_corrupt()
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


def _positions(runs: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """A blob's token positions (``(start, length)`` runs) as an int64 tensor built on ``device``; a blob of many
    short runs goes through one pinned host list instead of one ``arange`` per run."""
    if len(runs) > 8:
        return device_tensor(runs_to_positions(runs), torch.int64, device)
    parts = [torch.arange(a, a + n, dtype=torch.int64, device=device) for a, n in runs]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)


def _ncs(job: RestoreJob, rg: dict) -> list[tuple[int, int]]:
    return [(bi, job.heads[bi]["tokens"] - job.heads[bi]["sinks"] - job.heads[bi]["window"]) for bi in rg["blobs"]]


def _rows(parts: list) -> torch.Tensor:
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
