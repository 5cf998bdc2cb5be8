"""The one place a codec is chosen: :func:`make_codec` builds the reference codec (with the fused GPU path in front
where the options choose it: :class:`~dynamo_kvtc.codec.kvtc.KvtcCodec`) or, for one tensor-parallel rank, the
sharded codec; :func:`entropy_tag` picks the entropy codec new blobs are written with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import Codec
from .entropy.nvcomp import nvcomp_available
from .entropy.registry import PORTABLE
from .model import CalibrationLike
from .options import CodecOptions


@dataclass(frozen=True)
class Shard:
    """One tensor-parallel rank of a joint calibration: its ``rank``, the heads every rank holds (``layout``: a
    :class:`~dynamo_kvtc.codec.sharded.HeadLayout`), the collective over the ranks and the all-reduce dtype."""

    rank: int
    layout: Any
    collective: Any
    reduce_dtype: torch.dtype = torch.float32


def entropy_tag(device: str | torch.device, options: CodecOptions, *, portable: bool = False) -> str:
    """Entropy codec of new blobs: Deflate (readable by CPU and GPU alike) on the CPU or without nvCOMP, and on a GPU
    whose blobs must be readable anywhere (``portable``: a store with a disk tier — a CPU worker, ``inspect``, a
    recovery script read its files) unless the options name a GPU codec; else the options' GPU codec (``ans``)."""
    if torch.device(device).type != "cuda" or not nvcomp_available():
        return PORTABLE
    if portable and options.gpu_entropy is None:
        return PORTABLE
    return options.gpu_tag


def make_codec(
    calibration: CalibrationLike,
    *,
    ratio: float,
    device: str | torch.device = "cpu",
    options: CodecOptions | None = None,
    sinks: int = 4,
    window: int = 128,
    min_tokens: int = 16,
    tag: str | None = None,
    portable: bool = False,
    profile: bool = False,
    shard: Shard | None = None,
) -> Codec:
    """The codec of ``calibration`` at ``ratio`` on ``device``: the sharded codec for ``shard`` (float32, reference
    math), else a :class:`~dynamo_kvtc.codec.kvtc.KvtcCodec` (fused path per ``options``, reference fallback).
    ``tag`` None: :func:`entropy_tag` (``portable`` as there)."""
    options = options or CodecOptions()
    if tag is None:
        tag = entropy_tag(device, options, portable=portable) if shard is None else PORTABLE
    if shard is not None:
        from .sharded import ShardedKvtcCodec

        return ShardedKvtcCodec(
            calibration, shard.rank, shard.layout, shard.collective, ratio, device,
            sinks=sinks, window=window, min_tokens=min_tokens, tag=tag, reduce_dtype=shard.reduce_dtype,
        )  # fmt: skip
    from .kvtc import KvtcCodec

    return KvtcCodec(
        calibration, ratio, device,
        sinks=sinks, window=window, min_tokens=min_tokens, tag=tag, profile=profile, options=options,
    )  # fmt: skip
