"""``dynamo-kvtc codec-demo`` (the work: :mod:`dynamo_kvtc.demo.codec`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "calibrate -> encode -> decode on the embedded default model, no engine"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--calibration",
        type=types.existing_dir,
        help="calibration directory (default: shipped or cached, else calibrated now)",
    )
    p.add_argument("--tokens", type=types.positive_int, default=2048, help="held-out context length to compress")
    p.add_argument("--ratios", type=types.ratios, default=None, help="ratios to show (default: all in the calibration)")
    p.add_argument("--json", dest="json_path", help="also write the results as JSON")


def run(args: argparse.Namespace) -> int:
    from ..demo.codec import run_codec_demo

    return run_codec_demo(args)
