"""File I/O through NIXL (POSIX backend; GDS_MT when asked for and loadable on a GPU node).

NIXL reports failures as exceptions from ``nixl._bindings`` (``nixlBackendError``, ``nixlNotFoundError``, ...) with no
common base; they are caught as a tuple and re-raised as :class:`~dynamo_kvtc.errors.TransferError`. Every transfer
has a deadline. NIXL does not fsync: the disk tier does.

A transfer that failed or timed out may still be running inside the backend. If NIXL does not confirm that its handle
was released (or a registration was undone), the buffer it reads into or writes from is *quarantined*: kept alive
for the life of the process instead of being freed, so a late completion can never write into memory that was reused
for something else (``quarantined_bytes`` counts it).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from ..errors import ConfigError, TransferError

log = logging.getLogger(__name__)
_names = itertools.count()


def _import_nixl():
    try:
        from nixl import _bindings
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu13 import _bindings
            from nixl_cu13._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise ConfigError("the disk tier needs NIXL: pip install --no-deps nixl-cu13==1.5.1") from e
    errors = tuple(getattr(_bindings, n) for n in dir(_bindings) if n.endswith("Error"))
    return nixl_agent, nixl_agent_config, errors


class NixlFiles:
    """One NIXL agent doing DRAM <-> FILE transfers. Thread-safe (transfers are serialised per agent)."""

    def __init__(self, backend: str = "POSIX", timeout_s: float = 30.0, name: str | None = None) -> None:
        nixl_agent, nixl_agent_config, self.errors = _import_nixl()
        self.name = name or f"kvtc-files-{_names.__next__()}"
        self.timeout_s = timeout_s
        if not timeout_s > 0:
            raise ConfigError(f"NIXL timeout must be > 0 seconds, got {timeout_s!r}")
        self._lock = threading.Lock()
        self._quarantine: list[torch.Tensor] = []
        self.quarantined_bytes = 0
        try:
            self.agent = nixl_agent(self.name, nixl_agent_config(backends=[]))
            self.agent.create_backend(backend, {})
        except self.errors + (RuntimeError,) as e:
            raise TransferError(f"NIXL {backend} backend unavailable: {type(e).__name__}: {e}") from e
        self.backend = backend

    def _hold(self, buf: torch.Tensor, why: str) -> None:
        log.warning("NIXL %s: its %d-byte buffer is kept alive (no late write into freed memory)", why, len(buf))
        self._quarantine.append(buf)
        self.quarantined_bytes += buf.numel()

    def _xfer(self, op: str, buf: torch.Tensor, fd: int, offset: int, nbytes: int) -> None:
        a = self.agent
        handles = []
        with self._lock:
            unsafe = False  # True while the backend may still touch ``buf``
            try:
                handles.append(a.register_memory(buf[:nbytes]))
                handles.append(a.register_memory([(offset, nbytes, fd, "kvtc")], "FILE"))
                local = a.get_xfer_descs([(buf.data_ptr(), nbytes, 0)], "DRAM")
                remote = a.get_xfer_descs([(offset, nbytes, fd)], "FILE")
                if local is None or remote is None:
                    raise TransferError("NIXL rejected the transfer descriptors")
                h = a.initialize_xfer(op, local, remote, self.name)
                try:
                    unsafe = True
                    state = a.transfer(h)
                    deadline = time.monotonic() + self.timeout_s
                    while state != "DONE":
                        if state == "ERR":
                            raise TransferError(f"NIXL {op} reported an error")
                        if time.monotonic() > deadline:
                            raise TransferError(f"NIXL {op} of {nbytes} bytes timed out after {self.timeout_s} s")
                        time.sleep(0.0002)
                        state = a.check_xfer_state(h)
                    unsafe = False
                finally:
                    try:
                        a.release_xfer_handle(h)
                        unsafe = False  # released: the backend is done with the buffer
                    except self.errors:
                        log.warning("NIXL could not release a %s handle", op)
            except self.errors as e:
                raise TransferError(f"NIXL {op} failed: {type(e).__name__}: {e}") from e
            finally:
                for reg in reversed(handles):
                    try:
                        a.deregister_memory(reg)
                    except self.errors:  # cleanup must not hide the real error
                        log.warning("NIXL deregistration failed")
                        unsafe = True
                if unsafe:
                    self._hold(buf, f"{op} not confirmed finished")

    def write(self, fd: int, data: torch.Tensor, offset: int = 0) -> None:
        """Write a contiguous CPU uint8 tensor to ``fd`` at ``offset``."""
        if data.numel():
            self._xfer("WRITE", data.contiguous(), fd, offset, data.numel())

    def read(self, fd: int, nbytes: int, offset: int = 0) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self._xfer("READ", out, fd, offset, nbytes)
        return out
