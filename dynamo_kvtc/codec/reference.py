"""The reference codec: encode a span of KV cache into one blob and decode it back, layer by layer (float32).

Token segments of a span (positions strictly increasing):

- **sinks**: tokens at absolute positions ``< sinks`` (default 4), kept in fp8 E4M3 with one fp16 scale per
  (layer, token, head) vector;
- **coded**: the tokens between, transform-coded: RoPE removed (keys), mean subtracted, projected on the
  calibration's basis, group-quantized by the DP plan, entropy coded;
- **window**: the last ``window`` tokens (default 128), kept raw in the input dtype.

A span with fewer than ``min_tokens`` coded tokens is stored raw (mode ``"raw"``): short conversations gain nothing.
Each layer group contributes four sections (sinks, k, v, window), so group 0 decodes before later groups' bytes
are needed.

**Per-layer token sets.** A calibration may group layers by attention type (``layer_order``: the groups are ranges over
a permutation of the layers) and give a group a token set (``BasisGroup.tokens``: a span's last ``tokens`` tokens, what
a sliding-window layer keeps). Such a group encodes only those tokens (sinks and window clipped to them); the blob
header records each group's token range. :meth:`ReferenceCodec.decode_layers` then yields each layer's tokens only (the
suffix of the span its group keeps), always in layer order; :meth:`ReferenceCodec.decode_ragged` returns per-layer
tensors and :meth:`ReferenceCodec.layer_ranges` says which tokens each layer holds. The fused GPU path does not take
such calibrations: a codec holding one stays on the reference path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import (
    ConfigError,
    DecodeError,
    InputError,
)
from .base import Codec
from .checks import check_blob, check_inputs
from .container import (
    BlobHeader,
    check_section,
    group_segments,
    positions_to_runs,
    runs_to_positions,
    section_chunks,
    write_blob,
)
from .entropy.registry import PORTABLE, coder
from .entropy.sections import EntropyCoder
from .fp8 import fake_e4m3
from .model import DTYPES, BasisGroup, CalibrationLike, dtype_name, group_layer_ids
from .options import PROJECTIONS
from .plan import decode_coefficients, encode_coefficients
from .rope import RotaryConfig, rotate
from .sinks import decode_sinks, encode_sinks
from .stats import blob_stats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CodecConfig:
    """Run-time knobs of a :class:`KvtcCodec` (the calibration fixes everything else)."""

    ratio: float = 16
    sinks: int = 4
    window: int = 128
    min_tokens: int = 16
    tag: str = PORTABLE
    projection: str = "auto"  # precision of the projection GEMMs: auto | fp16 | fp8 (the blob format is the same)

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ConfigError(f"sinks must be >= 0, got {self.sinks}")
        if self.window < 0:
            raise ConfigError(f"window must be >= 0, got {self.window}")
        if self.min_tokens < 1:
            raise ConfigError(f"min_tokens must be >= 1, got {self.min_tokens}")
        coder(self.tag, ConfigError)  # a registered entropy codec, or ConfigError naming the known ones
        if self.projection not in PROJECTIONS:
            raise ConfigError(f"unknown projection {self.projection!r}; choose one of {PROJECTIONS}")

    def segments(self, positions: torch.Tensor, window: int | None = None) -> tuple[str, int, int, int]:
        """``(mode, sinks, window, coded)`` token counts of a span at ``positions`` (CPU int64, validated);
        ``window`` overrides the configured raw window for this span. Both writers split spans with this."""
        if window is not None and window < 0:
            raise InputError(f"window must be >= 0, got {window}")
        T = positions.numel()
        ns = int((positions < self.sinks).sum())
        nw = min(self.window if window is None else window, T - ns)
        nc = T - ns - nw
        if nc < self.min_tokens:
            return "raw", 0, T, 0
        return "kvtc", ns, nw, nc


class Tables:
    """Per-group device tensors (float32) used by encode and decode."""

    def __init__(self, g: BasisGroup, device: torch.device, order: tuple[int, ...] | None = None) -> None:
        self.layers = g.layers
        self.ids = group_layer_ids(order, g.layers)  # the model layers of this group, in row order
        contiguous = self.ids == list(range(self.ids[0], self.ids[-1] + 1))
        self.sel: slice | list[int] = slice(self.ids[0], self.ids[-1] + 1) if contiguous else self.ids
        self.tokens = g.tokens  # token set: a span's last `tokens` tokens (0: all)
        self.k_mean = g.k_mean.to(device, torch.float32)
        self.k_basis = g.k_basis.to(device, torch.float32)
        self.v_mean = g.v_mean.to(device, torch.float32)
        self.v_basis = g.v_basis.to(device, torch.float32)
        self.k_plans = g.k_plans
        self.v_plans = g.v_plans


class ReferenceCodec(Codec):
    """Encode/decode KV spans with one calibration: the float32 reference math, the definition of the format.

    ``ratio`` picks the DP plan used by :meth:`encode`; :meth:`decode` reads any plan of the same calibration.
    ``device`` is where the tensor math runs ("cpu" or "cuda[:n]"). ``tag`` selects the entropy codec.
    ``projection`` (``auto``/``fp16``/``fp8``) is the precision of the projection GEMMs on the fused path; here the
    math stays float32 for ``auto``/``fp16`` and, for ``fp8``, emulates the FP8 GEMM's rounding (same scales,
    operands rounded to e4m3, fp32 matmul) so its accuracy can be measured on the CPU.

    Owns its per-group float32 tables and entropy coders; never reads the environment, never falls back to anything.
    """

    def __init__(
        self,
        calibration: CalibrationLike,
        ratio: float = 16,
        device: str | torch.device = "cpu",
        *,
        sinks: int = 4,
        window: int = 128,
        min_tokens: int = 16,
        tag: str = PORTABLE,
        profile: bool = False,
        projection: str = "auto",
    ) -> None:
        self.cal = calibration
        self.profile = profile
        self.config = CodecConfig(float(ratio), sinks, window, min_tokens, tag, projection)
        if float(ratio) not in [float(r) for r in calibration.ratios]:
            raise ConfigError(
                f"ratio {ratio} has no DP plan in calibration {calibration.id[:12]}; available: "
                f"{', '.join(f'{r:g}' for r in calibration.ratios)}"
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but CUDA is not available")
        self.fp = calibration.fingerprint
        self.rope_removed = bool(getattr(calibration, "rope_removed", True))
        self.order = getattr(calibration, "layer_order", None)
        self.tables = [Tables(g, self.device, self.order) for g in calibration.groups]
        self.token_sets = self.order is not None or any(t.tokens for t in self.tables)
        self._coders: dict[str, EntropyCoder] = {}
        self.last_timings: dict[str, float] = {}

    def blob_header(
        self, dtype: torch.dtype, positions: torch.Tensor, mode: str, sinks: int, window: int
    ) -> BlobHeader:
        """The header of a blob of this codec's calibration (both writers build their headers here)."""
        fp = self.fp
        return BlobHeader(
            cal=self.cal.id,
            layers=fp.num_layers,
            heads=fp.num_kv_heads,
            head_dim=fp.head_dim,
            dtype=dtype_name(dtype),
            tokens=positions.numel(),
            positions=positions_to_runs(positions.tolist()),
            mode=mode,
            ratio=self.config.ratio if mode == "kvtc" else None,
            sinks=sinks,
            window=window,
            groups=[list(t.layers) for t in self.tables],
            order=None if self.order is None else list(self.order),
            token_sets=self.token_ranges(positions.numel()) if self.token_sets else None,
            kv=getattr(self, "kv_source", None),
        )

    def token_ranges(self, tokens: int) -> list[list[int]]:
        """``[start, stop]`` token-index range each layer group encodes of a span of ``tokens`` tokens."""
        return [[max(0, tokens - t.tokens) if t.tokens else 0, tokens] for t in self.tables]

    @property
    def ratio(self) -> float:
        return self.config.ratio

    def _now(self) -> float:
        """Wall clock for stage timings; waits for queued GPU work when ``profile`` is set."""
        if self.profile and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _coder(self, tag: str) -> EntropyCoder:
        if tag not in self._coders:
            self._coders[tag] = EntropyCoder(tag, self.device)
        return self._coders[tag]

    # ================================================================== encode
    def encode(self, keys: torch.Tensor, values: torch.Tensor, positions: Any, *, window: int | None = None) -> bytes:
        """Encode ``keys``/``values`` ``[L, T, H, D]`` (keys post-RoPE) at absolute ``positions`` ``[T]``.

        ``window`` overrides the configured number of trailing tokens kept raw for this span (a storage tier keeps
        the raw window only on a sequence's last span).
        """
        t_start = self._now()
        keys, values, pos = check_inputs(self.fp, keys, values, positions)
        L, T, H, D = keys.shape
        cfg = self.config
        mode, ns, nw, nc = cfg.segments(pos, window)
        dev = self.device
        tim = {"project": 0.0, "quantize": 0.0, "entropy": 0.0}
        sections: list[tuple[str, str, int, list[bytes]]] = []
        header = self.blob_header(keys.dtype, pos, mode, ns, nw)
        hd = header.to_dict()
        rope_caches: dict[int, dict[RotaryConfig, tuple[torch.Tensor, torch.Tensor]]] = {}
        for gi, tab in enumerate(self.tables):
            a, ns, nc, nw = group_segments(hd, gi)  # this group's token range and segments (the span's, by default)
            c0 = a + ns
            pos_c = pos[c0 : c0 + nc].to(dev)
            rope_cache = rope_caches.setdefault(c0, {})
            gk, gv = keys[tab.sel], values[tab.sel]
            raw_parts: dict[str, tuple[str, torch.Tensor]] = {}
            # sinks: fp8 per (layer, token, head) vector
            if ns:
                t0 = self._now()
                raw_parts["sinks"] = ("store", encode_sinks(gk[:, a:c0].to(dev), gv[:, a:c0].to(dev)).cpu())
                tim["quantize"] += self._now() - t0
            else:
                raw_parts["sinks"] = ("store", torch.empty(0, dtype=torch.uint8))
            for kind, x, mean, basis, plans in (
                ("k", gk, tab.k_mean, tab.k_basis, tab.k_plans),
                ("v", gv, tab.v_mean, tab.v_basis, tab.v_plans),
            ):
                if not nc:
                    raw_parts[kind] = (cfg.tag, torch.empty(0, dtype=torch.uint8))
                    continue
                plan = plans[cfg.ratio]
                t0 = self._now()
                xs = x[:, c0 : c0 + nc].to(dev, torch.float32)
                if kind == "k" and self.rope_removed:
                    xs = self._rope(xs, pos_c, tab.ids, rope_cache, inverse=True)
                rows = xs.permute(1, 0, 2, 3).reshape(nc, -1)
                coeffs = self._ref_mm(rows - mean, basis[:, : plan.rank])
                t1 = self._now()
                payload = encode_coefficients(coeffs, plan)
                t2 = self._now()
                tim["project"] += t1 - t0
                tim["quantize"] += t2 - t1
                raw_parts[kind] = (cfg.tag, payload)
            if nw:
                w0 = c0 + nc
                win = torch.cat((_bytes_of(gk[:, w0 : w0 + nw]), _bytes_of(gv[:, w0 : w0 + nw])))
            else:
                win = torch.empty(0, dtype=torch.uint8)
            raw_parts["window"] = ("store", win)
            t0 = self._now()
            for part in ("sinks", "k", "v", "window"):
                tag, data = raw_parts[part]
                sections.append((f"{gi}.{part}", tag, data.numel(), self._coder(tag).compress(data)))
            tim["entropy"] += self._now() - t0
        blob = write_blob(header, sections)
        tim["total"] = self._now() - t_start
        self.last_timings.update({f"encode_{k}_s": v for k, v in tim.items()})
        return blob

    def _rope(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        ids: list[int],
        cache: dict[RotaryConfig, tuple[torch.Tensor, torch.Tensor]],
        inverse: bool,
    ) -> torch.Tensor:
        """(Un)rotate ``x [Lg, T, H, D]`` layer by layer (model layers ``ids``) with each layer's rotary config."""
        out = torch.empty_like(x)
        for i in range(x.shape[0]):
            out[i] = self._rope_layer(x[i], pos, ids[i], cache, inverse)
        return out

    def _rope_layer(self, x, pos, layer, cache, inverse):
        cfg = self.fp.rotary[layer]
        if cfg not in cache:
            cache[cfg] = cfg.cos_sin(pos, device=x.device)
        cos, sin = cache[cfg]
        return rotate(x, cos, sin, cfg, inverse=inverse)

    def _ref_operand(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """A GEMM operand of the reference path: ``x`` itself (float32), or with ``projection="fp8"`` ``x`` rounded
        through e4m3 with one scale per slice along ``dim``, as the fused path's FP8 GEMM sees it."""
        if self.config.projection != "fp8":
            return x
        return fake_e4m3(x, dim)

    def _ref_mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` on the reference path (per-row scales for ``a``, per-column for ``b`` when emulating fp8)."""
        return self._ref_operand(a, 1) @ self._ref_operand(b, 0)

    # ================================================================== decode
    def check_blob(self, blob: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list]:
        """Parse ``blob`` and check it fits this codec (:func:`~dynamo_kvtc.codec.checks.check_blob`): the header
        dict and section records (section CRCs are not checked here); DecodeError otherwise."""
        return check_blob(self, blob)

    def stats(self, blob: bytes | bytearray | memoryview) -> dict[str, Any]:
        """Sizes, ratios (paper accounting and others), plan summary and the last encode/decode timings."""
        return blob_stats(self, blob)

    def decode_layers(self, blob: bytes | bytearray | memoryview) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(layer, keys [T, H, D], values [T, H, D])`` in layer order as each becomes ready.

        The whole blob is validated (structure and every section checksum) before the first layer is produced.
        """
        h, recs = self.check_blob(blob)
        for r in recs:
            check_section(blob, r)  # checksums up front: never yield layers of a corrupt blob
        layers = self._layers(blob, h, recs)
        return layers if self.order is None else _in_layer_order(layers)

    def _layers(self, blob, h, recs) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        H, D = h["heads"], h["head_dim"]
        dtype = DTYPES[h["dtype"]]
        dev = self.device
        pos = torch.tensor(runs_to_positions(h["positions"]), dtype=torch.int64)
        ratio = float(h["ratio"]) if h["ratio"] is not None else None
        tim = {"entropy": 0.0, "quantize": 0.0, "project": 0.0}
        by_name = {r.name: r for r in recs}
        rope_caches: dict[int, dict] = {}
        t_start = self._now()
        for gi, tab in enumerate(self.tables):
            a, ns, nc, nw = group_segments(h, gi)  # the group's token range [a, a + T) and its segments
            T = ns + nc + nw
            pos_c = pos[a + ns : a + ns + nc].to(dev)
            rope_cache = rope_caches.setdefault(a + ns, {})
            Lg = len(tab.ids)
            t0 = self._now()
            raw = {}
            for part in ("sinks", "k", "v", "window"):
                r = by_name[f"{gi}.{part}"]
                raw[part] = self._coder(r.tag).decompress(section_chunks(blob, r, verify=False), r.raw_len)
            t1 = self._now()
            sink_k = sink_v = None
            if ns:
                sink_k, sink_v = decode_sinks(raw["sinks"].to(dev), Lg, ns, H, D)
            coeffs = {}
            if nc:
                coeffs["k"] = self._ref_operand(decode_coefficients(raw["k"].to(dev), tab.k_plans[ratio], nc), 1)
                coeffs["v"] = self._ref_operand(decode_coefficients(raw["v"].to(dev), tab.v_plans[ratio], nc), 1)
            win_k = win_v = None
            if nw:
                w = raw["window"].to(dev)
                half = w.numel() // 2
                win_k = w[:half].view(dtype).view(Lg, nw, H, D)
                win_v = w[half:].view(dtype).view(Lg, nw, H, D)
            t2 = self._now()
            tim["entropy"] += t1 - t0
            tim["quantize"] += t2 - t1
            for i in range(Lg):
                t3 = self._now()
                k_out = torch.empty(T, H, D, dtype=dtype, device=dev)
                v_out = torch.empty(T, H, D, dtype=dtype, device=dev)
                if ns:
                    k_out[:ns] = sink_k[i]
                    v_out[:ns] = sink_v[i]
                if nc:
                    cols = slice(i * H * D, (i + 1) * H * D)
                    for kind, out, mean, basis, plan in (
                        ("k", k_out, tab.k_mean, tab.k_basis, tab.k_plans[ratio]),
                        ("v", v_out, tab.v_mean, tab.v_basis, tab.v_plans[ratio]),
                    ):
                        x = coeffs[kind] @ self._ref_operand(basis[cols, : plan.rank], 1).t() + mean[cols]
                        x = x.view(nc, H, D)
                        if kind == "k" and self.rope_removed:
                            x = self._rope_layer(x, pos_c, tab.ids[i], rope_cache, inverse=False)
                        out[ns : ns + nc] = x
                if nw:
                    k_out[T - nw :] = win_k[i]
                    v_out[T - nw :] = win_v[i]
                tim["project"] += self._now() - t3
                yield tab.ids[i], k_out, v_out
        tim["total"] = self._now() - t_start
        self.last_timings.update({f"decode_{k}_s": v for k, v in tim.items()})

    def decode(self, blob: bytes | bytearray | memoryview) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a blob into ``(keys, values)`` ``[L, T, H, D]`` in the encoded dtype, RoPE re-applied.

        A blob whose layers hold different token sets has no such tensor: use :meth:`decode_ragged` (InputError)."""
        ks, vs = [], []
        for _, k, v in self.decode_layers(blob):
            ks.append(k)
            vs.append(v)
        if any(k.shape[0] != ks[0].shape[0] for k in ks):
            raise InputError("blob holds per-layer token sets; decode it with decode_ragged")
        return torch.stack(ks), torch.stack(vs)

    def decode_ragged(self, blob: bytes | bytearray | memoryview) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(keys, values)`` ``[T_l, H, D]`` per layer, in layer order: each layer's own token set (the tokens
        :meth:`layer_ranges` names), for blobs with and without per-layer token sets."""
        return [(k, v) for _, k, v in self.decode_layers(blob)]

    def layer_ranges(self, blob: bytes | bytearray | memoryview) -> list[tuple[int, int]]:
        """``(start, stop)`` token indices of the span that each layer holds, in layer order (every layer
        ``(0, tokens)`` unless the blob has per-layer token sets)."""
        h, _ = self.check_blob(blob)
        out: list[tuple[int, int]] = [(0, 0)] * h["layers"]
        for gi, tab in enumerate(self.tables):
            a, ns, nc, nw = group_segments(h, gi)
            for layer in tab.ids:
                out[layer] = (a, a + ns + nc + nw)
        return out

    def positions(self, blob: bytes | bytearray | memoryview) -> torch.Tensor:
        """The absolute token positions recorded in a blob."""
        h, _ = self.check_blob(blob)
        return torch.tensor(runs_to_positions(h["positions"]), dtype=torch.int64)

# ---------------------------------------------------------------------- helpers
def _in_layer_order(layers: Iterator[tuple[int, Any, Any]]) -> Iterator[tuple[int, Any, Any]]:
    """Re-yield ``(layer, k, v)`` in ascending layer order (groups over a permuted order come out of order: each is
    held only until the layers before it came out)."""
    held: dict[int, tuple[int, Any, Any]] = {}
    nxt = 0
    for item in layers:
        held[item[0]] = item
        while nxt in held:
            yield held.pop(nxt)
            nxt += 1
    if held:
        raise DecodeError(f"decoder produced layers {sorted(held)} without layer {nxt}")


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)
