"""The fused GPU fast path of the codec (see :mod:`.fused`). Importing this package imports neither Triton nor
anything CUDA-specific: Triton is loaded on first use and every stage has a torch fallback."""

from __future__ import annotations

from ... import settings
from .fused import FusedCodec, fused_status
from .layouts import DenseKV, PagedBlocks, Span
from .restore import RestoreJob

# The entropy codec a GPU tier uses unless told otherwise (DYN_KVTC_GPU_ENTROPY=deflate|gdeflate|ans), chosen from
# H200 measurements (docs/performance.md): ANS decodes ~30x faster than nvCOMP Deflate and ~5x faster than GDeflate
# for ~3% more stored bytes. Deflate stays the interoperable choice: the CPU reads it, the GPU reads the CPU's.
GPU_DEFAULT_TAG = settings.default("gpu_entropy")


def default_gpu_tag() -> str:
    """``DYN_KVTC_GPU_ENTROPY`` (validated: a bad value is a ConfigError, not a silent default) or the default."""
    return settings.env_value("gpu_entropy")


__all__ = [
    "GPU_DEFAULT_TAG",
    "DenseKV",
    "FusedCodec",
    "PagedBlocks",
    "RestoreJob",
    "Span",
    "default_gpu_tag",
    "fused_status",
]
