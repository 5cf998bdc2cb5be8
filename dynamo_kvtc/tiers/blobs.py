"""The records that travel between the store's parts, the connector and a peer: blob metadata (one per stored blob),
blob runs (one per run of a blob's blocks, planned then read), offload requests and results. Plain dataclasses, no
behaviour beyond (de)serialising a :class:`BlobMeta`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

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
    def from_dict(cls, d: dict[str, Any]) -> BlobMeta:
        """Raises TypeError (or KeyError) when ``d`` is not a blob's metadata."""
        return cls(**d)


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
    before ``hashes[0]``; ``tail``: this offload ends the sequence (its last blob keeps the raw window)."""

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
