"""``dynamo-kvtc bench codec`` (the work: :mod:`dynamo_kvtc.bench.codec`)."""

from __future__ import annotations

import argparse

from ..codec.entropy.registry import PORTABLE, tags
from . import types

HELP = "encode/decode throughput per stage, ratio and reconstruction error"


def add_inputs(p: argparse.ArgumentParser) -> None:
    """Where the KV comes from (shared with ``bench tiers``): a calibration and captured or saved KV, or a shape."""
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--calibration", type=types.existing_dir, help="calibration directory (real data: needs --kv or the model)"
    )
    p.add_argument(
        "--kv",
        type=types.existing_file,
        help="safetensors file with keys, values, positions (default: capture from --model)",
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--synthetic",
        type=types.shape,
        help="synthetic shape instead of a real model: " + ", ".join(types.shape_names()),
    )
    p.add_argument("--tokens", type=types.positive_int, default=2048)
    p.add_argument("--batch", type=types.positive_int, default=1, help="spans per measurement (synthetic only)")


def add_store_shape(p: argparse.ArgumentParser) -> None:
    """How a store saves the KV (shared by ``bench tiers``, ``bench pool`` and ``bench serve``): block size, span and
    raw window."""
    p.add_argument("--block-size", type=types.positive_int, default=16)
    p.add_argument("--span-tokens", type=types.positive_int, default=1024)
    p.add_argument("--window", type=types.nonneg_int, default=128, help="raw tokens at the end of a saved sequence")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_inputs(p)
    p.add_argument("--ratios", type=types.ratios, default=None)
    p.add_argument("--tag", default=PORTABLE, choices=tags(), help=f"entropy codec (default: {PORTABLE})")
    p.add_argument("--repeat", type=types.positive_int, default=3)
    p.add_argument("--json", dest="json_path", help="write results as JSON")


def run(args: argparse.Namespace) -> int:
    from ..bench.codec import run_bench_codec

    return run_bench_codec(args)
