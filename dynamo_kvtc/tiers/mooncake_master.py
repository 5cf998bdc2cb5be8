"""A real ``mooncake_master`` (with its built-in HTTP metadata server) on free loopback ports: the pool tests'
fixture (tests/mooncake_fixture.py) and ``bench pool`` start one.

:class:`MooncakeMaster` starts the wheel's binary (through :func:`dynamo_kvtc.tiers.mooncake_lib.master_env`, which
gives it NIXL's libibverbs), waits until both ports answer, and is restartable on the same ports (``stop()`` then
``start()``: the "master killed mid-run" cases). Its lifetime is bounded twice: killed at teardown (and at
interpreter exit), and run under ``timeout -s KILL`` so a forgotten one dies on its own. """

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import time

from ..errors import TierError

LIFETIME_S = 900  # the hard bound on one master process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """One master: ``.master`` ("127.0.0.1:P"), ``.metadata_server`` (URL), ``.start()``, ``.stop()``."""

    def __init__(self, lifetime_s: float = LIFETIME_S, extra: tuple[str, ...] = ()) -> None:
        # its metrics port too: the binary's default (9003) is one per machine, so a second master (two test runs
        # side by side, a leftover one) exits at start
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.lifetime_s, self.extra = lifetime_s, extra
        self.proc: subprocess.Popen | None = None
        atexit.register(self.stop)

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self, wait_s: float = 30.0) -> MooncakeMaster:
        from . import mooncake_lib

        if self.proc is not None and self.proc.poll() is None:
            return self
        bound = ["timeout", "-s", "KILL", str(int(self.lifetime_s))] if shutil.which("timeout") else []
        cmd = [*bound, *mooncake_lib.master_command(), f"--rpc_port={self.rpc_port}",
               "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={self.http_port}", f"--metrics_port={self.metrics_port}",
               *self.extra]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, env=mooncake_lib.master_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + wait_s
        while not (_answers(self.rpc_port) and _answers(self.http_port)):
            if self.proc.poll() is not None:
                raise TierError(f"mooncake_master exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise TierError("mooncake_master did not open its ports")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the `timeout` wrapper and the master
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
        deadline = time.monotonic() + 10  # the ports are free again before a restart binds them
        while (_answers(self.rpc_port) or _answers(self.http_port)) and time.monotonic() < deadline:
            time.sleep(0.1)
