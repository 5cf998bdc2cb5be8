"""The fused GPU fast path of the codec (see :mod:`.fused`). Importing this package imports neither Triton nor
anything CUDA-specific: Triton is loaded on first use and every stage has a torch fallback."""

from __future__ import annotations

import os

from .fused import FusedCodec, fused_status
from .layouts import DenseKV, PagedBlocks, Span
from .restore import RestoreJob

# The entropy codec a GPU tier uses unless told otherwise (DYN_KVTC_GPU_ENTROPY=deflate|gdeflate|ans), chosen from
# H200 measurements (docs/performance.md): ANS decodes ~30x faster than nvCOMP Deflate and ~5x faster than GDeflate
# for ~3% more stored bytes. Deflate stays the interoperable choice: the CPU reads it, the GPU reads the CPU's.
GPU_DEFAULT_TAG = "ans"


def default_gpu_tag() -> str:
    tag = os.environ.get("DYN_KVTC_GPU_ENTROPY", "").strip().lower()
    return tag if tag in ("deflate", "gdeflate", "ans") else GPU_DEFAULT_TAG


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
