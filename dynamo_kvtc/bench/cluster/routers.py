"""Router policies: which worker a request goes to.

- ``round-robin``: worker i mod N for the i-th request (what a cache-blind balancer does; conversations move).
- ``kv-aware``: the worker with the lowest estimated time to first token = its queue (seconds of prefill already
  assigned) + the restore and recompute this request needs there. Its cached prefix counts (HBM, its own tier, and
  the pool, whose blocks are available to every worker), so it picks the longest cached prefix unless load outweighs
  it (Dynamo's KV router: overlap score with a load term). Only workers that hold the session and the least loaded
  worker are candidates (any other worker can offer only what the pool offers every worker, at a longer queue).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["ROUTERS", "Router", "RoundRobin", "KvAware"]


class ClusterView(Protocol):
    free: np.ndarray  # when each worker's prefill queue empties, seconds

    def holders(self, session: str) -> set[int]: ...

    def service_s(self, worker: int, req) -> float: ...


class Router:
    name = ""

    def choose(self, t: float, req, view: ClusterView) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, t: float, req, view: ClusterView) -> int:
        w = self.next % len(view.free)
        self.next += 1
        return w


class KvAware(Router):
    name = "kv-aware"

    def choose(self, t: float, req, view: ClusterView) -> int:
        free = view.free
        idle = int(np.argmin(free))
        best, best_cost = idle, max(0.0, free[idle] - t) + view.service_s(idle, req)
        for w in view.holders(req.session):
            if w == idle:
                continue
            cost = max(0.0, free[w] - t) + view.service_s(w, req)
            if cost < best_cost:
                best, best_cost = w, cost
        return best


ROUTERS = {"round-robin": RoundRobin, "kv-aware": KvAware}
