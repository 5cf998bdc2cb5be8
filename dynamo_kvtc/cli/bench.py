"""``dynamo-kvtc bench ...``: the benchmark commands, one module each (the work: :mod:`dynamo_kvtc.bench`)."""

from __future__ import annotations

import argparse

HELP = "benchmarks (JSON output)"

# subcommand -> module of dynamo_kvtc.cli (in the order of `dynamo-kvtc bench --help`)
BENCHMARKS = {
    "chaos": "bench_chaos",
    "transfer": "bench_transfer",
    "codec": "bench_codec",
    "tiers": "bench_tiers",
    "pool": "bench_pool",
    "gpu": "bench_gpu",
    "serve": "bench_serve",
    "cluster": "bench_cluster",
    "calibrate": "bench_calibrate",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .main import add_commands

    add_commands(p, BENCHMARKS, "bench")
