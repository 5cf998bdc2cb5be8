"""``dynamo-kvtc bench tiers`` (the work: :mod:`dynamo_kvtc.bench.tiers`)."""

from __future__ import annotations

import argparse

from . import types
from .bench_codec import add_inputs, add_store_shape

HELP = "offload/onboard throughput, time to first layer vs all layers"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_inputs(p)
    p.add_argument("--ratios", type=types.ratios, default=None, help="the ratio to store at (first value)")
    add_store_shape(p)
    p.add_argument(
        "--disk-dir", type=types.existing_dir, default=None, help="where the disk tier's temporary directory goes"
    )
    p.add_argument("--repeat", type=types.positive_int, default=3)
    p.add_argument(
        "--conversations",
        default="",
        help="multi-turn workloads to store, comma-separated (lmbench, chat4k, demo): each reports its effective "
        "ratio (raw / stored bytes held) against the one-raw-window bound",
    )
    p.add_argument("--conversations-only", action="store_true", help="skip the single-span offload/onboard timings")
    p.add_argument("--json", dest="json_path")


def run(args: argparse.Namespace) -> int:
    from ..bench.tiers import run_bench_tiers

    return run_bench_tiers(args)
