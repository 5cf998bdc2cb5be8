"""The records that travel between the store's parts, the connector and a peer: blob metadata (one per stored blob),
blob runs (one per run of a blob's blocks, planned then read), offload requests and results. Plain dataclasses, no
behaviour beyond (de)serialising a :class:`BlobMeta`."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from ..errors import BadRecordError
from .keys import is_key

Sink = Callable[[int, int, torch.Tensor, torch.Tensor], None]  # (layer, first token index, k, v)


@dataclass
class BlobMeta:
    """What the tiers know about one stored blob: its id, the sequence hashes of the blocks it holds (in order), the
    absolute position of its first token, the ratio it was encoded at (None: raw) and the calibration it needs."""

    id: str
    hashes: list[int]
    block_size: int
    first_position: int
    ratio: float | None
    cal: str
    raw_bytes: int
    stored_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> BlobMeta:
        """The metadata in ``d`` (a disk record's ``meta``, a peer's), every field checked by type and range;
        :class:`~dynamo_kvtc.errors.BadRecordError` (a TierError and a ValueError) naming the first bad field."""
        if not isinstance(d, dict):
            raise BadRecordError(f"blob metadata is a {type(d).__name__}, not a map")
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            raise BadRecordError(f"blob metadata fields {sorted(map(str, set(d) ^ names))} missing or unknown")
        for name, ok in _CHECKS.items():
            if not ok(d[name]):
                raise BadRecordError(f"blob metadata field {name}={d[name]!r:.80} has the wrong type or range")
        return cls(**{k: list(v) if k == "hashes" else v for k, v in d.items()})


def _int(lo: int, hi: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi


MAX_BLOB_BLOCKS = 1 << 16  # blocks one blob may hold (the blob header's key list has the same bound)
_BLOB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # the disk tier's file names (tiers/disk_format.py)
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "id": lambda v: isinstance(v, str) and _BLOB_ID.fullmatch(v) is not None,
    "hashes": lambda v: isinstance(v, list) and 0 < len(v) <= MAX_BLOB_BLOCKS and all(map(is_key, v)),
    "block_size": _int(1, 1 << 20),
    "first_position": _int(0, 1 << 48),
    "ratio": lambda v: (
        v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)
    ),
    "cal": lambda v: isinstance(v, str) and 0 < len(v) <= 256,
    "raw_bytes": _int(0, 1 << 48),
    "stored_bytes": _int(0, 1 << 48),
}


@dataclass(frozen=True)
class BlobRun:
    """Blocks ``first .. first + count`` of one blob, restoring requested blocks ``at .. at + count``: the one run
    record from the index's plan to the restore (and to a peer).

    ``blob`` is None while the run is only planned (:meth:`BlockIndex.plan <dynamo_kvtc.tiers.index.BlockIndex.plan>`),
    then the blob's bytes (or a view, or a peer's arriving blob); ``blob_id`` names the blob in this store's tiers
    (None for a peer's blob); ``meta`` is set when the blob's metadata travels with it (an export; a peer's blob that
    may be kept here)."""

    blob: Any
    first: int  # first block inside the blob
    count: int  # blocks of the blob used
    at: int  # index of its first block among the requested hashes
    meta: BlobMeta | None = None
    blob_id: str | None = None


@dataclass
class OffloadRequest:
    """One queued encode: blocks ``start .. end`` (indices into ``hashes``) of a sequence's blocks ``first_block ..
    first_block + len(hashes)``, at ``ratio``. K/V come from ``keys``/``values`` [L, len(hashes)*block_size, H, D] or
    from the registered paged cache at ``block_ids`` (one per hash). ``parent`` is the sequence hash of the block
    before ``hashes[0]``; ``tail``: this offload ends the sequence (its last blob keeps the raw window).
    ``announce_from``: the first block not stored before (a request that codes a stored raw window starts with that
    window's blocks, already announced; ``token_ids`` then cover blocks ``announce_from ..`` only)."""

    hashes: Sequence[int]
    token_ids: Sequence[int]
    start: int
    end: int
    ratio: float
    first_block: int = 0
    parent: int | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    block_ids: Sequence[int] | None = None
    ready_event: Any = None
    tail: bool = True
    announce_from: int = 0  # blocks before this one are a replaced raw window: ``token_ids`` start here

    @property
    def n(self) -> int:
        return len(self.hashes)


@dataclass
class OffloadResult:
    stored_blocks: int = 0
    skipped: str | None = None  # why nothing (more) was stored: "short", "filtered", "present", "error: ..."
    blobs: list[str] = field(default_factory=list)
    ratio: float | None = None
    raw_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
