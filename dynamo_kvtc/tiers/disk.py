"""Disk tier (G3c): one file per blob under a directory the store owns, written and read through NIXL.

File layout: ``b"KVTCD002"`` | uint32 meta length | uint32 CRC-32 of meta | msgpack meta (blob id, blob length, blob
CRC-32, the blob's tier metadata) | the KVTC blob.

Commit protocol: write ``<id>.tmp`` (created 0600, space reserved first so ENOSPC shows before any byte is written),
NIXL WRITE, fsync, rename to ``<id>.kvtc``, fsync the directory (both fsyncs only with ``fsync``, which the store's
``disk_fsync`` setting leaves off by default: a cache may lose its last writes on power loss, and the CRCs catch a
torn file). ``put`` returns only after all of that: a blob whose ``put`` returned is *committed* and survives a crash
of the process (``kill -9``) and, with ``fsync`` on, of the machine. The directory listing *is* the index: on start
the tier reads every committed file's header, deletes files
whose header or size does not check out (torn or damaged) and leftover ``.tmp`` files, and leaves files it cannot
read for a transient reason (an ``OSError`` such as EMFILE or EACCES) alone: it never deletes a blob it could not
prove damaged. A read verifies the whole blob's CRC (and that it is the blob committed under that id) before
returning it, so a torn, truncated or flipped file is never served. Bytes that do not verify are re-read once with a
plain ``pread``: if the file itself is damaged it is deleted (TierError, a miss); if the file verifies, the transfer was
at fault and the file is kept. A failed NIXL transfer or I/O error is a miss that keeps the file
(:class:`~dynamo_kvtc.errors.TransferError`, a TierError).

The directory: a symlinked, group- or world-writable or foreign-owned directory is refused (ConfigError at start-up:
the connector disables itself with one error line). Every operation opens it with
``O_NOFOLLOW``, checks it is still the directory checked at start (device and inode) and works relative to that
descriptor (``openat``-style), so it cannot be swapped for a symlink or another directory afterwards; files are
opened with ``O_NOFOLLOW``. No descriptor stays open on the cache's file system between operations. One process at a
time: an ``flock`` on ``$TMPDIR/kvtc-<uid>/disk-<dev>-<inode>.lock`` (a private 0700 directory); a second process gets
a ConfigError, a crashed one releases it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..codec.blob import BlobView
from ..errors import ConfigError, TierError, TierFullError, TransferError
from ..transport.channel import pack
from ..transport.nixl_io import NixlFiles
from .base import BlobTier, Evicted
from .disk_dir import CLOEXEC, NOFOLLOW, NONBLOCK, lock_dir, open_dir, unlock_dir
from .disk_format import BLOB_ID, MAGIC, MAX_META, PREFIX, SUFFIX, DamagedFile, check_magic, parse_record

log = logging.getLogger(__name__)


class _Entry(NamedTuple):
    size: int  # file size
    meta: Any
    crc: int  # CRC-32 of the committed blob


class DiskTier(BlobTier):
    """The ``disk`` tier: committed blob files in one directory, LRU. Owns the directory (its lock), the files and their
    entries; it never serves bytes it has not verified and never deletes a file it could not prove damaged."""

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike,
        capacity_bytes: int,
        *,
        io: NixlFiles | None = None,
        fsync: bool = True,
        timeout_s: float | None = None,
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"disk tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.dir = Path(directory)
        dfd = open_dir(self.dir)
        try:
            st = os.fstat(dfd)
        finally:
            os.close(dfd)
        self._ident = (st.st_dev, st.st_ino)
        lock_dir(self._ident, self.dir)
        try:
            self._setup(capacity_bytes, io, fsync, timeout_s)
        except BaseException:
            unlock_dir(self._ident)
            raise

    def _setup(self, capacity_bytes: int, io: NixlFiles | None, fsync: bool, timeout_s: float | None) -> None:
        self.capacity = capacity_bytes
        self.fsync = fsync
        self.io = io or NixlFiles(**({} if timeout_s is None else {"timeout_s": timeout_s}))
        self._lock = threading.RLock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._pending: dict[str, int] = {}  # ids being written -> bytes reserved
        self.used_bytes = 0
        self.recovered = 0
        self.dropped = 0  # files deleted as damaged (recovery and reads)
        self.unreadable = 0  # files left in place because they could not be read (not adopted)
        self.tmp_removed = 0  # leftover .tmp files of interrupted writes deleted at start
        self.bad_transfers = 0  # reads whose NIXL bytes did not verify while the file itself did
        self._closed = False
        self._recover()

    def close(self) -> None:
        """Release the directory (its lock). The files stay; the next DiskTier over the directory adopts them."""
        if self._closed:
            return
        self._closed = True
        unlock_dir(self._ident)

    @contextlib.contextmanager
    def _at(self) -> Iterator[int]:
        """A descriptor of the tier's directory, checked to still be the directory checked at start (not swapped for
        another directory or a symlink since); file operations go through it (openat-style)."""
        try:
            fd = os.open(self.dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC)
        except OSError as e:
            raise TierError(f"disk cache dir {self.dir} is gone or not a directory: {e}") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self._ident:
                raise TierError(f"disk cache dir {self.dir} was replaced underneath the tier; refusing to use it")
            yield fd
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> None:
        with self._at() as dfd:
            found = self._scan(dfd)
        for _, blob_id, size, meta, crc in sorted(found, key=lambda x: x[0]):
            self._entries[blob_id] = _Entry(size, meta, crc)
            self.used_bytes += size
        self.recovered = len(found)

    def _scan(self, dfd: int) -> list:
        found = []
        for name in os.listdir(dfd):
            if name.endswith(".tmp"):
                self._unlink(name, dfd)
                self.tmp_removed += 1
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                size, mtime, blob_id, meta, crc = self._read_header(dfd, name)
            except DamagedFile as e:
                log.warning("disk tier: dropping %s (%s)", name, e)
                self._unlink(name, dfd)
                self.dropped += 1
                continue
            except OSError as e:  # not proven damaged: keep the file, do not serve it
                log.warning("disk tier: cannot read %s (%s); leaving it in place, not adopted", name, e)
                self.unreadable += 1
                continue
            found.append((mtime, blob_id, size, meta, crc))
        return found

    @staticmethod
    def _read_header(dfd: int, name: str) -> tuple[int, int, str, Any, int]:
        try:
            fd = os.open(name, os.O_RDONLY | NOFOLLOW | CLOEXEC | NONBLOCK, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink: never ours, never followed (unlink removes the link only)
                raise DamagedFile("a symlink") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise DamagedFile("not a regular file")
            head = os.pread(fd, PREFIX.size, 0)
            if len(head) < PREFIX.size:
                raise DamagedFile("truncated prefix")
            magic, mlen, mcrc = PREFIX.unpack(head)
            check_magic(magic)
            if mlen > MAX_META:
                raise DamagedFile("bad meta length")
            mbytes = os.pread(fd, mlen, PREFIX.size)
        finally:
            os.close(fd)
        if len(mbytes) != mlen or zlib.crc32(mbytes) != mcrc:
            raise DamagedFile("meta checksum mismatch")
        m = parse_record(mbytes)
        if name != f"{m['id']}{SUFFIX}":
            raise DamagedFile(f"file name does not match the blob id {m['id']!r} in its header")
        if st.st_size != PREFIX.size + mlen + m["len"]:
            raise DamagedFile(f"size {st.st_size} does not match its header (torn write?)")
        stored = m["meta"].get("stored_bytes", m["len"]) if isinstance(m["meta"], dict) else m["len"]
        if stored != m["len"]:  # the blob's tier metadata must describe the blob the file holds
            raise DamagedFile(f"record says {stored!r} stored bytes, the file holds a {m['len']}-byte blob")
        return st.st_size, st.st_mtime_ns, m["id"], m["meta"], m["crc"]

    # ------------------------------------------------------------------ state
    @staticmethod
    def _name(blob_id: str) -> str:
        if not isinstance(blob_id, str) or not BLOB_ID.fullmatch(blob_id):
            raise TierError(f"invalid blob id {blob_id!r} (1-128 characters of [A-Za-z0-9_-])")
        return blob_id + SUFFIX

    def _path(self, blob_id: str) -> Path:
        return self.dir / self._name(blob_id)

    def _unlink(self, name: str, dfd: int | None = None) -> None:
        try:
            if dfd is None:
                with self._at() as fd:
                    os.unlink(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except (OSError, TierError) as e:
            log.warning("disk tier: cannot delete %s: %s", name, e)

    # ------------------------------------------------------------------ put / get / delete
    def put(self, blob_id: str, blob: Any, meta: Any, *, keep_evicted: bool = True) -> list[Evicted]:
        """Commit a blob (a BlobView or bytes-like) durably; evicts least-recently-used blobs to stay under capacity
        and returns them (their bytes read back first only with ``keep_evicted``; None when that read failed).

        Raises TierFullError (capacity or ENOSPC) or TierError (I/O, NIXL); then nothing of the blob is left behind
        and every previously committed blob is untouched."""
        name = self._name(blob_id)
        blob = BlobView.of(blob).host()
        crc = zlib.crc32(blob)
        try:
            mbytes = pack({"id": blob_id, "len": len(blob), "crc": crc, "meta": meta})
        except (TypeError, ValueError, OverflowError) as e:
            raise TierError(f"blob {blob_id}: metadata cannot be stored: {e}") from None
        if len(mbytes) > MAX_META:
            raise TierError(f"blob {blob_id}: metadata of {len(mbytes)} bytes exceeds {MAX_META}")
        size = PREFIX.size + len(mbytes) + len(blob)
        if size > self.capacity:
            raise TierFullError(f"blob of {size} bytes exceeds the disk tier ({self.capacity} bytes)")
        evicted: list[Evicted] = []
        with self._lock:
            if blob_id in self._entries:
                self._entries.move_to_end(blob_id)
                return evicted
            if blob_id in self._pending:  # another thread is committing the same blob right now
                return evicted
            while self.used_bytes + sum(self._pending.values()) + size > self.capacity and self._entries:
                old = next(iter(self._entries))
                evicted.append(Evicted(old, self._victim(old) if keep_evicted else None, self._entries[old].meta))
                self.delete(old)
            self._pending[blob_id] = size
        tmp = f"{blob_id}.tmp"
        try:
            with self._at() as dfd:
                self._write(dfd, tmp, name, blob_id, size, mbytes, blob, meta, crc)
        finally:
            with self._lock:
                self._pending.pop(blob_id, None)
        return evicted

    def _write(self, dfd: int, tmp: str, name: str, blob_id: str, size: int, mbytes: bytes, blob, meta, crc) -> None:
        fd = -1
        committed = False
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | NOFOLLOW | CLOEXEC, 0o600, dir_fd=dfd)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
                os.ftruncate(fd, size)  # file systems without fallocate
            image = bytearray(size)
            PREFIX.pack_into(image, 0, MAGIC, len(mbytes), zlib.crc32(mbytes))
            image[PREFIX.size : PREFIX.size + len(mbytes)] = mbytes
            image[PREFIX.size + len(mbytes) :] = blob
            self.io.write(fd, torch.frombuffer(image, dtype=torch.uint8))
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            with self._lock:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                self._entries[blob_id] = _Entry(size, meta, crc)
                self.used_bytes += size
                committed = True
            if self.fsync:
                os.fsync(dfd)
        except (OSError, TransferError) as e:
            if fd >= 0:
                os.close(fd)
            self._unlink(tmp, dfd)
            if committed:  # the directory fsync failed: not durable, so not committed
                with self._lock:
                    if self._entries.pop(blob_id, None) is not None:
                        self.used_bytes -= size
                    self._unlink(name, dfd)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(f"disk tier out of space writing {size} bytes: {e}") from e
            raise TierError(f"disk tier write of {blob_id} failed: {e}") from e

    def _victim(self, blob_id: str) -> BlobView | None:
        """An eviction victim's bytes for the next tier (None when they cannot be read)."""
        try:
            return self.read(blob_id)
        except TierError as e:
            log.warning("disk tier: eviction victim %s not handed on: %s", blob_id, e)
            return None

    def read(self, blob_id: str) -> BlobView | None:
        """Read and verify a blob: a view of the buffer NIXL read the file into (no copy), or None when the tier does
        not hold it.

        A missing, torn or corrupted file raises TierError and is forgotten (a damaged one deleted); a failed NIXL
        transfer or I/O error raises TransferError (a TierError) and keeps the committed file for the next try."""
        name = self._name(blob_id)
        with self._lock:
            entry = self._entries.get(blob_id)
            if entry is None:
                return None
            self._entries.move_to_end(blob_id)
        try:
            fd = self._open_ro(name)
        except FileNotFoundError as e:
            self._forget(blob_id, f"cannot open: {e}")
            raise TierError(f"blob {blob_id}: file missing ({e})") from e
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink planted under the blob's name
                self._forget(blob_id, "replaced by a symlink", delete=True)
                raise TierError(f"blob {blob_id}: file replaced by a symlink; dropped") from e
            raise TransferError(f"blob {blob_id}: file unreadable ({e}); kept") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                raise DamagedFile(f"file size {st.st_size} differs from the committed {entry.size}")
            data = memoryview(self.io.read(fd, entry.size).numpy()).toreadonly()
        except TransferError as e:  # a failed transfer is not a damaged file: keep it, report a miss
            raise TransferError(f"blob {blob_id}: {e}") from e
        except DamagedFile as e:
            self._forget(blob_id, str(e), delete=True)
            raise TierError(f"blob {blob_id} on disk is corrupt ({e}); dropped") from e
        except OSError as e:
            raise TransferError(f"blob {blob_id}: I/O error ({e}); kept") from e
        finally:
            os.close(fd)
        try:
            return BlobView(self._verify(data, blob_id, entry))
        except TierError as e:
            first = e
        # The bytes NIXL delivered do not verify. Before deleting anything, read the file again with a plain pread:
        # if *that* verifies, the file is fine and the transfer was bad (keep the file, report a miss).
        try:
            fd = self._open_ro(name)
            try:
                again = os.pread(fd, entry.size, 0)
            finally:
                os.close(fd)
            self._verify(again, blob_id, entry)
        except OSError as e:
            raise TransferError(f"blob {blob_id}: transfer delivered bad bytes ({first}); re-read failed: {e}") from e
        except TierError:
            self._forget(blob_id, f"corrupt: {first}", delete=True)
            raise TierError(f"blob {blob_id} on disk is corrupt ({first}); dropped") from first
        self.bad_transfers += 1
        raise TransferError(f"blob {blob_id}: NIXL delivered bytes that do not match the file ({first}); kept")

    def _open_ro(self, name: str) -> int:
        with self._at() as dfd:
            return os.open(name, os.O_RDONLY | NOFOLLOW | CLOEXEC | NONBLOCK, dir_fd=dfd)

    @staticmethod
    def _verify(data: bytes | memoryview, blob_id: str, entry: _Entry) -> memoryview:
        try:
            magic, mlen, mcrc = PREFIX.unpack_from(data, 0)
            mbytes = data[PREFIX.size : PREFIX.size + mlen]
            if magic != MAGIC or mlen > MAX_META or zlib.crc32(mbytes) != mcrc:
                raise TierError("header checksum mismatch")
            m = parse_record(bytes(mbytes))
        except struct.error as e:
            raise TierError(f"truncated: {e}") from None
        blob = memoryview(data)[PREFIX.size + mlen :]
        if m["id"] != blob_id or len(blob) != m["len"] or m["crc"] != entry.crc:
            raise TierError("not the blob committed under this id")
        if zlib.crc32(blob) != entry.crc:
            raise TierError("blob checksum mismatch")
        return blob

    def _forget(self, blob_id: str, why: str, delete: bool = False) -> None:
        log.warning("disk tier: dropping blob %s: %s", blob_id, why)
        with self._lock:
            e = self._entries.pop(blob_id, None)
            if e is not None:
                self.used_bytes -= e.size
            if delete and blob_id not in self._pending:
                self._unlink(self._name(blob_id))
        self.dropped += 1

    def discard(self, blob_id: str) -> None:
        self.delete(blob_id)

    def delete(self, blob_id: str) -> None:
        with self._lock:
            e = self._entries.pop(blob_id, None)
            if e is not None:
                self.used_bytes -= e.size
            if blob_id not in self._pending:
                self._unlink(self._name(blob_id))
