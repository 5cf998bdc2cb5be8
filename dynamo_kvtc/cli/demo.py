"""``dynamo-kvtc demo`` (the work: :mod:`dynamo_kvtc.demo.serving`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "multi-turn chat on a real vLLM engine restoring history from the compressed tier"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--calibration", type=types.existing_dir, help="calibration directory (default: the shipped one)")
    p.add_argument(
        "--ratio",
        type=types.ratio_or_auto,
        default=16.0,
        help="compression ratio, or auto: the calibration's checked ratio (default 16)",
    )
    p.add_argument("--cpu-cache-gb", type=types.positive_float, default=1.0, help="compressed host tier size")
    p.add_argument(
        "--tokens", type=types.positive_int, default=1500, help="length of the essay the conversation is about"
    )
    p.add_argument("--turns", type=types.positive_int, default=3)
    p.add_argument("--max-tokens", type=types.positive_int, default=32, help="reply length per turn (greedy)")
    p.add_argument("--json", dest="json_path", help="also write the per-turn results as JSON")


def run(args: argparse.Namespace) -> int:
    from ..demo.serving import run_demo

    return run_demo(args)
