"""Where the ``kvtc`` tier (:mod:`.tier`) keeps its blobs: a :class:`~dynamo_kvtc.tiers.store.KvtcStore`, the same store
KvtcConnector uses (one eviction policy, one disk-directory policy, one :class:`~dynamo_kvtc.tiers.stats.StoreStats`
and so the same ``kvtc_*`` metric families), with one chunk as one blob of one store block; and vLLM's chunk keys as
the store's keys."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import torch

from ...errors import KvtcError
from ...tiers.config import TierConfig, cluster_secret, process_settings
from ...tiers.disk import DiskTier
from ...tiers.store import KvtcStore
from .options import KvtcTierOptions, option_error

POOL_FIELDS = ("pool_master", "pool_metadata_server", "pool_segment_gb", "pool_replicas", "pool_protocol",
               "pool_device", "pool_timeout_s", "pool_queue_mb", "pool_insecure")  # fmt: skip

__all__ = ["KeyBook", "make_store", "offload_hash"]


def make_store(cal: Any, opts: KvtcTierOptions, device: torch.device, tokens: int, ratio: float) -> KvtcStore:
    """The tier's store: blocks of ``tokens`` tokens (one chunk each), the host tier of ``cpu_cache_gb`` (one arena
    allocated at start, pinned where CUDA is) and the disk tier of ``disk_cache_gb`` in ``disk_cache_dir`` (the disk
    tier's rules, tiers/disk.py: created 0700; refused when a symlink, group- or world-writable or not ours; one
    process at a time; blobs of this calibration and chunk size found there at start are adopted). Every host-tier
    victim is written to disk (``disk_min_uses`` 1: a cascaded chunk is engine history, not a one-off prompt). The
    codec's process knobs (``DYN_KVTC_FUSED`` ...) are the process's. ``ratio``: the tier's encode ratio."""
    plans = sorted(float(r) for r in cal.ratios)
    cfg = TierConfig(
        host_bytes=int(opts.host_bytes),
        ratio=ratio if ratio in plans else plans[0],  # ratio_policy raw: any plan (a restore reads every ratio)
        ratio_policy=opts.ratio_policy,
        window=opts.chunk_window,
        disk_min_uses=1,
        **pool_settings(opts),
        **process_settings(),
    )
    disk = None
    if opts.disk_bytes > 0:
        try:
            disk = DiskTier(opts.disk_dir, int(opts.disk_bytes), fsync=cfg.fsync, timeout_s=cfg.nixl_timeout_s)
        except KvtcError as e:
            raise option_error("disk_cache_dir", str(e)) from None
    return KvtcStore(cal, cfg, device=device, block_size=tokens, span_tokens=tokens, disk=disk)


def pool_settings(opts: KvtcTierOptions) -> dict[str, Any]:
    """The pool tier's fields from the tier's options, and the cluster secret that seals it from the environment
    (``DYN_KVTC_TRANSFER_SECRET_FILE`` / ``DYN_KVTC_TRANSFER_SECRET``); nothing when ``pool_master`` is unset."""
    if not opts.pool_master:
        return {}
    kw = {f: getattr(opts, f) for f in POOL_FIELDS}
    kw["pool_secret"] = cluster_secret()
    return kw


def offload_hash(key: bytes) -> int:
    """The store key (a 128-bit int, :func:`~dynamo_kvtc.tiers.keys.is_key`) of vLLM's chunk key (``OffloadKey``:
    block hash + group index): BLAKE2b-128 of its bytes. A blob carries its key; a restore checks it."""
    return int.from_bytes(hashlib.blake2b(bytes(key), digest_size=16).digest(), "big")


class KeyBook:
    """vLLM's keys of the blobs the tier put, by store key, and those whose blobs left every tier since the last
    :meth:`take_removed` (for vLLM's KV events). A store listener (``stored``/``removed``); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[int, bytes] = {}
        self._removed: list[bytes] = []

    def add(self, h: int, key: bytes) -> None:
        with self._lock:
            self._keys[h] = key

    def stored(self, hashes: Any, token_ids: Any, parent: Any) -> None:
        pass  # the tier records the keys each store job stored

    def removed(self, hashes: Any) -> None:
        with self._lock:
            for h in hashes:
                key = self._keys.pop(h, None)
                if key is not None:
                    self._removed.append(key)

    def take_removed(self) -> list[bytes]:
        with self._lock:
            out, self._removed = self._removed, []
        return out
