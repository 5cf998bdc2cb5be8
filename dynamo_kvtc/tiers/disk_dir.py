"""The disk tier's directory: opened without following symlinks and checked (ours, not group- or world-writable),
fsynced, and taken by one process at a time (an ``flock`` on a lock file in this user's private runtime directory,
shared by every :class:`~dynamo_kvtc.tiers.disk.DiskTier` of this process over the same directory). See disk.py's
docstring for the rules; this module holds the file-system mechanics."""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import stat
import tempfile
import threading
from pathlib import Path

from ..errors import ConfigError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted under a blob's name must not block the open

# One locked descriptor per directory per process (flock locks belong to an open file description, so two DiskTiers
# of one process over the same directory, as after an in-process restart, share it instead of locking each other out)
_DIR_LOCKS: dict[tuple[int, int], list] = {}  # (st_dev, st_ino) -> [fd, users, lock path]
_DIR_LOCKS_GUARD = threading.Lock()


VIRTUAL_ROOTS = ("/proc", "/sys", "/dev")  # kernel file systems: no blob file can live there


def disk_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be the disk tier's directory, in one line (None: it can), without creating anything: a
    kernel file system (/proc, /sys, /dev), a symlink, not a directory, group- or world-writable, another user's, not
    writable; a folder that does not exist yet needs its parent to exist (a missing mount point is not silently
    created on the root file system) and to be writable. The start-up check of every way in (the tier re-checks what
    it opens, :func:`open_dir`)."""
    path = Path(os.path.abspath(path))
    real = os.path.realpath(path)
    if any(real == r or real.startswith(r + "/") for r in VIRTUAL_ROOTS):
        root = "/" + real.split("/")[1]
        return f"{path} is on a kernel file system ({root}): no blob file can be stored there"
    if path.is_symlink():
        return f"{path} is a symlink; point it at a real directory"
    if not path.exists():
        parent = path.parent
        if not parent.is_dir():
            return f"{path} cannot be created: its parent {parent} does not exist (create it, or mount the volume)"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"{path} cannot be created: its parent {parent} is not writable by this process"
        return None
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as e:
        return f"{path} cannot be read: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}); refusing: `chmod go-w` it "
                "or name a subdirectory the tier creates (0700)")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not this process ({os.getuid()})"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable by this process"
    return None


def open_dir(path: Path) -> int:
    """Create (0700) or open the tier's directory without following a symlink; check who owns it. Returns an fd."""
    if path.is_symlink():
        raise ConfigError(f"disk cache dir {path} is a symlink; refusing (point disk_cache_dir at a real dir)")
    created = not path.exists()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"disk cache dir {path} is a symlink; refusing") from None
        raise ConfigError(f"disk cache dir {path} cannot be created or opened: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"disk cache dir {path} is not a directory")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):  # others could plant, swap or delete blob files
            raise ConfigError(
                f"disk cache dir {path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}); refusing: "
                "`chmod go-w` it or point disk_cache_dir at a subdirectory the tier creates (0700)"
            )
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise ConfigError(f"disk cache dir {path} is owned by uid {st.st_uid}, not this process ({os.getuid()})")
        if created:  # make the new directory's own entry durable too
            fsync_dir(path.parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(path: Path) -> None:
    try:
        pfd = os.open(path, os.O_RDONLY | CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(pfd)
    except OSError:
        pass
    finally:
        os.close(pfd)


def _lock_path(ident: tuple[int, int]) -> str:
    """The lock lives outside the cache directory (no descriptor held on the cache's file system, which can then be
    unmounted) in this user's private runtime directory: $TMPDIR/kvtc-<uid>, 0700, ours, not a symlink."""
    root = os.path.join(tempfile.gettempdir(), f"kvtc-{os.getuid()}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{root} must be a directory of this user with mode 0700 (it holds the disk tier's locks)")
    return os.path.join(root, f"disk-{ident[0]:x}-{ident[1]:x}.lock")


def lock_dir(ident: tuple[int, int], path: Path) -> None:
    """Take the directory for this process: ``flock`` on a lock file named after the directory's (device, inode),
    shared by every DiskTier of this process over the same directory; released when the process dies."""
    with _DIR_LOCKS_GUARD:
        held = _DIR_LOCKS.get(ident)
        if held is not None:
            held[1] += 1
            return
        lock = _lock_path(ident)
        for _ in range(8):  # the file may be unlinked by its previous holder between our open and our flock
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | NOFOLLOW | CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise ConfigError(
                        f"disk cache dir {path} is in use by another process; give each engine (and each "
                        "tensor-parallel rank) its own DYN_KVTC_DISK_CACHE_DIR"
                    ) from None
                raise ConfigError(f"disk cache dir {path}: cannot lock it ({lock}): {e}") from None
            try:
                same = os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                _DIR_LOCKS[ident] = [fd, 1, lock]
                return
            os.close(fd)
        raise ConfigError(f"disk cache dir {path}: its lock file {lock} keeps changing")


@atexit.register
def _unlock_all() -> None:  # tiers never closed: remove their lock files at exit (kill -9 leaves them; harmless)
    for ident in list(_DIR_LOCKS):
        _DIR_LOCKS[ident][1] = 1
        unlock_dir(ident)


def unlock_dir(ident: tuple[int, int]) -> None:
    with _DIR_LOCKS_GUARD:
        held = _DIR_LOCKS.get(ident)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del _DIR_LOCKS[ident]
            try:
                os.unlink(held[2])  # while still holding it: a waiter re-checks the inode and retries
            except OSError:
                pass
            os.close(held[0])  # releases the lock
