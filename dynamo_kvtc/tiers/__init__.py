"""Compressed storage tiers: host (G2c) and disk (G3c) stores of KVTC blobs, NIXL file I/O, layer-ordered restore.

:class:`KvtcStore` (store.py) is the facade; its parts: blobs.py (records), index.py (hash -> blob, listeners),
base.py / host.py / disk.py (the blob tiers), placement.py (host <-> disk moves), offloader.py (encode worker),
restorer.py (restore worker, :class:`OnboardHandle`); the fused-or-reference codec choice is codec/spans.py.
"""

from .base import BlobTier
from .blobs import BlobMeta, BlobRun, OffloadRequest, OffloadResult
from .config import TierConfig
from .disk import DiskTier
from .host import HostTier
from .index import BlockIndex
from .keys import block_hashes, chain, sequence_hashes, to_signed
from .layout import PagedKV
from .nixl_io import NixlFiles
from .policy import OffloadFilter, RatioPolicy
from .restorer import OnboardHandle
from .store import KvtcStore

__all__ = [
    "BlobMeta",
    "BlobRun",
    "BlobTier",
    "BlockIndex",
    "DiskTier",
    "HostTier",
    "KvtcStore",
    "NixlFiles",
    "OffloadFilter",
    "OffloadRequest",
    "OffloadResult",
    "OnboardHandle",
    "PagedKV",
    "RatioPolicy",
    "TierConfig",
    "block_hashes",
    "chain",
    "sequence_hashes",
    "to_signed",
]
