"""``dynamo-kvtc bench transfer`` (the work: :mod:`dynamo_kvtc.bench.transfer`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "prefill->decode hand-off over NIXL: compressed blobs vs raw KV, two processes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes", type=types.shapes, default="smollm2-135m", help="comma-separated: " + ", ".join(types.shape_names())
    )
    p.add_argument("--tokens", type=types.positive_ints, default="2048", help="comma-separated prompt lengths")
    p.add_argument("--prefill-device", default="cpu")
    p.add_argument("--decode-device", default="cpu")
    p.add_argument("--ratio", type=types.positive_float, default=16.0)
    p.add_argument("--rank", type=types.positive_int, default=1024, help="PCA components of the synthetic calibration")
    p.add_argument("--repeat", type=types.positive_int, default=3)
    p.add_argument("--timeout", type=types.positive_float, default=120.0)
    p.add_argument("--json", dest="json_path", help="write results as JSON")


def run(args: argparse.Namespace) -> int:
    from ..bench.transfer import run_bench_transfer

    return run_bench_transfer(args)
