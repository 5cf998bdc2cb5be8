"""``dynamo-kvtc bench cluster``: every (workload, workers, router, system) run, the targets, the JSON."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from typing import Any

from ...errors import ConfigError
from ..output import machine, write_json
from .costs import Costs, load_costs, token_bytes
from .routers import ROUTERS
from .sim import simulate
from .systems import SYSTEMS, Layout, Memory
from .workloads import WORKLOADS, build

__all__ = ["run_bench_cluster", "targets"]

log = logging.getLogger(__name__)

TARGET_WORKERS = 64


def _pick(runs: list[dict[str, Any]], workload: str, workers: int, router: str, system: str) -> dict[str, Any] | None:
    for r in runs:
        if (r["workload"], r["workers"], r["router"], r["system"]) == (workload, workers, router, system):
            return r
    return None


def targets(runs: list[dict[str, Any]], workers: int = TARGET_WORKERS) -> list[dict[str, Any]]:
    """At ``workers`` workers, per workload and router: the kvtc pool's hit rate >= 1.5x the per-node kvtc tiers'
    and >= 2x the raw pool's, and its network bytes per restored token <= 1/12 of the raw pool's."""
    out: list[dict[str, Any]] = []
    for wl in sorted({r["workload"] for r in runs}):
        for router in sorted({r["router"] for r in runs}):
            pk, nk, pr = (_pick(runs, wl, workers, router, s) for s in ("pool-kvtc", "node-kvtc", "pool-raw"))
            if pk is None:
                continue

            def row(name: str, value: float | None, goal: float, higher: bool, wl=wl, router=router) -> None:
                met = None if value is None else bool(value >= goal if higher else value <= goal)
                out.append({"workload": wl, "router": router, "workers": workers, "target": name,
                            "measured": value, "goal": goal, "met": met})  # fmt: skip
                if value is None:  # the raw pool restored no token: there is nothing to compare with
                    out[-1]["note"] = "undefined: the raw pool restored no token"

            if nk is not None:
                row("hit rate: kvtc pool / per-node kvtc tiers >= 1.5", _ratio(pk["hit_rate"], nk["hit_rate"]), 1.5,
                    True)  # fmt: skip
            if pr is not None:
                row("hit rate: kvtc pool / raw pool >= 2", _ratio(pk["hit_rate"], pr["hit_rate"]), 2.0, True)
                a = pk.get("network", {}).get("bytes_per_restored_token")
                b = pr.get("network", {}).get("bytes_per_restored_token")
                row("network bytes per restored token: kvtc pool / raw pool <= 1/12", _ratio(a, b), 1 / 12, False)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return float("inf") if b == 0 else a / b


def _costs(args: argparse.Namespace) -> Costs:
    shape, (batch, tokens) = args.shape, args.gpu_config
    if args.measure_loopback:
        from .loopback import measure_loopback

        raw, kvtc = token_bytes(args.gpu_json, shape, batch, tokens)
        log.info("timing TCP loopback put/get (raw %.0f B/token, kvtc %.0f B/token)", raw, kvtc)
        data = measure_loopback(raw, kvtc)
        data.update(
            {
                "bench": "pool",
                "machine": machine(),
                "command": _command(),
                "derived_from": {"gpu_json": str(args.gpu_json), "gpu_config": f"{shape} {batch}x{tokens}"},
            }
        )
        write_json(args.measure_loopback, data)  # fmt: skip
        args.pool_json = args.measure_loopback
    if not args.pool_json:
        raise ConfigError(
            "bench cluster needs the pool's measured costs: pass --pool-json PATH (a `dynamo-kvtc bench pool` JSON) "
            "or --measure-loopback PATH (time TCP loopback here and write such a file)"
        )
    return load_costs(args.gpu_json, args.pool_json, shape, batch, tokens)


def _command() -> str:
    return "dynamo-kvtc " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def run_bench_cluster(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    costs = _costs(args)
    memory = Memory(args.gpu_kv_gb, args.host_gb, args.block_tokens)
    runs: list[dict[str, Any]] = []
    workloads: dict[str, Any] = {}
    known = {k for wl in args.workloads for k in WORKLOADS[wl]}
    unknown = sorted(set(args.param) - known)
    if unknown:
        raise ConfigError(f"no workload of {', '.join(args.workloads)} has the parameter {', '.join(unknown)}")
    for wl in args.workloads:
        params = {k: v for k, v in args.param.items() if k in WORKLOADS[wl]}  # each workload takes its own
        for n in args.workers:
            reqs, desc = build(wl, n, args.seed, **params)
            workloads[f"{wl}/{n}"] = desc
            log.info("%s on %d workers: %d requests", wl, n, len(reqs))
            bar = tqdm(total=len(reqs) * len(args.routers) * len(args.systems), desc=f"{wl} N={n}", unit="req",
                       disable=args.no_progress, dynamic_ncols=True)  # fmt: skip
            for router in args.routers:
                for system in args.systems:
                    layout = Layout(SYSTEMS[system], memory, costs, n)
                    res = simulate(reqs, layout, ROUTERS[router](), costs, tick=bar.update)
                    s = {"workload": wl, **res.summary(layout)}
                    runs.append(s)
                    log.info("%s N=%d %s %s: hit %.3f, TTFT mean %.3f s p99 %.3f s (%.1f s)", wl, n, router, system,
                             s["hit_rate"], s["ttft_s"]["mean"], s["ttft_s"]["p99"], s["wall_s"])  # fmt: skip
            bar.close()
    tg = targets(runs)
    for t in tg:
        log.info("target %s %s: %s = %s (%s)", t["workload"], t["router"], t["target"], t["measured"],
                 {True: "met", False: "missed", None: "undefined"}[t["met"]])  # fmt: skip
    out = {
        "bench": "cluster",
        "machine": machine(),
        "command": _command(),
        "cost_files": costs.sources,
        "costs": costs.to_json(),
        "memory_per_worker": {"gpu_kv_gb": memory.gpu_kv_gb, "host_gb": memory.host_gb,
                              "block_tokens": memory.block_tokens},
        "systems": {k: v.doc for k, v in SYSTEMS.items() if k in args.systems},
        "workloads": workloads,
        "runs": runs,
        "targets": tg,
    }  # fmt: skip
    write_json(args.json_path, out)
    if args.plot:
        from .report import plot

        msg = plot(runs, args.plot)
        if msg:
            log.warning("%s", msg)
    return 0
