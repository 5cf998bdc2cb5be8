"""The services a worker offers other processes, started and stopped in one place (TP rank 0 only).

- the **lookup channel** (:class:`~.lookup.LookupServer`): schedulers in other processes ask which blocks the tiers
  hold, and the prefill side's hand-off port; always started (a disabled worker answers every lookup with a miss, so
  no scheduler waits on it);
- the **hand-off server** (:class:`~.handoff.server.HandoffServer`) on a prefill engine (``transfer=prefill``), once
  the worker has a store;
- the **Prometheus endpoint** (``metrics_port``) over :class:`~.metrics.KvtcMetrics` (also on a disabled worker:
  ``kvtc_enabled 0`` and the reason stay scrapeable).

:meth:`WorkerServices.start` starts what the config asks for and is not running yet, logging one line per service
(where it listens, or why it did not start); :meth:`WorkerServices.stop` stops them all. A service that cannot start
never takes the engine down: the lookup channel's absence makes schedulers elsewhere miss, the hand-off server's makes
decode peers recompute (counted as ``fallback_transfer_setup``), the metrics endpoint's loses the scrape.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from ...errors import KvtcError
from ..config import ConnectorConfig

log = logging.getLogger(__name__)


class WorkerServices:
    """The lookup channel, hand-off server and metrics endpoint of one worker (TP rank 0).

    Owns the three servers and their sockets; reads the worker (``match``, ``handoff_port``, its counters) and the
    store only through the servers' own interfaces. Never raises from :meth:`start` or :meth:`stop`."""

    def __init__(self, cfg: ConnectorConfig, engine_id: str, stats: Counter[str]) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.stats = stats  # the worker's counters (fallback_transfer_setup)
        self.lookup: Any = None  # LookupServer
        self.handoff: Any = None  # HandoffServer (prefill engine)
        self.metrics: Any = None  # KvtcMetrics
        self.metrics_port: int | None = None  # the port the endpoint listens on (metrics_port 0: the one it got)
        self._http: Any = None  # the endpoint's HTTP server

    def start(self, worker: Any, store: Any) -> None:
        """Start what the config asks for and is not running yet: the lookup channel, the hand-off server (a prefill
        engine with a ``store``), the metrics endpoint (``metrics_port`` set; over ``store``, None when disabled)."""
        if self.lookup is None:
            self._start_lookup(worker)
        if self.handoff is None and store is not None and self.cfg.transfer == "prefill":
            self._start_handoff(store)
        if self.metrics is None and self.cfg.metrics_port is not None:
            self._start_metrics(worker, store)

    def _start_lookup(self, worker: Any) -> None:
        from .lookup import LookupServer

        try:
            self.lookup = LookupServer(self.engine_id, worker)
        except Exception as e:  # in-process matching still works
            log.warning("kvtc lookup channel not started (%s); schedulers in other processes will miss", e)
            return
        log.info("kvtc lookup channel on ipc://%s", self.lookup.path)

    def _start_handoff(self, store: Any) -> None:
        from ..handoff.server import HandoffServer

        try:
            self.handoff = HandoffServer(self.cfg, store)  # logs where it listens
        except Exception as e:
            log.error("kvtc compressed hand-off unavailable (decode peers recompute instead): %s", e)
            self.stats["fallback_transfer_setup"] += 1

    def _start_metrics(self, worker: Any, store: Any) -> None:
        from ..metrics import KvtcMetrics

        try:
            from prometheus_client import start_http_server

            self.metrics = KvtcMetrics(store, connector=worker)
            self._http, _ = start_http_server(
                self.cfg.metrics_port, addr=self.cfg.metrics_host, registry=self.metrics.registry
            )
        except (ImportError, KvtcError, OSError) as e:
            log.error("kvtc metrics not served: %s", e)
            self.metrics = None
            return
        self.metrics_port = self._http.server_port
        log.info("kvtc metrics on %s:%d/metrics", self.cfg.metrics_host, self.metrics_port)

    @property
    def handoff_port(self) -> int | None:
        """The port the hand-off server listens on (None: none runs)."""
        return self.handoff.port if self.handoff is not None else None

    def stop(self) -> None:
        """Stop every service that runs (each at most once; a failure to stop one is logged, the others still stop)."""
        for name, close in (("hand-off server", self._close_handoff), ("lookup channel", self._close_lookup),
                            ("metrics endpoint", self._close_metrics)):  # fmt: skip
            try:
                close()
            except Exception as e:  # noqa: BLE001 - shutting down: keep stopping the others
                log.warning("kvtc %s did not stop cleanly: %s", name, e)

    def _close_handoff(self) -> None:
        server, self.handoff = self.handoff, None
        if server is not None:
            server.close()

    def _close_lookup(self) -> None:
        server, self.lookup = self.lookup, None
        if server is not None:
            server.close()

    def _close_metrics(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            http.shutdown()
            http.server_close()
