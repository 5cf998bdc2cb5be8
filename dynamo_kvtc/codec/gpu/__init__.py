"""The fused GPU fast path of the codec (see :mod:`.fused`). Importing this package imports neither Triton nor
anything CUDA-specific: Triton is loaded on first use and every stage has a torch fallback.

Modules: :mod:`.codec` the fused codec behind the :class:`~dynamo_kvtc.codec.base.Codec` interface; :mod:`.fused`
the batch engine (:class:`FusedCodec`); :mod:`.device` its device state; :mod:`.encode` one batch encode;
:mod:`.restore` the streaming restore job; :mod:`.layouts` dense and paged K/V.
"""

from __future__ import annotations

from ..options import CodecOptions
from .fused import FusedCodec, fused_status
from .layouts import DenseKV, PagedBlocks, Span
from .restore import RestoreJob

# The entropy codec a GPU tier uses unless told otherwise (the codec option ``gpu_entropy``), chosen from H200
# measurements (docs/performance.md): ANS decodes ~30x faster than nvCOMP Deflate and ~5x faster than GDeflate for
# ~3% more stored bytes. Deflate stays the interoperable choice: the CPU reads it, the GPU reads the CPU's.
GPU_DEFAULT_TAG = CodecOptions().gpu_tag

__all__ = [
    "GPU_DEFAULT_TAG",
    "DenseKV",
    "FusedCodec",
    "PagedBlocks",
    "RestoreJob",
    "Span",
    "fused_status",
]
