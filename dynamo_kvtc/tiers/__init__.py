"""Compressed storage tiers: host (G2c) and disk (G3c) stores of KVTC blobs, NIXL file I/O, layer-ordered restore."""

from .config import TierConfig
from .disk import DiskTier
from .host import HostTier
from .keys import block_hashes, chain, sequence_hashes, to_signed
from .layout import PagedKV
from .nixl_io import NixlFiles
from .policy import OffloadFilter, RatioPolicy
from .store import BlobMeta, KvtcStore, OffloadResult, OnboardHandle

__all__ = [
    "BlobMeta",
    "DiskTier",
    "HostTier",
    "KvtcStore",
    "NixlFiles",
    "OffloadFilter",
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
