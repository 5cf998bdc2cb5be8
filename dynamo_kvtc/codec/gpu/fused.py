"""The fused GPU codec: many spans per call, fp16 tensor-core projections, fused stages, batched nvCOMP, one stream.

It reads and writes exactly the blob format of :class:`~dynamo_kvtc.codec.kvtc.KvtcCodec` (docs/format.md, version 1):
a blob from either path decodes on the other, and the CPU reads its Deflate blobs. What differs is how the work runs:

Encode (:meth:`FusedCodec.encode_batch`), for all spans of a batch together:

1. ``prep``: for each layer, K (then V) rows of every span's coded tokens are gathered straight from where the
   engine keeps them (paged blocks or a dense tensor), RoPE removed, the calibration mean subtracted and written as
   fp16 into one ``[rows, p]`` matrix (fp32 arithmetic; non-finite input and fp16 overflow are flagged on the device,
   overflow re-runs the batch in bf16);
2. ``project``: one GEMM onto the plan's leading components, fp16 x fp16 with fp32 accumulation and output (the fp16
   basis is exactly what the calibration stores), or e4m3 with row-wise scales (codec option ``projection``,
   :mod:`.projection`);
3. ``quantize``: each plan bucket quantized straight from the GEMM output and packed into its blob's section layout;
4. ``entropy``: all chunks of all sections in one nvCOMP batch call with preallocated outputs on the stream;
5. ``finish``: one synchronisation for the compressed sizes, compaction into the blobs' byte order, CRC-32 of every
   section on the device, one more synchronisation for the CRCs, headers on the host, one device-to-host copy per blob.

Restore (:meth:`FusedCodec.open` then :meth:`RestoreJob.layers`), for all blobs of a batch together:

1. headers parsed and checked on the host (the reference checks), section bytes queued host->device layer group by
   layer group on a copy stream (pinned sources copy asynchronously, in place);
2. then per layer group, on the caller's stream and with no host synchronisation: that group's CRC-32s computed on
   the device, its compressed chunks realigned and inflated (one nvCOMP batch per codec tag), ``dequantize`` into one
   fp16 coefficient matrix per K/V and plan;
3. per layer of the group: ``Y = D @ V[cols_l]^T`` (fp16 or FP8 GEMM, fp32 accumulation, :mod:`.projection`), then
   ``post``: + mean, RoPE re-applied, cast, and scattered straight into the destination rows (engine blocks or
   per-layer buffers); sinks and window rows follow — every write gated on the device by the CRCs checked so far,
   the verdict reported by ``finish()`` (see :mod:`.restore`).

The reference path (``KvtcCodec`` with ``fused=False``) stays the CPU path and the definition of the format.

Modules: this one holds :class:`FusedCodec` (batch encode, restore jobs); :mod:`.device` its device state (tables,
stage dispatch, locks); :mod:`.encode` one batch encode;
:mod:`.restore` the restore job; :mod:`.layouts` dense and paged K/V; :mod:`.batch_entropy` batched nvCOMP/zlib;
:mod:`.ops` the stages (Triton and torch). Headers and framing come from :mod:`dynamo_kvtc.codec.container`, the fp8
sinks from :mod:`dynamo_kvtc.codec.sinks`, as for the reference path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ...errors import ConfigError, InputError
from ..entropy.nvcomp import nvcomp_available
from ..model import DTYPES
from .batch_entropy import BatchEntropy
from .device import FusedDevice
from .encode import EncodeRun, F16Overflow
from .layouts import DenseKV, PagedBlocks, Span
from .projection import resolve_projection
from .restore import RestoreJob

log = logging.getLogger(__name__)

__all__ = ["BatchEntropy", "DenseKV", "FusedCodec", "PagedBlocks", "RestoreJob", "Span", "fused_status"]


class FusedCodec(FusedDevice):
    """Batch encode/restore for one reference codec (its calibration, ratio, sinks, window, min_tokens and entropy
    tag: :class:`~dynamo_kvtc.codec.reference.ReferenceCodec`) on its device. Work is queued on the current CUDA
    stream. The device state (tables, stage backend, entropy coder, pinned buffers) is its
    :class:`~.device.FusedDevice` base; :mod:`.encode` and :mod:`.restore` work on that.

    It never builds a header or frames a blob itself (the container does) and never falls back to the reference
    path (:class:`~dynamo_kvtc.codec.kvtc.KvtcCodec` decides that)."""

    # ============================================================================================ encode
    def encode_batch(
        self, source, spans: Sequence[Span], *, host_out: torch.Tensor | None = None, views: bool = False
    ) -> list[bytes] | list[tuple[int, int]] | list[memoryview]:
        """Encode every span of ``source`` (:class:`DenseKV`, :class:`PagedBlocks`) into one blob each.

        Returns the blobs as ``bytes``, or, with ``host_out`` (a CPU uint8 tensor, pinned for asynchronous copies),
        writes them back to back into it and returns ``(offset, length)`` per blob. ``views``: memoryviews into a
        pinned buffer this codec reuses for the next ``views`` encode — for one consumer that copies each blob
        where it belongs before encoding again (the store's offload worker), saving a host copy per blob."""
        fp = self.fp
        if (source.num_layers, source.heads, source.head_dim) != (fp.num_layers, fp.num_kv_heads, fp.head_dim):
            raise InputError(
                f"KV shape (layers={source.num_layers}, kv_heads={source.heads}, head_dim={source.head_dim}) "
                f"does not match the calibration's ({fp.num_layers}, {fp.num_kv_heads}, {fp.head_dim})"
            )
        if source.dtype not in DTYPES.values():
            raise InputError(f"KV dtype {source.dtype} not supported (bfloat16, float16, float32)")
        if not self.entropy.usable(self.cfg.tag):
            raise ConfigError(
                f"entropy codec {self.cfg.tag!r} is GPU-only (nvCOMP); it needs CUDA and nvidia-nvcomp-cu13"
            )
        with self._lock:
            try:
                return EncodeRun(self, source, spans, bf16=False).run(host_out, views)
            except F16Overflow:
                return EncodeRun(self, source, spans, bf16=True).run(host_out, views)

    # ============================================================================================ restore
    def open(self, blobs: Sequence[Any], *, verify: str = "device") -> RestoreJob:
        """Parse every header (DecodeError at once for a malformed or foreign blob) and queue the section bytes to
        the device. ``verify="device"``: CRCs are checked on the device and gate the writes, the verdict surfaces in
        :meth:`RestoreJob.finish`; ``"eager"``: every CRC is checked here, before anything is decoded.

        A blob is ``bytes``/``bytearray``/``memoryview``, or ``(tensor, offset, length)`` with a CPU uint8 tensor
        (pinned: the host->device copy is asynchronous)."""
        return RestoreJob(self, blobs, verify)


def fused_status(device: str | torch.device, projection: str = "auto") -> dict[str, Any]:
    """What the fused path would use on ``device``: ops backend, nvCOMP, the projection GEMMs (``projection``:
    auto|fp16|fp8, the codec option) and why."""
    from .ops import triton_status

    dev = torch.device(device)
    ok, why = triton_status()
    choice = projection
    proj, proj_why = resolve_projection(choice, dev)
    return {
        "device": str(dev),
        "ops": "triton" if (ok and dev.type == "cuda") else "torch",
        "triton": why,
        "nvcomp": dev.type == "cuda" and nvcomp_available(),
        "projection": proj,
        "projection_choice": choice,
        "projection_why": proj_why,
    }
