"""``dynamo-kvtc eval`` (the work: :mod:`dynamo_kvtc.evaluation.runner`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "offline accuracy: kvtc vs baselines on held-out tasks (JSON, Markdown, PNG)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--calibration", type=types.existing_dir, help="calibration directory (default: the shipped one)")
    p.add_argument("--preset", choices=("quick", "short", "full"), default="quick")
    p.add_argument("--tasks", nargs="*", choices=("ppl", "passkey", "copy", "kv", "vt"))
    p.add_argument(
        "--ratios", type=types.ratios, default=None, help="kvtc ratios (default: every plan in the calibration)"
    )
    p.add_argument(
        "--ablation", action="append", type=types.name_eq_dir, metavar="NAME=DIR", help="extra calibration at 16x"
    )
    p.add_argument(
        "--ablations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sinks-compressed and window-16 rows (default: on for the full preset)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output folder")


def run(args: argparse.Namespace) -> int:
    from ..evaluation.runner import run_eval

    return run_eval(args)
