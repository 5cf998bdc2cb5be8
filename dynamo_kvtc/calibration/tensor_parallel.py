"""A joint calibration served under tensor parallelism: vLLM's head split and the row-sharded codec of one TP rank.

:func:`head_layout` is the split :func:`~dynamo_kvtc.calibration.calibrate.shard_heads` defines (contiguous, as vLLM
splits KV heads; replicated when tp > heads) for every rank; :func:`sharded_codec` builds rank ``t``'s
:class:`~dynamo_kvtc.codec.sharded.ShardedKvtcCodec` from the JOINT calibration (all heads, ``tp_size`` 1). The
per-rank calibrations ``calibrate(..., tp_rank=, tp_size=)`` makes are a different design (one basis per shard, lower
accuracy: docs/accuracy.md's TP section).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..codec.factory import Shard, make_codec
from ..codec.model import CalibrationLike
from ..codec.sharded import Collective, HeadLayout, ShardedKvtcCodec, TorchCollective
from .calibrate import shard_heads


def head_layout(total_heads: int, tp_size: int) -> HeadLayout:
    """Every rank's KV heads for ``tp_size`` ranks over ``total_heads`` heads (vLLM's split)."""
    return HeadLayout.from_slices(total_heads, [shard_heads(total_heads, r, tp_size) for r in range(tp_size)])


def sharded_codec(
    calibration: CalibrationLike,
    tp_rank: int,
    tp_size: int,
    collective: Collective | None = None,
    *,
    group: Any = None,
    **codec_kw: Any,
) -> ShardedKvtcCodec:
    """Rank ``tp_rank``'s row-sharded codec of the joint ``calibration``. ``collective`` defaults to
    :class:`~dynamo_kvtc.codec.sharded.TorchCollective` over ``group`` (a ``torch.distributed`` process group; None:
    the default group). ``codec_kw``: ``ratio``, ``device``, ``sinks``, ``window``, ``min_tokens``, ``tag``,
    ``reduce_dtype``."""
    layout = head_layout(calibration.fingerprint.num_kv_heads, tp_size)
    shard = Shard(tp_rank, layout, collective or TorchCollective(group))
    if "reduce_dtype" in codec_kw:
        shard = replace(shard, reduce_dtype=codec_kw.pop("reduce_dtype"))
    return make_codec(calibration, ratio=codec_kw.pop("ratio", 16), shard=shard, **codec_kw)
