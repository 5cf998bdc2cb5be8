"""KvtcCodec: encode a span of KV cache into one blob and decode it back, layer by layer.

Token segments of a span (positions strictly increasing):

- **sinks**: tokens at absolute positions ``< sinks`` (default 4), kept in fp8 E4M3 with one fp16 scale per
  (layer, token, head) vector;
- **coded**: the tokens between, transform-coded: RoPE removed (keys), mean subtracted, projected on the
  calibration's basis, group-quantized by the DP plan, entropy coded;
- **window**: the last ``window`` tokens (default 128), kept raw in the input dtype.

A span with fewer than ``min_tokens`` coded tokens is stored raw (mode ``"raw"``): short conversations gain nothing.
Each layer group contributes four sections (sinks, k, v, window), so group 0 decodes before later groups' bytes
are needed.

**Per-layer token sets.** A calibration may group layers by attention type (``layer_order``: the groups are ranges
over a permutation of the layers) and give a group a token set (``BasisGroup.tokens``: a span's last ``tokens``
tokens, what a sliding-window layer keeps). Such a group encodes only those tokens (sinks and window clipped to
them); the blob header records each group's token range. :meth:`KvtcCodec.decode_layers` then yields each layer's
tokens only (the suffix of the span its group keeps), always in layer order; :meth:`KvtcCodec.decode_ragged` returns
per-layer tensors and :meth:`KvtcCodec.layer_ranges` says which tokens each layer holds. The fused GPU path does not
take such calibrations: a codec holding one stays on the reference path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import settings
from ..errors import (
    ConfigError,
    CorruptBlobError,
    DecodeError,
    InputError,
    KvtcError,
    WrongCalibrationError,
)
from .container import (
    BlobHeader,
    check_section,
    group_segments,
    parse_blob,
    positions_to_runs,
    runs_to_positions,
    section_chunks,
    write_blob,
)
from .entropy import EntropyCoder, check_readable
from .entropy_tags import TAGS
from .model import DTYPES, BasisGroup, CalibrationLike, dtype_name, group_layer_ids
from .plan import decode_coefficients, encode_coefficients
from .rope import RotaryConfig, rotate
from .sinks import decode_sinks, encode_sinks, sink_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CodecConfig:
    """Run-time knobs of a :class:`KvtcCodec` (the calibration fixes everything else)."""

    ratio: float = 16
    sinks: int = 4
    window: int = 128
    min_tokens: int = 16
    tag: str = "deflate"
    projection: str = "auto"  # precision of the projection GEMMs: auto | fp16 | fp8 (the blob format is the same)

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ConfigError(f"sinks must be >= 0, got {self.sinks}")
        if self.window < 0:
            raise ConfigError(f"window must be >= 0, got {self.window}")
        if self.min_tokens < 1:
            raise ConfigError(f"min_tokens must be >= 1, got {self.min_tokens}")
        if self.tag not in TAGS:
            raise ConfigError(f"unknown entropy codec tag {self.tag!r}; choose one of {TAGS}")
        choices = settings.BY_KEY["projection"].choices
        if self.projection not in choices:
            raise ConfigError(f"unknown projection {self.projection!r}; choose one of {choices}")

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


class _Tables:
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


class KvtcCodec:
    """Encode/decode KV spans with one calibration.

    ``ratio`` picks the DP plan used by :meth:`encode`; :meth:`decode` reads any plan of the same calibration.
    ``device`` is where the tensor math runs ("cpu" or "cuda[:n]"). ``tag`` selects the entropy codec.

    ``fused`` selects the fused GPU path (:mod:`dynamo_kvtc.codec.gpu`: fp16 tensor-core projections, Triton stages,
    batched nvCOMP, device CRCs) for CUDA devices: ``None`` (default) uses it on CUDA unless ``DYN_KVTC_FUSED=0``;
    ``False`` keeps the reference path (float32 math, the definition of the format); ``True`` forces it (on the CPU
    too, with torch stages: for tests). Both paths write and read the same blobs. If the fused path fails
    unexpectedly the codec logs it and continues on the reference path.

    ``projection`` (``auto``/``fp16``/``fp8``; None: ``DYN_KVTC_PROJECTION``) sets the precision of the projection
    GEMMs. The fused path runs them in fp16 or FP8 (e4m3, row-wise scales; ``auto``: FP8 where the GPU has FP8
    tensor cores). The reference path stays float32 for ``auto``/``fp16`` and, for ``fp8``, emulates the FP8 GEMM's
    rounding (same scales, operands rounded to e4m3, fp32 matmul) so its accuracy can be measured on the CPU.
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
        tag: str = "deflate",
        profile: bool = False,
        fused: bool | None = None,
        projection: str | None = None,
    ) -> None:
        self.cal = calibration
        self.profile = profile
        if projection is None:
            projection = settings.env_value("projection")
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
        self._tables = [_Tables(g, self.device, self.order) for g in calibration.groups]
        self.token_sets = self.order is not None or any(t.tokens for t in self._tables)
        self._coders: dict[str, EntropyCoder] = {}
        self.last_timings: dict[str, float] = {}
        if fused is None:  # DYN_KVTC_FUSED: 0 = never, force = on every device (torch stages on the CPU: tests)
            env = settings.env_value("fused")
            fused = env == "force" or (self.device.type == "cuda" and env != "0")
        if fused and self.token_sets:  # the fused path's tables and kernels assume full, consecutive groups
            log.info("calibration %s has per-layer token sets: the fused path does not take them", calibration.id[:12])
            fused = False
        self._use_fused = bool(fused)
        self._fused = None

    @property
    def fused(self):
        """The :class:`~dynamo_kvtc.codec.gpu.FusedCodec` serving this codec, or None (reference path)."""
        if self._use_fused and self._fused is None:
            from .gpu.fused import FusedCodec

            self._fused = FusedCodec(self)
        return self._fused if self._use_fused else None

    def disable_fused(self, what: str, error: BaseException) -> None:
        """The fused path failed doing ``what``: log it and use the reference path from now on (re-raises ``error``
        instead when ``DYN_KVTC_FUSED_STRICT=1``, as tests set, so a failure of the fast path is never hidden)."""
        if settings.env_value("fused_strict"):
            raise error
        log.warning(
            "kvtc fused %s failed (%s: %s); using the reference path from now on", what, type(error).__name__, error
        )
        self._use_fused = False

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
            groups=[list(t.layers) for t in self._tables],
            order=None if self.order is None else list(self.order),
            token_sets=self.token_ranges(positions.numel()) if self.token_sets else None,
        )

    def token_ranges(self, tokens: int) -> list[list[int]]:
        """``[start, stop]`` token-index range each layer group encodes of a span of ``tokens`` tokens."""
        return [[max(0, tokens - t.tokens) if t.tokens else 0, tokens] for t in self._tables]

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

    # ================================================================== validation
    def _check_inputs(
        self, keys: Any, values: Any, positions: Any, finite: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise InputError(
                    f"{name} must be [num_layers, num_tokens, num_kv_heads, head_dim], got shape {tuple(t.shape)}"
                )
            if t.dtype not in DTYPES.values():
                raise InputError(f"{name} dtype {t.dtype} not supported (bfloat16, float16, float32)")
        if keys.shape != values.shape:
            raise InputError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
        if keys.dtype != values.dtype:
            raise InputError(f"keys ({keys.dtype}) and values ({values.dtype}) differ in dtype")
        L, T, H, D = keys.shape
        fp = self.fp
        expect = (fp.num_layers, fp.num_kv_heads, fp.head_dim)
        if (L, H, D) != expect:
            raise InputError(
                f"KV shape (layers={L}, kv_heads={H}, head_dim={D}) does not match the calibration's "
                f"(layers={expect[0]}, kv_heads={expect[1]}, head_dim={expect[2]}) for "
                f"{fp.model_name or fp.architecture} (tp rank {fp.tp_rank}/{fp.tp_size})"
            )
        if T == 0:
            raise InputError("cannot encode zero tokens")
        if not isinstance(positions, torch.Tensor):
            try:
                positions = torch.as_tensor(positions)
            except (TypeError, ValueError, RuntimeError) as e:
                raise InputError(f"positions must be a sequence of integers: {e}") from None
        if positions.dim() != 1 or positions.numel() != T:
            raise InputError(
                f"positions must be 1-D with one entry per token ({T}), got shape {tuple(positions.shape)}"
            )
        if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.is_complex():
            raise InputError(f"positions must be integers, got {positions.dtype}")
        positions = positions.to("cpu", torch.int64)
        if int(positions[0]) < 0:
            raise InputError(f"positions must be >= 0, got {int(positions[0])}")
        if T > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise InputError("positions must be strictly increasing (one absolute position per token)")
        if int(positions[-1]) >= 1 << 40:
            raise InputError("positions exceed 2^40")
        for name, t in (("keys", keys), ("values", values)) if finite else ():
            if not bool(torch.isfinite(t).all()):
                raise InputError(f"{name} contain NaN or Inf; refusing to store them")
        return keys, values, positions

    # ================================================================== encode
    def encode(self, keys: torch.Tensor, values: torch.Tensor, positions: Any, *, window: int | None = None) -> bytes:
        """Encode ``keys``/``values`` ``[L, T, H, D]`` (keys post-RoPE) at absolute ``positions`` ``[T]``.

        ``window`` overrides the configured number of trailing tokens kept raw for this span (a storage tier keeps
        the raw window only on a sequence's last span).
        """
        if self.fused is not None:
            keys, values, pos = self._check_inputs(keys, values, positions, finite=False)
            try:
                from .gpu.fused import DenseKV, Span

                src = DenseKV(keys.to(self.device), values.to(self.device))
                blob = self._fused.encode_batch(src, [Span(0, 0, pos, window)])[0]
                self.last_timings.update(self._fused.last_timings)
                return blob
            except KvtcError:
                raise
            except Exception as e:  # noqa: BLE001 - the reference path below is always available
                self.disable_fused("encode", e)
        t_start = self._now()
        keys, values, pos = self._check_inputs(keys, values, positions)
        L, T, H, D = keys.shape
        cfg = self.config
        mode, ns, nw, nc = cfg.segments(pos, window)
        dev = self.device
        tim = {"project": 0.0, "quantize": 0.0, "entropy": 0.0}
        sections: list[tuple[str, str, int, list[bytes]]] = []
        header = self.blob_header(keys.dtype, pos, mode, ns, nw)
        hd = header.to_dict()
        rope_caches: dict[int, dict[RotaryConfig, tuple[torch.Tensor, torch.Tensor]]] = {}
        for gi, tab in enumerate(self._tables):
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
        from .gpu.projection import fake_e4m3

        return fake_e4m3(x, dim)

    def _ref_mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` on the reference path (per-row scales for ``a``, per-column for ``b`` when emulating fp8)."""
        return self._ref_operand(a, 1) @ self._ref_operand(b, 0)

    # ================================================================== decode
    def _check_header(self, h: dict[str, Any]) -> None:
        fp = self.fp
        if h["cal"] != self.cal.id:
            raise WrongCalibrationError(
                f"blob was encoded with calibration {h['cal'][:12]}, this codec holds {self.cal.id[:12]} "
                f"({fp.model_name or fp.architecture})"
            )
        if (h["layers"], h["heads"], h["head_dim"]) != (fp.num_layers, fp.num_kv_heads, fp.head_dim):
            raise CorruptBlobError("blob shape fields disagree with its calibration")
        if h["groups"] != [list(t.layers) for t in self._tables]:
            raise CorruptBlobError("blob layer groups disagree with its calibration")
        if h.get("order") != (None if self.order is None else list(self.order)):
            raise CorruptBlobError("blob layer order disagrees with its calibration")
        if h.get("token_sets") != (self.token_ranges(h["tokens"]) if self.token_sets else None):
            raise CorruptBlobError("blob token sets disagree with its calibration")
        if h["mode"] == "kvtc":
            if h["ratio"] is None or float(h["ratio"]) not in self._tables[0].k_plans:
                raise CorruptBlobError(f"blob names ratio {h['ratio']!r}, which its calibration has no plan for")
        elif h["sinks"] or h["window"] != h["tokens"]:
            raise CorruptBlobError("raw-mode blob must hold every token in its window")

    def _expected_sizes(self, h: dict[str, Any]) -> list[tuple[str, int]]:
        H, D = h["heads"], h["head_dim"]
        item = DTYPES[h["dtype"]].itemsize
        out = []
        for gi, tab in enumerate(self._tables):
            _, ns, nc, nw = group_segments(h, gi)
            Lg = tab.layers[1] - tab.layers[0]
            out.append((f"{gi}.sinks", sink_bytes(Lg, ns, H, D)))
            for kind, plans in (("k", tab.k_plans), ("v", tab.v_plans)):
                out.append((f"{gi}.{kind}", plans[float(h["ratio"])].nbytes(nc) if nc else 0))
            out.append((f"{gi}.window", 2 * Lg * nw * H * D * item))
        return out

    def check_blob(self, blob: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list]:
        """Parse ``blob`` and check it fits this codec: its calibration, shapes, layer groups, plan, the section sizes
        they imply and readable entropy tags. Returns the header dict and section records (section CRCs are not
        checked here); raises :class:`~dynamo_kvtc.errors.DecodeError` otherwise. Both decode paths start here."""
        try:
            h, recs = parse_blob(blob)
        except DecodeError:
            raise
        except Exception as e:  # never let a malformed blob escape as anything but DecodeError
            raise CorruptBlobError(f"malformed blob: {type(e).__name__}: {e}") from None
        self._check_header(h)
        expected = self._expected_sizes(h)
        if [(r.name, r.raw_len) for r in recs] != expected:
            raise CorruptBlobError("blob section table does not match the sizes its header and calibration imply")
        for r in recs:
            if r.name.endswith(("sinks", "window")) and r.tag != "store":
                raise CorruptBlobError(f"section {r.name} must be stored, has tag {r.tag!r}")
            check_readable(r.tag, self.device)
        return h, recs

    def decode_layers(self, blob: bytes | bytearray | memoryview) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(layer, keys [T, H, D], values [T, H, D])`` in layer order as each becomes ready.

        The whole blob is validated (structure and every section checksum) before the first layer is produced.
        """
        if self.fused is not None:
            try:
                job = self._fused.open([blob])  # parses, copies to the device, checks every CRC
            except KvtcError:
                raise
            except Exception as e:  # noqa: BLE001
                self.disable_fused("decode", e)
            else:
                return self._fused_layers(job)
        h, recs = self.check_blob(blob)
        for r in recs:
            check_section(blob, r)  # checksums up front: never yield layers of a corrupt blob
        layers = self._layers(blob, h, recs)
        return layers if self.order is None else _in_layer_order(layers)

    def _fused_layers(self, job) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        yield from job.layers()
        self.last_timings.update(job.finish())

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
        for gi, tab in enumerate(self._tables):
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
        for gi, tab in enumerate(self._tables):
            a, ns, nc, nw = group_segments(h, gi)
            for layer in tab.ids:
                out[layer] = (a, a + ns + nc + nw)
        return out

    def positions(self, blob: bytes | bytearray | memoryview) -> torch.Tensor:
        """The absolute token positions recorded in a blob."""
        h, _ = self.check_blob(blob)
        return torch.tensor(runs_to_positions(h["positions"]), dtype=torch.int64)

    # ================================================================== stats
    def stats(self, blob: bytes | bytearray | memoryview) -> dict[str, Any]:
        """Sizes, ratios (paper accounting and others), plan summary and the last encode/decode timings."""
        h, recs = self.check_blob(blob)
        T, H, D, L = h["tokens"], h["heads"], h["head_dim"], h["layers"]
        ns, nw = h["sinks"], h["window"]
        nc = T - ns - nw
        per_tok16 = 2 * L * H * D * 2  # K+V bytes per token at 16 bits
        # 16-bit bytes of what the layers hold (a layer with a token set holds only its tokens), in total, of the
        # compressed tokens (sinks and coded) and of the coded ones: the same as per_tok16 * tokens without sets
        raw16 = {"all": 0, "compressed": 0, "coded": 0}
        for gi, tab in enumerate(self._tables):
            _, gs, gc, gw = group_segments(h, gi)
            per_layer_tok = 2 * len(tab.ids) * H * D * 2
            raw16["all"] += per_layer_tok * (gs + gc + gw)
            raw16["compressed"] += per_layer_tok * (gs + gc)
            raw16["coded"] += per_layer_tok * gc
        stored = {"sinks": 0, "k": 0, "v": 0, "window": 0}
        for r in recs:
            stored[r.name.split(".", 1)[1]] += r.stored_len
        sections_total = sum(stored.values())
        compressed_stored = stored["sinks"] + stored["k"] + stored["v"]
        out: dict[str, Any] = {
            "mode": h["mode"],
            "ratio_target": h["ratio"],
            "tokens": T,
            "sink_tokens": ns,
            "coded_tokens": nc,
            "window_tokens": nw,
            "raw_bytes_16bit": per_tok16 * T,
            "held_bytes_16bit": raw16["all"],  # what the layers hold at 16 bits (= raw_bytes_16bit without sets)
            "held_compressed_bytes_16bit": raw16["compressed"],
            "token_sets": h.get("token_sets"),
            "input_bytes": 2 * L * H * D * T * DTYPES[h["dtype"]].itemsize,
            "blob_bytes": len(memoryview(blob)),
            "header_bytes": len(memoryview(blob)) - sections_total,
            "stored_bytes": stored,
            "ratio": (raw16["compressed"] / compressed_stored) if compressed_stored else None,
            "ratio_with_window": raw16["all"] / sections_total if sections_total else None,
            "ratio_blob": per_tok16 * T / len(memoryview(blob)),
            "codec_tag": sorted({r.tag for r in recs if r.name.endswith((".k", ".v"))}),
        }
        if h["mode"] == "kvtc":
            ratio = float(h["ratio"])
            out["plan"] = {
                kind: {
                    "rank": sum(getattr(t, f"{kind}_plans")[ratio].rank for t in self._tables),
                    "bits_per_token": sum(getattr(t, f"{kind}_plans")[ratio].bits_per_token for t in self._tables),
                    "budget_bits": sum(getattr(t, f"{kind}_plans")[ratio].budget_bits for t in self._tables),
                    "coordinates_by_type": _sum_dicts(
                        getattr(t, f"{kind}_plans")[ratio].kind_counts() for t in self._tables
                    ),
                }
                for kind in ("k", "v")
            }
            out["ratio_before_entropy"] = (
                raw16["coded"] / sum(r.raw_len for r in recs if r.name.endswith((".k", ".v"))) if nc else None
            )
        out["timings"] = dict(self.last_timings)
        return out


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


def _sum_dicts(ds) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)
