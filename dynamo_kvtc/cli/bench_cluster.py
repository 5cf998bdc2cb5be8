"""``dynamo-kvtc bench cluster`` (the work: :mod:`dynamo_kvtc.bench.cluster`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from . import types

HELP = "trace-driven simulation of N workers behind a router: per-node raw/kvtc tiers vs a raw/kvtc pool"

EPILOG = """\
workloads (seeded generators, scaled with the number of workers; --param KEY=VALUE sets one):
  qa        LMBenchmark multi-round QA: users_per_worker x N users, 20 rounds, a 1,000-token shared system prompt,
            20,000-token histories, 100-token questions and answers, Poisson arrivals at qps_per_worker x N
            (users_per_worker=15 rounds=20 system=1000 history=20000 question=100 answer=100 qps_per_worker=0.5)
  mooncake  sessions shaped after the Mooncake FAST'25 conversation trace (~12K mean input, ~330 mean output, each
            turn reusing the whole earlier conversation) (sessions_per_worker=40 qps_per_worker=0.5)

systems (equal memory per worker: --gpu-kv-gb of HBM for KV, --host-gb of host memory):
  node-raw   each worker's host memory is its own raw tier
  node-kvtc  each worker's host memory is its own kvtc tier (the measured effective ratio x more tokens)
  pool-raw   the host memory of all workers is one shared pool of raw blocks
  pool-kvtc  the same pool holding sealed kvtc blobs

routers: round-robin (cache-blind), kv-aware (lowest estimated TTFT: queue + restore + recompute; the pool's blocks
count for every worker).

costs (never constants in code): --gpu-json (a `bench gpu` file: recompute, restore and decode times per token, raw
bytes per token, the effective kvtc ratio) and --pool-json (a `bench pool` file: pool put/get GB/s and stored bytes
per token), or --measure-loopback PATH to time TCP loopback here and write such a file first.
"""


def _names(table: dict) -> Callable[[str], list[str]]:
    def parse(s: str) -> list[str]:
        out = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in out if x not in table]
        if not out or bad:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(table)}; got {s!r}")
        return out

    return parse


def _batch_tokens(s: str) -> tuple[int, int]:
    out = types.batch_tokens(s)
    if len(out) != 1:
        raise argparse.ArgumentTypeError(f"one BATCHxTOKENS expected, got {s!r}")
    return out[0]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.cluster.routers import ROUTERS
    from ..bench.cluster.systems import SYSTEMS
    from ..bench.cluster.workloads import WORKLOADS

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--workloads", type=_names(WORKLOADS), default=list(WORKLOADS), help="comma-separated")
    p.add_argument("--workers", type=types.positive_ints, default=[8, 64, 512], help="comma-separated worker counts")
    p.add_argument("--routers", type=_names(ROUTERS), default=list(ROUTERS), help="comma-separated")
    p.add_argument("--systems", type=_names(SYSTEMS), default=list(SYSTEMS), help="comma-separated")
    p.add_argument("--param", type=types.key_value, action="append", help="a workload parameter, KEY=VALUE")
    p.add_argument("--seed", type=types.nonneg_int, default=0)
    p.add_argument("--gpu-kv-gb", type=types.positive_float, default=16.0, help="HBM for KV per worker, GB")
    p.add_argument("--host-gb", type=types.positive_float, default=32.0, help="host memory per worker, GB")
    p.add_argument("--block-tokens", type=types.positive_int, default=256, help="the simulator's block, tokens")
    p.add_argument(
        "--gpu-json",
        type=types.existing_file,
        default="docs/results/bench-gpu-h200.json",
        help="bench gpu results: recompute/restore/decode costs, raw bytes per token, kvtc ratio",
    )
    p.add_argument("--shape", default="mistral-nemo-12b", help="the model shape of the bench gpu entry")
    p.add_argument("--gpu-config", type=_batch_tokens, default=(2, 16384), help="its BATCHxTOKENS entry")
    p.add_argument("--pool-json", type=types.existing_file, default=None, help="bench pool results (pool costs)")
    p.add_argument(
        "--measure-loopback",
        metavar="PATH",
        default=None,
        help="time TCP loopback put/get and AES-GCM here, write a bench-pool-shaped file to PATH, use it",
    )
    p.add_argument("--json", dest="json_path", help="write results as JSON")
    p.add_argument("--plot", help="write the hit-rate plot here (PNG; TTFT next to it as <stem>-ttft.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from ..bench.cluster.run import run_bench_cluster

    args.param = dict(args.param or [])
    return run_bench_cluster(args)
