"""``dynamo-kvtc bench calibrate`` (the work: :mod:`dynamo_kvtc.bench.calibrate`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "calibration wall time (load, capture, PCA, DP, save), tokens/s, peak GPU and host memory per model shape"


def models(s: str) -> list[str]:
    """Comma-separated model shapes (``llama-3.1-8b``, ``llama-3.1-70b@40`` = its first 40 layers) or any
    ``calibrate --model`` value."""
    out = [x.strip() for x in s.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError("at least one model shape expected")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes",
        type=models,
        default=["llama-3.1-8b"],
        help="model shapes, random weights (smollm2-135m, llama-3.1-8b, mistral-nemo-12b, llama-3.1-70b; NAME@L: the "
        "first L layers), or any calibrate --model value (a real model), comma-separated",
    )
    p.add_argument("--tokens", type=types.positive_int, default=200000, help="calibration tokens per model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    p.add_argument("--ratios", type=types.ratios, default=(8, 16, 32, 64))
    p.add_argument("--rank", type=types.positive_int, default=None, help="PCA rank cap (default: up to 10240)")
    p.add_argument("--dp-tokens", type=types.positive_int, default=16384)
    p.add_argument("--seq-len", type=types.positive_int, default=2048)
    p.add_argument(
        "--checkpoint-every",
        type=types.positive_int,
        default=None,
        help="tokens between checkpoints (default: none; the JSON's checkpoint_gib is what each would write)",
    )
    p.add_argument("--reference", type=types.existing_dir, help="compare every calibration with this one")
    p.add_argument("--out-dir", help="keep the calibrations here (default: a temporary folder)")
    p.add_argument("--budget-s", type=float, default=0, help="stop starting models (and stop one) past this many s")
    p.add_argument("--in-process", action="store_true", help="no child process per model (peaks are then shared)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", dest="json_path", help="write results as JSON")


def run(args: argparse.Namespace) -> int:
    from ..bench.calibrate import run_bench_calibrate

    return run_bench_calibrate(args)
