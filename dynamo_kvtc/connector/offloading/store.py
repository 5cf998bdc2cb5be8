"""The ``kvtc`` tier's blob store (:mod:`.offload_tier`): a byte-budgeted host LRU over an optional disk tier."""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from .options import option_error

log = logging.getLogger(__name__)

__all__ = ["BlobCache"]


class BlobCache:
    """Blobs by key: a byte-budgeted LRU in host memory whose victims move to an optional byte-budgeted disk
    directory (one file per blob, written to ``.tmp`` then renamed), itself LRU. Thread-safe."""

    def __init__(self, host_bytes: int, disk_bytes: int = 0, disk_dir: str | None = None) -> None:
        self.host_cap, self.disk_cap = host_bytes, disk_bytes
        self.host: OrderedDict[bytes, bytes] = OrderedDict()
        self.disk: OrderedDict[bytes, int] = OrderedDict()
        self.host_used = self.disk_used = 0
        self.lock = threading.Lock()
        self.removed: list[bytes] = []  # keys no tier holds any more (for KV events)
        self.stats = {"demoted": 0, "dropped": 0, "disk_reads": 0, "disk_errors": 0}
        self.dir: Path | None = None
        if disk_bytes > 0:
            assert disk_dir
            self.dir = Path(disk_dir)
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.dir.is_symlink() or (self.dir.stat().st_mode & 0o002):
                raise option_error("disk_cache_dir", f"{self.dir} is a symlink or world-writable")
            for f in self.dir.glob("*.tmp"):
                f.unlink(missing_ok=True)
            for f in self.dir.glob("*.kvtc"):  # a restart forgets the old disk tier (no key survives the engine)
                f.unlink(missing_ok=True)

    def __contains__(self, key: bytes) -> bool:
        with self.lock:
            return key in self.host or key in self.disk

    def _path(self, key: bytes) -> Path:
        assert self.dir is not None
        return self.dir / f"{key.hex()}.kvtc"

    def put(self, key: bytes, blob: bytes) -> bool:
        with self.lock:
            if key in self.host or key in self.disk:
                return True
            if len(blob) > self.host_cap:
                return self._to_disk(key, blob)
            while self.host_used + len(blob) > self.host_cap and self.host:
                old, ob = self.host.popitem(last=False)
                self.host_used -= len(ob)
                self._to_disk(old, ob)
            self.host[key] = blob
            self.host_used += len(blob)
            return True

    def _to_disk(self, key: bytes, blob: bytes) -> bool:  # under the lock
        if self.dir is None or len(blob) > self.disk_cap:
            self.stats["dropped"] += 1
            self.removed.append(key)
            return False
        while self.disk_used + len(blob) > self.disk_cap and self.disk:
            old, size = self.disk.popitem(last=False)
            self.disk_used -= size
            self._path(old).unlink(missing_ok=True)
            self.stats["dropped"] += 1
            self.removed.append(old)
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("kvtc tier: disk write failed (%s); blob dropped", e)
            tmp.unlink(missing_ok=True)
            self.stats["disk_errors"] += 1
            self.removed.append(key)
            return False
        self.disk[key] = len(blob)
        self.disk_used += len(blob)
        self.stats["demoted"] += 1
        return True

    def get(self, key: bytes) -> bytes | None:
        with self.lock:
            blob = self.host.get(key)
            if blob is not None:
                self.host.move_to_end(key)
                return blob
            if key not in self.disk:
                return None
            self.disk.move_to_end(key)
            path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            with self.lock:
                if self.disk.pop(key, None) is not None:
                    self.stats["disk_errors"] += 1
                    self.removed.append(key)
            return None
        with self.lock:
            self.stats["disk_reads"] += 1
        return data  # the codec checks every section's CRC before anything is written

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark keys as recently used (vLLM calls this for chunks a request reuses)."""
        with self.lock:
            for key in keys:
                if key in self.host:
                    self.host.move_to_end(key)
                elif key in self.disk:
                    self.disk.move_to_end(key)

    def forget(self, key: bytes) -> None:
        with self.lock:
            blob = self.host.pop(key, None)
            if blob is not None:
                self.host_used -= len(blob)
            size = self.disk.pop(key, None)
            if size is not None:
                self.disk_used -= size
                self._path(key).unlink(missing_ok=True)

    def take_removed(self) -> list[bytes]:
        with self.lock:
            out, self.removed = self.removed, []
        return out
