"""A joint calibration served under tensor parallelism: vLLM's head split and the row-sharded codec of one TP rank.

:func:`head_layout` is the split :func:`~dynamo_kvtc.calibration.calibrate.shard_heads` defines (contiguous, as vLLM
splits KV heads; replicated when tp > heads) for every rank; :func:`sharded_codec` builds rank ``t``'s
:class:`~dynamo_kvtc.codec.sharded.ShardedKvtcCodec` from the JOINT calibration (all heads, ``tp_size`` 1). The
per-rank calibrations ``calibrate(..., tp_rank=, tp_size=)`` makes are a different design (one basis per shard, lower
accuracy: docs/accuracy.md's TP section).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..codec.factory import Shard, make_codec
from ..codec.model import CalibrationLike
from ..codec.sharded import Collective, HeadLayout, ShardedKvtcCodec, TorchCollective
from ..errors import ConfigError
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


# ---------------------------------------------------------------------------------------------- the TP manifest
TP_MANIFEST = "tp.json"
TP_FORMAT = "dynamo-kvtc/tp/v1"


def write_tp_manifest(directory: str | Path, tp_size: int) -> Path:
    """Record, next to a JOINT calibration, the tensor-parallel size it is prepared for and every rank's KV heads
    (vLLM's split): ``dynamo-kvtc calibrate --tp-size N``. The joint calibration plus this split is all a rank needs
    (each rank takes its rows of every basis: :func:`sharded_codec`). Raises ConfigError when the model's KV heads
    cannot be split over ``tp_size`` ranks."""
    from .artifact import Calibration

    d = Path(directory)
    fp = Calibration.load(d).fingerprint
    if fp.tp_size != 1:
        raise ConfigError(f"{d} holds a per-rank calibration (tp rank {fp.tp_rank}/{fp.tp_size}), not a joint one")
    layout = head_layout(fp.num_kv_heads, tp_size)
    doc = {
        "format": TP_FORMAT,
        "tp_size": tp_size,
        "kv_heads": fp.num_kv_heads,
        "heads": [list(s) for s in layout.shards],
    }
    path = d / TP_MANIFEST
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def check_tp_manifest(directory: str | Path, tp_size: int, tp_rank: int, rank_heads: int) -> HeadLayout:
    """The head layout a rank of an engine at ``tp_size`` serves a joint calibration with, checked against the
    directory's :data:`TP_MANIFEST` when there is one: ConfigError (one line) when the engine's TP size or this rank's
    KV heads (``rank_heads``, what the engine's cache holds) differ from what it records."""
    from .artifact import Calibration

    d = Path(directory)
    fp = Calibration.load(d).fingerprint
    path = d / TP_MANIFEST
    if path.is_file():
        try:
            doc = json.loads(path.read_text())
            want, heads = int(doc["tp_size"]), [tuple(h) for h in doc["heads"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path} is unreadable ({e}); re-run `dynamo-kvtc calibrate --tp-size N`") from None
        if want != tp_size:
            raise ConfigError(
                f"calibration {d} is prepared for tensor_parallel_size {want} ({TP_MANIFEST}) but the engine runs "
                f"{tp_size}: re-run `dynamo-kvtc calibrate --tp-size {tp_size}` (or delete {TP_MANIFEST})"
            )
    layout = head_layout(fp.num_kv_heads, tp_size)
    if path.is_file() and list(layout.shards) != heads:
        raise ConfigError(f"{path} records head split {heads}, this version splits {list(layout.shards)}")
    a, b = layout.shards[tp_rank]
    if b - a != rank_heads:
        raise ConfigError(
            f"TP rank {tp_rank}/{tp_size} of the engine holds {rank_heads} KV heads; the split of calibration {d}'s "
            f"{fp.num_kv_heads} heads gives it {b - a}"
        )
    return layout
