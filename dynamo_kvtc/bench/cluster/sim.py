"""The event-driven simulator: requests arrive, the router picks a worker, the worker restores what it can find
(HBM, its own tier, the pool) and recomputes the rest, then saves the conversation when the reply is done.

Each worker is one FIFO prefill queue: a request waits for the work assigned before it, then takes restore time
(tokens x the measured restore cost of the place they come from) plus recompute time (missed tokens x the measured
prefill cost); its TTFT is that wait plus that time. The reply then takes ``output tokens x decode step``; at its
end the prompt and reply are saved: into the worker's HBM (LRU) and, written through, into its own tier or the pool
(a put moves the new blocks over the network). A turn does not start before the turn it follows has finished.
Not modelled: decode steps sharing the GPU with prefills, the GPU time of compressing a saved blob, and a pool read
from a worker's own segment (every pool read is counted as network traffic).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .costs import Costs
from .routers import Router
from .systems import Layout
from .workloads import SimRequest

__all__ = ["RunResult", "Cluster", "simulate"]


@dataclass
class RunResult:
    """What one (system, router) run measured."""

    system: str
    router: str
    workers: int
    requests: int = 0
    prompt_tokens: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: {"hbm": 0, "local": 0, "pool": 0, "miss": 0})
    ttft: list[float] = field(default_factory=list)
    pool_get_bytes: float = 0.0
    pool_put_bytes: float = 0.0
    local_put_bytes: float = 0.0
    pool_peak_blocks: int = 0
    moved: int = 0  # turns served on a different worker than the session's previous turn
    end_s: float = 0.0
    wall_s: float = 0.0

    def summary(self, layout: Layout) -> dict[str, Any]:
        n = max(1, self.prompt_tokens)
        tt = np.asarray(self.ttft) if self.ttft else np.zeros(1)
        pool_tokens = self.tokens["pool"]
        duration = max(self.end_s, 1e-9)
        block = layout.block_bytes
        out: dict[str, Any] = {
            "system": self.system,
            "router": self.router,
            "workers": self.workers,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_rate": round(1 - self.tokens["miss"] / n, 5),
            "hit_by_source": {k: round(v / n, 5) for k, v in self.tokens.items()},
            "ttft_s": {"mean": float(tt.mean()), "p50": float(np.percentile(tt, 50)),
                       "p99": float(np.percentile(tt, 99))},
            "moved_turns": self.moved,
            "tier_capacity_gb": layout.tier_capacity_blocks() * block / 1e9,
            "simulated_s": round(duration, 3),
            "wall_s": round(self.wall_s, 3),
        }  # fmt: skip
        if layout.pool is not None:
            out["pool_gb"] = {"capacity": layout.pool.capacity * block / 1e9, "peak": self.pool_peak_blocks * block
                              / 1e9, "end": layout.pool.used * block / 1e9}  # fmt: skip
            out["pool_evicted_gb"] = layout.pool.evicted_blocks * block / 1e9
            net = self.pool_get_bytes + self.pool_put_bytes
            out["network"] = {
                "get_gb": self.pool_get_bytes / 1e9,
                "put_gb": self.pool_put_bytes / 1e9,
                "gbps_per_worker": net / duration / self.workers / 1e9,
                "get_gbps_per_worker": self.pool_get_bytes / duration / self.workers / 1e9,
                "bytes_per_restored_token": self.pool_get_bytes / pool_tokens if pool_tokens else None,
            }
        return out


class Cluster:
    """The state a router sees: each worker's queue end (``free``), who holds which session, the caches."""

    def __init__(self, layout: Layout, costs: Costs):
        self.layout, self.costs = layout, costs
        self.free = np.zeros(layout.workers)
        self._holders: dict[str, set[int]] = {}
        self.block = layout.memory.block_tokens

    def holders(self, session: str) -> set[int]:
        return self._holders.get(session, set())

    def lookup(self, w: int, req: SimRequest) -> tuple[int, int, int]:
        """Blocks of ``req``'s prompt that worker ``w`` finds in HBM, its own tier and the pool (a prefix:
        a stream counts only after every earlier stream was found whole)."""
        lay, b = self.layout, self.block
        hbm, local, pool = lay.hbm[w], (lay.local[w] if lay.local is not None else None), lay.pool
        nh = nl = np_ = 0
        for key, tokens in req.streams:
            full = tokens // b
            h = min(hbm.get(key), full)
            lo = min(local.get(key), full) if local is not None else 0
            p = min(pool.get(key), full) if pool is not None else 0
            best = max(h, lo, p)
            nh += h
            nl += max(0, lo - h)
            np_ += max(0, p - max(h, lo))
            if best < full:
                break
        return nh, nl, np_

    def plan(self, w: int, req: SimRequest) -> tuple[int, int, int, int, float]:
        """Blocks from HBM, own tier, pool; tokens to recompute; and the prefill time of ``req`` on ``w``."""
        nh, nl, np_ = self.lookup(w, req)
        b = self.block
        miss = req.prompt_tokens - (nh + nl + np_) * b
        lay = self.layout
        return nh, nl, np_, miss, nl * b * lay.local_s + np_ * b * lay.pool_s + miss * self.costs.recompute_s

    def service_s(self, w: int, req: SimRequest) -> float:
        return self.plan(w, req)[4]

    def start(self, w: int, req: SimRequest) -> None:
        """The prefill on ``w``: every prompt stream is on its GPU afterwards; what it read is recently used."""
        lay, b = self.layout, self.block
        for key, tokens in req.streams:
            lay.hbm[w].put(key, tokens // b)
            if lay.local is not None:
                lay.local[w].touch(key)
            if lay.pool is not None:
                lay.pool.touch(key)

    def save(self, w: int, req: SimRequest, res: RunResult) -> None:
        """The reply is done: the prompt and reply are saved to HBM and written through to the tier or pool."""
        lay, b = self.layout, self.block
        last = len(req.streams) - 1
        for i, (key, tokens) in enumerate(req.streams):
            blocks = (tokens + (req.output_tokens if i == last else 0)) // b
            lay.hbm[w].put(key, blocks)
            if lay.pool is not None:
                res.pool_put_bytes += lay.pool.put(key, blocks) * lay.block_bytes
            elif lay.local is not None:
                res.local_put_bytes += lay.local[w].put(key, blocks) * lay.block_bytes
        if lay.pool is not None:
            res.pool_peak_blocks = max(res.pool_peak_blocks, lay.pool.used)
        self._holders.setdefault(req.session, set()).add(w)


def simulate(
    requests: list[SimRequest], layout: Layout, router: Router, costs: Costs, tick: Callable[[int], None] | None = None
) -> RunResult:
    """Run ``requests`` (arrival order) through ``router`` onto ``layout``'s caches."""
    t0 = time.perf_counter()
    cl = Cluster(layout, costs)
    b = layout.memory.block_tokens
    res = RunResult(layout.system.name, router.name, layout.workers)
    done_at = [-1.0] * len(requests)
    last_worker: dict[str, int] = {}
    events: list[tuple[float, int, int, int]] = [(r.arrival_s, 1, i, -1) for i, r in enumerate(requests)]
    heapq.heapify(events)  # (time, kind: 0 = reply done before 1 = arrival at the same time, request, worker)
    served = 0
    while events:
        t, kind, i, w = heapq.heappop(events)
        req = requests[i]
        if kind == 0:
            cl.save(w, req, res)
            res.end_s = max(res.end_s, t)
            continue
        if req.after >= 0 and done_at[req.after] > t:  # the previous turn is still running: come back then
            heapq.heappush(events, (done_at[req.after], 1, i, -1))
            continue
        w = router.choose(t, req, cl)
        nh, nl, np_, miss, service = cl.plan(w, req)
        begin = max(t, float(cl.free[w]))
        cl.free[w] = begin + service
        cl.start(w, req)
        done = begin + service + req.output_tokens * costs.decode_step_s
        done_at[i] = done
        heapq.heappush(events, (done, 0, i, w))
        res.requests += 1
        res.prompt_tokens += req.prompt_tokens
        tok = res.tokens
        tok["hbm"] += nh * b
        tok["local"] += nl * b
        tok["pool"] += np_ * b
        tok["miss"] += miss
        res.pool_get_bytes += np_ * layout.block_bytes if layout.pool is not None else 0.0
        res.ttft.append(begin - t + service)
        prev = last_worker.get(req.session)
        if prev is not None and prev != w:
            res.moved += 1
        last_worker[req.session] = w
        served += 1
        if tick is not None and served % 1000 == 0:
            tick(1000)
    if tick is not None:
        tick(served % 1000)
    res.wall_s = time.perf_counter() - t0
    return res
