"""Loading Mooncake Store's client (``mooncake.store``) beside NIXL in one process, with one copy of the RDMA libraries.

The ``mooncake-transfer-engine-non-cuda`` wheel's ``store.so`` needs ``libibverbs.so.1`` from the system (Debian's
``libibverbs1``, which pulls ``libnl-3-200`` and ``libnl-route-3-200``), while the nixl wheel bundles its own renamed
copies (``nixl_cu13.libs/libibverbs-<hash>.so``, ``libnl-3-<hash>.so``, ``libnl-route-3-<hash>.so``). With the system
packages installed, any process that asks for ``libibverbs.so.1`` by name (mooncake's ``store.so``; torch's
``libtorch_cpu`` dlopens it for its RPC transport) loads a second libibverbs and a second libnl beside NIXL's; libnl's
route library registers its traffic-control modules in global lists from constructors and takes them out again in
destructors (``rtnl_tc_unregister``, where the engine processes of issue 35 died with SIGSEGV at exit with the Debian
packages installed; ``LD_DEBUG=files`` shows both copies loaded in such a process).

The fix is one copy: NIXL's. :func:`load` preloads NIXL's bundled libnl and libibverbs (by path), plus a copy of
NIXL's libibverbs whose ``DT_SONAME`` reads ``libibverbs.so.1`` (:func:`native_dir` makes it once; the name is
patched in place in the ELF string table, nothing else changes), then imports ``mooncake.store``. The dynamic loader
satisfies ``store.so``'s ``libibverbs.so.1`` (and any later ``dlopen("libibverbs.so.1")``) by that soname without a
file search, and the copy's own libnl dependencies by NIXL's already-loaded sonames: no system package is needed (no
root), and none is loaded if installed. Call :func:`load` before anything imports ``mooncake.store``.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import shutil
import struct
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from ..errors import ConfigError

log = logging.getLogger(__name__)

SONAME = b"libibverbs.so.1"
_DT_STRTAB, _DT_SONAME = 5, 14
_lock = threading.Lock()
_store: ModuleType | None = None


def nixl_libs() -> Path:
    """The nixl wheel's bundled libraries folder (``nixl_cu13.libs``, or another CUDA major's)."""
    import importlib.util

    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        spec = importlib.util.find_spec(name)
        if spec and spec.submodule_search_locations:
            libs = Path(next(iter(spec.submodule_search_locations))).parent / f"{name}.libs"
            if libs.is_dir():
                return libs
    raise ConfigError("the pool tier needs the nixl wheel's bundled libibverbs (pip install nixl-cu13)")


def _one(libs: Path, prefix: str) -> Path:
    got = sorted(libs.glob(f"{prefix}-*.so*"))
    if not got:
        raise ConfigError(f"no {prefix} in {libs}")
    return got[0]


def set_soname(path: Path, name: bytes) -> None:
    """Rewrite an ELF64 little-endian shared object's ``DT_SONAME`` string in place (``name`` no longer than the
    old one; padded with NULs)."""
    data = bytearray(path.read_bytes())
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ConfigError(f"{path} is not an ELF64 little-endian object")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        raise ConfigError(f"{path} has no dynamic section")
    tags = {}
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        tags.setdefault(tag, val)
    if _DT_STRTAB not in tags or _DT_SONAME not in tags:
        raise ConfigError(f"{path} has no soname")
    vaddr = tags[_DT_STRTAB]
    strtab = next((o + vaddr - v for v, o, n in loads if v <= vaddr < v + n), None)
    if strtab is None:
        raise ConfigError(f"{path}: string table outside its segments")
    at = strtab + tags[_DT_SONAME]
    old = data[at : data.index(0, at)]
    if len(name) > len(old):
        raise ConfigError(f"{path}: soname {name!r} is longer than {bytes(old)!r}")
    data[at : at + len(old)] = name + b"\0" * (len(old) - len(name))
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


def native_dir() -> Path:
    """Where the ``libibverbs.so.1`` copy lives: ``<venv>/lib/kvtc-native`` (``make setup`` makes it), else a
    per-user temporary folder when the venv is read-only."""
    for d in (Path(sys.prefix) / "lib" / "kvtc-native", Path(tempfile.gettempdir()) / f"kvtc-native-{os.getuid()}"):
        if (d / SONAME.decode()).is_file() or os.access(d if d.exists() else d.parent, os.W_OK):
            return d
    raise ConfigError("no writable folder for the pool tier's libibverbs.so.1 copy")


def prepare(libs: Path | None = None) -> Path:
    """Make (once) and return the ``libibverbs.so.1`` copy of NIXL's bundled libibverbs."""
    libs = libs or nixl_libs()
    src = _one(libs, "libibverbs")
    d = native_dir()
    dst = d / SONAME.decode()
    stamp = d / "source"
    if dst.is_file() and stamp.is_file() and stamp.read_text() == str(src):
        return dst
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".libibverbs.{os.getpid()}.so"
    shutil.copyfile(src, tmp)
    set_soname(tmp, SONAME)
    os.replace(tmp, dst)
    stamp.write_text(str(src))
    return dst


def load() -> ModuleType:
    """``mooncake.store``, imported over NIXL's one copy of libnl and libibverbs (see the module docstring).
    ConfigError when the wheel is missing."""
    global _store
    with _lock:
        if _store is not None:
            return _store
        libs = nixl_libs()
        own = prepare(libs)
        for path in (_one(libs, "libnl-3"), _one(libs, "libnl-route-3"), _one(libs, "libibverbs"), own):
            ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)  # held for the process's life: sonames now resolve
        try:
            _store = importlib.import_module("mooncake.store")
        except ImportError as e:
            raise ConfigError(
                f"the pool tier needs Mooncake Store's client ({e}): pip install 'dynamo-kvtc[pool]' "
                "(mooncake-transfer-engine-non-cuda)"
            ) from None
        return _store


def master_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a ``mooncake_master`` process (it needs ``libibverbs.so.1`` too; it runs no NIXL): the
    copy's folder and NIXL's libraries first on ``LD_LIBRARY_PATH``."""
    env = dict(os.environ if env is None else env)
    libs = nixl_libs()
    paths = [str(prepare(libs).parent), str(libs), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
    return env


def master_command() -> list[str]:
    """The ``mooncake_master`` binary the wheel ships (run it with :func:`master_env`)."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("mooncake_master needs the mooncake-transfer-engine-non-cuda wheel")
    return [str(Path(next(iter(spec.submodule_search_locations))) / "mooncake_master")]


if __name__ == "__main__":  # make setup: python -m dynamo_kvtc.tiers.mooncake_lib
    print(prepare())
