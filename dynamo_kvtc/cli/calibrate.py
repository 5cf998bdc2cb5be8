"""``dynamo-kvtc calibrate`` (the work: :mod:`dynamo_kvtc.calibration.runner`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "calibrate a model: cross-layer PCA + DP plans"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded name, HF directory or GGUF file")
    p.add_argument(
        "--data",
        nargs="*",
        type=types.existing_file,
        default=None,
        help="text files (default: the embedded calibration split)",
    )
    p.add_argument("--tokens", type=types.positive_int, default=65536, help="calibration tokens (sinks excluded)")
    p.add_argument("--ratios", type=types.ratios, default=(8, 16, 32, 64))
    p.add_argument(
        "--layer-groups",
        type=types.positive_ints,
        default=[1],
        help="consecutive layers per basis: G groups (default 1, the joint basis); a list (1,2,3) captures once and "
        "writes one calibration per G to OUT/G<n>",
    )
    p.add_argument("--rank", type=types.positive_int, default=None, help="cap on retained PCA components")
    p.add_argument("--dp-tokens", type=types.positive_int, default=16384)
    p.add_argument("--seq-len", type=types.positive_int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp-rank", type=types.nonneg_int, default=0)
    p.add_argument("--tp-size", type=types.positive_int, default=1)
    p.add_argument("--keep-rope", action="store_true", help="ablation: do not remove RoPE from keys")
    p.add_argument(
        "--checkpoint-every", type=types.positive_int, default=16384, help="tokens between resumable checkpoints"
    )
    p.add_argument("--stop-after-tokens", type=types.nonneg_int, default=0, help=argparse.SUPPRESS)  # tests
    p.add_argument("--out", required=True, help="output calibration directory")


def run(args: argparse.Namespace) -> int:
    from ..calibration.runner import run_calibrate

    return run_calibrate(args)
