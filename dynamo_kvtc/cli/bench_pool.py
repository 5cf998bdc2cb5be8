"""``dynamo-kvtc bench pool`` (the work: :mod:`dynamo_kvtc.bench.pool`)."""

from __future__ import annotations

import argparse

from . import types
from .bench_codec import add_inputs, add_store_shape

HELP = "the cluster pool tier on Mooncake Store: put/get GB/s and restore latency, kvtc sealed vs raw, seal cost"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_inputs(p)
    p.add_argument("--ratios", type=types.ratios, default=None, help="the ratio to store at (first value)")
    add_store_shape(p)
    p.add_argument("--master", default=None, help="mooncake_master host:port (default: start one on loopback)")
    p.add_argument("--metadata-server", default=None, help="its metadata server URL (with --master)")
    p.add_argument("--segment-gb", type=float, default=1.0, help="memory each of the two stores contributes")
    p.add_argument("--repeat", type=types.positive_int, default=5)
    p.add_argument("--layer-groups", type=types.positive_int, default=4,
                   help="also stream a synthetic calibration of --shape with this many layer groups (1: no)")
    p.add_argument("--shape", default="smollm2-135m", help="that calibration's model shape (bench/shapes.py)")
    p.add_argument("--json", dest="json_path")


def run(args: argparse.Namespace) -> int:
    from ..bench.pool import run_bench_pool

    return run_bench_pool(args)
