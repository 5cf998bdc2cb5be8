"""Disk tier (G3c): one file per blob under a directory the store owns, written and read through NIXL.

File layout: ``b"KVTCD001"`` | uint32 meta length | uint32 CRC-32 of meta | msgpack meta (blob id, blob length, blob
CRC-32, the blob's tier metadata) | the KVTC blob.

Commit protocol: write ``<id>.tmp`` (created 0600, space reserved first so ENOSPC shows before any byte is written),
NIXL WRITE, fsync, rename to ``<id>.kvtc``, fsync the directory. The directory listing *is* the index: on start the
tier reads every committed file's header, drops files whose size or header does not check out, and deletes leftover
``.tmp`` files. A read verifies the whole blob's CRC before returning it, so a torn, truncated or flipped file is never
served; it is deleted and reported as a miss.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgpack
import torch

from ..errors import ConfigError, TierError, TierFullError, TransferError
from .nixl_io import NixlFiles

log = logging.getLogger(__name__)
MAGIC = b"KVTCD001"
PREFIX = struct.Struct("<8sII")
MAX_META = 1 << 20
SUFFIX = ".kvtc"


def _check_dir(path: Path) -> Path:
    if path.is_symlink():
        raise ConfigError(f"disk cache dir {path} is a symlink; refusing (point DYN_KVTC_DISK_CACHE_DIR at a real dir)")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_mode & stat.S_IWOTH:
        raise ConfigError(f"disk cache dir {path} is world-writable; refusing")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise ConfigError(f"disk cache dir {path} is owned by uid {st.st_uid}, not this process")
    return path


class DiskTier:
    def __init__(
        self, directory: str | os.PathLike, capacity_bytes: int, *, io: NixlFiles | None = None, fsync: bool = True
    ) -> None:
        self.dir = _check_dir(Path(directory))
        self.capacity = capacity_bytes
        self.fsync = fsync
        self.io = io or NixlFiles()
        self._lock = threading.RLock()
        self._entries: OrderedDict[str, tuple[int, Any]] = OrderedDict()  # id -> (file size, meta)
        self.used_bytes = 0
        self.recovered = 0
        self.dropped = 0
        self._recover()

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> None:
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        found = []
        for f in self.dir.glob("*" + SUFFIX):
            try:
                size, blob_id, meta = self._read_header(f)
            except (OSError, TierError, ValueError) as e:
                log.warning("disk tier: dropping %s (%s)", f.name, e)
                f.unlink(missing_ok=True)
                self.dropped += 1
                continue
            found.append((f.stat().st_mtime_ns, blob_id, size, meta))
        for _, blob_id, size, meta in sorted(found, key=lambda x: x[0]):
            self._entries[blob_id] = (size, meta)
            self.used_bytes += size
        self.recovered = len(found)

    def _read_header(self, f: Path) -> tuple[int, str, Any]:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(PREFIX.size)
            if len(head) < PREFIX.size:
                raise TierError("truncated prefix")
            magic, mlen, mcrc = PREFIX.unpack(head)
            if magic != MAGIC or mlen > MAX_META:
                raise TierError("bad magic or meta length")
            mbytes = fh.read(mlen)
        if len(mbytes) != mlen or zlib.crc32(mbytes) != mcrc:
            raise TierError("meta checksum mismatch")
        meta = _unpack(mbytes)
        if f.name != f"{meta['id']}{SUFFIX}" or size != PREFIX.size + mlen + meta["len"]:
            raise TierError(f"size {size} does not match its header (torn write?)")
        return size, meta["id"], meta["meta"]

    # ------------------------------------------------------------------ state
    def __contains__(self, blob_id: str) -> bool:
        with self._lock:
            return blob_id in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def meta(self, blob_id: str) -> Any:
        with self._lock:
            e = self._entries.get(blob_id)
            return None if e is None else e[1]

    def _path(self, blob_id: str) -> Path:
        if not blob_id or "/" in blob_id or blob_id.startswith("."):
            raise TierError(f"invalid blob id {blob_id!r}")
        return self.dir / f"{blob_id}{SUFFIX}"

    # ------------------------------------------------------------------ put / get / delete
    def put(self, blob_id: str, blob: bytes, meta: Any) -> list[str]:
        """Commit a blob durably; evicts least-recently-used blobs to stay under capacity. Returns evicted ids."""
        mbytes = msgpack.packb(
            {"id": blob_id, "len": len(blob), "crc": zlib.crc32(blob), "meta": meta}, use_bin_type=True
        )
        image = PREFIX.pack(MAGIC, len(mbytes), zlib.crc32(mbytes)) + mbytes + blob
        if len(image) > self.capacity:
            raise TierFullError(f"blob of {len(image)} bytes exceeds the disk tier ({self.capacity} bytes)")
        evicted = []
        with self._lock:
            if blob_id in self._entries:
                self._entries.move_to_end(blob_id)
                return evicted
            while self.used_bytes + len(image) > self.capacity and self._entries:
                old, _ = next(iter(self._entries.items()))
                self.delete(old)
                evicted.append(old)
        final = self._path(blob_id)
        tmp = final.with_suffix(".tmp")
        fd = -1
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                os.posix_fallocate(fd, 0, len(image))
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
                os.ftruncate(fd, len(image))  # file systems without fallocate
            self.io.write(fd, torch.frombuffer(bytearray(image), dtype=torch.uint8))
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, final)
            if self.fsync:
                dfd = os.open(self.dir, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except (OSError, TransferError) as e:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(f"disk tier out of space writing {len(image)} bytes: {e}") from e
            raise TierError(f"disk tier write of {blob_id} failed: {e}") from e
        with self._lock:
            self._entries[blob_id] = (len(image), meta)
            self.used_bytes += len(image)
        return evicted

    def get(self, blob_id: str) -> tuple[bytes, Any]:
        """Read and verify a blob; a missing, torn or corrupted file raises TierError and is forgotten."""
        with self._lock:
            entry = self._entries.get(blob_id)
            if entry is None:
                raise TierError(f"blob {blob_id} is not on disk")
            self._entries.move_to_end(blob_id)
        path = self._path(blob_id)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            self._forget(blob_id, f"cannot open: {e}")
            raise TierError(f"blob {blob_id}: file missing or unreadable ({e})") from e
        try:
            size = os.fstat(fd).st_size
            if size != entry[0]:
                raise TierError(f"file size {size} differs from the committed {entry[0]}")
            data = self.io.read(fd, size).numpy().tobytes()
        except TransferError as e:  # a failed transfer is not a damaged file: keep it, report a miss
            raise TierError(f"blob {blob_id}: {e}") from e
        except (TierError, OSError) as e:
            self._forget(blob_id, str(e), delete=True)
            raise TierError(f"blob {blob_id}: {e}") from e
        finally:
            os.close(fd)
        try:
            magic, mlen, mcrc = PREFIX.unpack_from(data, 0)
            mbytes = data[PREFIX.size : PREFIX.size + mlen]
            if magic != MAGIC or zlib.crc32(mbytes) != mcrc:
                raise TierError("header checksum mismatch")
            m = _unpack(mbytes)
            blob = data[PREFIX.size + mlen :]
            if len(blob) != m["len"] or zlib.crc32(blob) != m["crc"] or m["id"] != blob_id:
                raise TierError("blob checksum mismatch")
        except (TierError, struct.error, ValueError, KeyError) as e:
            self._forget(blob_id, f"corrupt: {e}", delete=True)
            raise TierError(f"blob {blob_id} on disk is corrupt ({e}); dropped") from e
        return blob, m["meta"]

    def _forget(self, blob_id: str, why: str, delete: bool = False) -> None:
        log.warning("disk tier: dropping blob %s: %s", blob_id, why)
        with self._lock:
            e = self._entries.pop(blob_id, None)
            if e is not None:
                self.used_bytes -= e[0]
        if delete:
            self._path(blob_id).unlink(missing_ok=True)
        self.dropped += 1

    def delete(self, blob_id: str) -> None:
        with self._lock:
            e = self._entries.pop(blob_id, None)
            if e is not None:
                self.used_bytes -= e[0]
        self._path(blob_id).unlink(missing_ok=True)


def _unpack(b: bytes) -> dict[str, Any]:
    try:
        m = msgpack.unpackb(
            b,
            raw=False,
            strict_map_key=True,
            max_str_len=4096,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=1 << 20,
            max_map_len=64,
        )
    except Exception as e:
        raise TierError(f"bad metadata: {type(e).__name__}") from None
    if not isinstance(m, dict) or not {"id", "len", "crc", "meta"} <= set(m):
        raise TierError("metadata lacks required fields")
    return m
