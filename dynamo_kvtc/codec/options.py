"""How a codec runs, as opposed to what it writes: the path (fused or reference), the projection precision, the entropy
codec a GPU writes with, and whether a failure of the fast path may fall back.

These are process-wide settings (``DYN_KVTC_FUSED``, ``_FUSED_STRICT``, ``_PROJECTION``, ``_GPU_ENTROPY``). They are
parsed once, at start-up, by the configuration (:class:`~dynamo_kvtc.tiers.config.TierConfig`) and passed down to the
codec factory; the codec itself never reads the environment. The field names are the settings table's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .entropy.registry import nvcomp_tags

FUSED_MODES = ("0", "1", "force")  # the reference path, the fused path on CUDA, the fused path on every device (tests)
PROJECTIONS = ("auto", "fp16", "fp8")
GPU_TAGS = nvcomp_tags()  # the entropy codecs a GPU writes with: the registry's nvCOMP coders (settings' choices)


@dataclass(frozen=True)
class CodecOptions:
    """``fused``: ``"1"`` the fused path on CUDA devices (the reference path elsewhere), ``"0"`` always the reference
    path, ``"force"`` the fused path on every device (torch stages on the CPU: tests). ``fused_strict``: a failure of
    the fused path raises instead of falling back to the reference path. ``projection``: the GEMM precision (``auto``:
    FP8 where the GPU has FP8 tensor cores). ``gpu_entropy``: the entropy codec of blobs written on GPUs; None: the
    default (``ans``), which a store with a disk tier turns into ``deflate`` so its files read anywhere."""

    fused: str = "1"
    fused_strict: bool = False
    projection: str = "auto"
    gpu_entropy: str | None = None

    def __post_init__(self) -> None:
        if self.fused not in FUSED_MODES:
            raise ConfigError(f"fused must be one of {FUSED_MODES}, got {self.fused!r}")
        if self.projection not in PROJECTIONS:
            raise ConfigError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.gpu_entropy is not None and self.gpu_entropy not in nvcomp_tags():
            raise ConfigError(f"gpu_entropy must be one of {nvcomp_tags()}, got {self.gpu_entropy!r}")

    @property
    def gpu_tag(self) -> str:
        """The entropy codec a GPU writes with when nothing else decides."""
        return self.gpu_entropy or "ans"
