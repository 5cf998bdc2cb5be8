"""``dynamo-kvtc eval`` (the work: :mod:`dynamo_kvtc.evaluation.sweep`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "offline accuracy: kvtc vs baselines on held-out tasks (JSON, Markdown, PNG)"


PROJECTIONS = ("fp16", "fp8")
# evaluation.tasks.PRESETS and TASKS (listed here: `dynamo-kvtc --help` must not import torch; a test checks they agree)
PRESETS = ("quick", "short", "fidelity", "ruler", "long", "haystacks", "full")
TASKS = ("ppl", "passkey", "copy", "kv", "vt", "gen", "mkey", "mvalue")


def projections(s: str) -> tuple[str, ...]:
    """Comma-separated projection precisions (``fp16,fp8``)."""
    out = tuple(dict.fromkeys(x.strip() for x in s.split(",") if x.strip()))
    bad = [x for x in out if x not in PROJECTIONS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"projections are comma-separated {' or '.join(PROJECTIONS)}, got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--calibration", type=types.existing_dir, help="calibration directory (default: the shipped one)")
    p.add_argument("--preset", choices=PRESETS, default="quick")
    p.add_argument("--tasks", nargs="*", choices=TASKS)
    p.add_argument(
        "--lengths",
        type=types.positive_ints,
        default=None,
        help="only the preset's samples of these context lengths (comma-separated, e.g. 4096,7500,8000)",
    )
    p.add_argument(
        "--ratios", type=types.ratios, default=None, help="kvtc ratios (default: every plan in the calibration)"
    )
    p.add_argument(
        "--ablation",
        action="append",
        type=types.name_eq_dir,
        metavar="NAME=DIR",
        help="extra calibration, rows kvtc-<r>x-NAME (at 16x unless --ablation-ratios)",
    )
    p.add_argument(
        "--ablation-ratios", type=types.ratios, default=None, help="ratios of the --ablation rows (e.g. 16,32)"
    )
    p.add_argument(
        "--projections",
        type=projections,
        default=("fp16",),
        help="kvtc projection precisions, comma-separated: fp16 (the float32 reference), fp8 (emulated e4m3 GEMM "
        "operands); fp8 adds kvtc-<r>x-fp8 rows for the calibration and every --ablation",
    )
    p.add_argument(
        "--baselines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FP8, int8, KIVI and DEFLATE rows (vanilla is always run)",
    )
    p.add_argument(
        "--ablations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sinks-compressed and window-16 rows (default: on for the full preset)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        default="auto",
        help="the engine's KV cache dtype: fp8 rounds every method's input and output through FP8 (scale 1.0, vLLM's "
        "default); vanilla is then the FP8-KV baseline and ratios are stated against the FP8 cache",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output folder")


def run(args: argparse.Namespace) -> int:
    from ..evaluation.sweep import run_eval

    return run_eval(args)
