"""The moving raw window: one raw window per stored prefix, at its end.

A sequence's offload that ends it (``tail``) keeps its last ``window`` tokens raw in a blob of their own (whole
blocks, stored uncompressed: :meth:`Offloader.cuts <dynamo_kvtc.tiers.offloader.Offloader.cuts>`), remembered here by
the sequence hash of its last block. The next offload that extends exactly that prefix (the next turn of the
conversation, the answer's blocks, a decode flush) takes it: the window's K/V are read back from the blob (raw, so
exact), put in front of the new blocks, and the whole is cut again: the tokens that stopped being the most recent
``window`` are coded with the new blocks, the new most recent ``window`` tokens go raw into a new tail blob, and the
old blob is retired from every tier once the new ones are indexed. A stored conversation so holds one raw window, not
one per turn, and an increment shorter than the window waits raw in the tail until a later offload codes it.

Readers in flight: the new blobs are indexed before the old one goes, so a restore planned after the replacement
reads the new blobs; one planned before reads the old blob while a tier holds it (a host-tier lease keeps its pages
until released), else its read fails and the restore is a miss. Both blobs carry the same block keys for the same
tokens, so nothing wrong is served.

Not for a blob the offload did not write here (a restart's disk files, a peer's blob, the vLLM ``kvtc`` tier's
chunks): only tails this process stored are taken; a tail evicted or replaced meanwhile is left alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from ..errors import KvtcError
from .blobs import BlobMeta, OffloadRequest, OffloadResult

log = logging.getLogger(__name__)


class RawTails:
    """Sequence hash of a stored prefix's last block -> the id of the blob holding its raw window (at most ``limit``
    entries, the oldest forgotten first: a forgotten tail just stays raw). Used by the offload worker only."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self._tails: OrderedDict[int, str] = OrderedDict()

    def remember(self, last: int, blob_id: str) -> None:
        self._tails[last] = blob_id
        self._tails.move_to_end(last)
        while len(self._tails) > self.limit:
            self._tails.popitem(last=False)

    def take(self, last: int) -> str | None:
        return self._tails.pop(last, None)

    def __len__(self) -> int:
        return len(self._tails)


def absorb(off: Any, req: OffloadRequest, res: OffloadResult) -> tuple[OffloadRequest, str] | None:
    """When ``req`` extends a prefix whose raw window the offloader ``off`` holds in its ``tails``: a request
    covering that window's blocks and then ``req``'s new blocks (K/V as tensors, ``tail``: it now ends the stored
    prefix) and the id of the window's blob to retire once the new blobs are kept; else None (``req`` is stored as
    it is)."""
    if req.start >= req.end or req.end != req.n:
        return None
    prev = req.hashes[req.start - 1] if req.start else req.parent
    old = None if prev is None else off.tails.take(prev)
    if old is None:
        return None
    bs = off.block_size
    meta = off.index.meta(old)
    if meta is None or off.index.locate(prev) != (old, len(meta.hashes) - 1):
        return None  # evicted, or its blocks re-stored elsewhere since
    m = len(meta.hashes)
    first = req.first_block + req.start - m
    if first < 0 or meta.first_position != first * bs:
        return None
    data = off.placement.peek(old)
    if data is None:
        return None
    a, b = req.start * bs, req.end * bs
    if req.keys is not None:
        k_new, v_new = req.keys[:, a:b], req.values[:, a:b]
    else:
        k_new, v_new = off.kv.gather(req.block_ids[req.start : req.end])
    try:
        k_old, v_old = off.codec(req.ratio).decode(data)
    except KvtcError as e:  # not readable: leave it (it stays raw), store the new blocks alone
        log.warning("kvtc: the raw window %s does not decode (%s); left as it is", old, e)
        return None
    if k_old.shape[1] != m * bs or k_old.shape[0] != k_new.shape[0] or k_old.shape[2:] != k_new.shape[2:]:
        return None
    keys = torch.cat([k_old.to(k_new.device, k_new.dtype), k_new], dim=1)
    values = torch.cat([v_old.to(v_new.device, v_new.dtype), v_new], dim=1)
    off.stats.offload_window_recoded += 1
    off.stats.offload_window_blocks += m
    out = OffloadRequest(
        [*meta.hashes, *req.hashes[req.start : req.end]],
        list(req.token_ids[a:b]),
        0,
        m + req.end - req.start,
        req.ratio,
        first_block=first,
        parent=None,
        keys=keys,
        values=values,
        tail=True,
        announce_from=m,
    )
    return out, old


def retire(off: Any, old: str, kept: list[str]) -> BlobMeta | None:
    """Drop the replaced raw window ``old`` from every tier unless a new blob took its id; its metadata (None when
    kept or already gone), so the offload's byte counts can deduct what it held."""
    if old in kept:
        return None
    meta = off.index.meta(old)
    off.placement.retire(old)
    return meta


__all__ = ["RawTails", "absorb", "retire"]
