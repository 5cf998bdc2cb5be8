"""Compressed storage tiers: host (G2c) and disk (G3c) stores of KVTC blobs, NIXL file I/O, layer-ordered restore.

:class:`KvtcStore` (store.py) is the facade; its parts: blobs.py (records), index.py (hash -> blob, listeners),
base.py (the one BlobTier contract) / host.py / disk.py (the blob tiers; disk_format.py the file format, disk_dir.py
the directory and its lock), registry.py (the kinds of tier and how a config builds the chain), placement.py (moves
along the chain), offloader.py (encode worker), restorer.py (restore worker, :class:`OnboardHandle`);
the control channel and the NIXL I/O they use live below, in :mod:`dynamo_kvtc.transport`; the fused-or-reference
codec choice is codec/spans.py.

Exports load lazily (PEP 562): ``dynamo_kvtc.tiers.disk_format`` imports without torch.
"""

from __future__ import annotations

from ..lazy import exports

_EXPORTS = {
    "BlobTier": "base",
    "Evicted": "base",
    "TierKind": "registry",
    "register": "registry",
    "BlobMeta": "blobs",
    "BlobRun": "blobs",
    "OffloadRequest": "blobs",
    "OffloadResult": "blobs",
    "TierConfig": "config",
    "DiskTier": "disk",
    "HostTier": "host",
    "BlockIndex": "index",
    "block_hashes": "keys",
    "chain": "keys",
    "sequence_hashes": "keys",
    "to_signed": "keys",
    "PagedKV": "layout",
    "OffloadFilter": "admission",
    "RatioPolicy": "admission",
    "OnboardHandle": "restorer",
    "KvtcStore": "store",
    "StoreStats": "stats",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = exports(__name__, _EXPORTS)
