"""KvtcCodec: the codec users and the tiers hold — the reference codec, with the fused GPU path in front where the
options choose it, and the one place that falls back from the fused path to the reference one.

``KvtcCodec(cal, ratio=16)`` encodes with ``.encode(k, v, positions)`` and decodes with ``.decode(blob)``; the batch
interface (``encode_spans``, ``restore``) is :class:`~dynamo_kvtc.codec.base.Codec`'s. Which path runs is decided
once, here, from :class:`~dynamo_kvtc.codec.options.CodecOptions` (or the ``fused=``/``projection=`` arguments):

- ``fused`` ``"1"`` (default): the fused path on CUDA devices, the reference path elsewhere; ``"0"``: always the
  reference path; ``"force"``: the fused path on every device (torch stages on the CPU: tests). A calibration with
  per-layer token sets always stays on the reference path.
- An unexpected failure of the fused path (anything but a :class:`~dynamo_kvtc.errors.KvtcError`, which is the
  input's or the blob's fault) is logged and the codec continues on the reference path for good — unless
  ``fused_strict``, which re-raises it (tests: a failure of the fast path is never hidden).

Both paths write and read the same blobs. The codec never reads the environment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import KvtcError
from .base import KV, Bad, Codec, Encoded, EncodeSpan, PagedView, Restore, RestoreRun
from .model import CalibrationLike
from .options import CodecOptions
from .reference import CodecConfig, ReferenceCodec

log = logging.getLogger(__name__)

__all__ = ["CodecConfig", "KvtcCodec"]

_NONE = object()  # the fused path did not do the work


class KvtcCodec(ReferenceCodec):
    """Encode/decode KV spans with one calibration (see the module docstring for the path choice).

    ``fused``: None follows ``options.fused``; False keeps the reference path; True forces the fused path (on the CPU
    too, with torch stages). ``projection`` (``auto``/``fp16``/``fp8``; None: ``options.projection``) sets the
    precision of the projection GEMMs (see :class:`~dynamo_kvtc.codec.reference.ReferenceCodec`).
    """

    def __init__(
        self,
        calibration: CalibrationLike,
        ratio: float = 16,
        device: str | torch.device = "cpu",
        *,
        fused: bool | None = None,
        projection: str | None = None,
        options: CodecOptions | None = None,
        **kw: Any,
    ) -> None:
        """``kw``: the reference codec's ``sinks``, ``window``, ``min_tokens``, ``tag`` and ``profile``."""
        opts = options or CodecOptions()
        projection = opts.projection if projection is None else projection
        super().__init__(calibration, ratio, device, projection=projection, **kw)
        if fused is None:
            fused = opts.fused == "force" or (self.device.type == "cuda" and opts.fused != "0")
        if fused and self.token_sets:  # the fused path's tables and kernels assume full, consecutive groups
            log.info("calibration %s has per-layer token sets: the fused path does not take them", calibration.id[:12])
            fused = False
        self.strict = opts.fused_strict
        self._want_fast = bool(fused)
        self._fast: Codec | None = None

    @property
    def fast(self) -> Codec | None:
        """The fused implementation in front of the reference one (built on first use), or None."""
        if self._want_fast and self._fast is None:
            from .gpu.codec import FusedKvtcCodec

            self._fast = FusedKvtcCodec(self, strict=self.strict)
        return self._fast if self._want_fast else None

    @property
    def fused(self) -> Any:
        """The :class:`~dynamo_kvtc.codec.gpu.FusedCodec` engine serving this codec, or None (reference path)."""
        fast = self.fast
        return None if fast is None else fast.fused

    def _try_fast(self, what: str, call: Callable[[Codec], Any]) -> Any:
        """``call(fast)`` on the fused path; ``_NONE`` when it is off or failed unexpectedly (then it is turned off
        for good, or the failure re-raised when strict). The one fallback of the codec."""
        fast = self.fast
        if fast is None:
            return _NONE
        try:
            return call(fast)
        except KvtcError:
            raise
        except Exception as e:  # noqa: BLE001 - the reference path is always there
            if self.strict:
                raise
            log.warning(
                "kvtc fused %s failed (%s: %s); using the reference path from now on", what, type(e).__name__, e
            )
            self._want_fast = False
            return _NONE

    def encode(self, keys: torch.Tensor, values: torch.Tensor, positions: Any, *, window: int | None = None) -> bytes:
        got = self._try_fast("encode", lambda f: f.encode(keys, values, positions, window=window))
        return super().encode(keys, values, positions, window=window) if got is _NONE else got

    def decode_layers(self, blob: Any) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        got = self._try_fast("decode", lambda f: f.decode_layers(blob))
        return super().decode_layers(blob) if got is _NONE else got

    def encode_spans(
        self,
        spans: Sequence[EncodeSpan],
        read: Callable[[int, int], KV],
        *,
        paged: PagedView | None = None,
        block_ids: Sequence[int] | None = None,
        views: bool = False,
    ) -> Encoded:
        got = self._try_fast(
            "batch encode", lambda f: f.encode_spans(spans, read, paged=paged, block_ids=block_ids, views=views)
        )
        return super().encode_spans(spans, read) if got is _NONE else got

    def restore(self, runs: Sequence[RestoreRun], *, paged: PagedView | None = None, bad: Bad | None = None) -> Restore:
        return _Restore(self, list(runs), paged, bad)

    def reference_restore(self, runs: Sequence[RestoreRun], bad: Bad | None = None) -> Restore:
        """The reference path's restore of ``runs`` (blob by blob), whatever the options say."""
        return super().restore(runs, bad=bad)


class _Restore(Restore):
    """A :class:`KvtcCodec` restore: opened on the fused path when it is on (the open is where it may fail
    unexpectedly, before anything was written), else on the reference path."""

    def __init__(self, codec: KvtcCodec, runs: list[RestoreRun], paged: PagedView | None, bad: Bad | None) -> None:
        self.codec, self.runs, self.paged, self.bad = codec, runs, paged, bad

    def __iter__(self) -> Iterator[tuple[int, list[KV] | None]]:
        runs, paged, bad = self.runs, self.paged, self.bad
        got = self.codec._try_fast("batch restore", lambda f: iter(f.restore(runs, paged=paged, bad=bad)))
        if got is not _NONE:
            self.fused = True
            return got
        return iter(self.codec.reference_restore(self.runs, bad=self.bad))
