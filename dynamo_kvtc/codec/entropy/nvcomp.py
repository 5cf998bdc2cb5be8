"""The nvCOMP side of the GPU coders: whether nvCOMP runs here, and the one way an ``nvcomp.Codec`` is built for a
coder (its algorithm, the raw bitstream, its options); both the section coder and the fused batch use it."""

from __future__ import annotations

from typing import Any

import torch

from .base import Coder


def nvcomp_available() -> bool:
    """True when nvCOMP imports and a CUDA device is usable."""
    if not torch.cuda.is_available():
        return False
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


def nvcomp_codec(c: Coder, stream: int) -> tuple[Any, Any]:
    """``(the nvcomp module, an nvcomp.Codec)`` of coder ``c`` on the CUDA stream ``stream`` (its handle)."""
    from nvidia import nvcomp

    codec = nvcomp.Codec(
        algorithm=c.nvcomp, cuda_stream=stream, bitstream_kind=nvcomp.BitstreamKind.RAW, **dict(c.nvcomp_options)
    )
    return nvcomp, codec
