"""``dynamo-kvtc bench gpu`` (the work: :mod:`dynamo_kvtc.bench.gpu`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "GPU speed: fused compress/restore vs raw restore and recompute, one run"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", type=types.shapes, default="mistral-nemo-12b,llama-3.1-8b,llama-3.3-70b-pp20")
    p.add_argument(
        "--configs", type=types.batch_tokens, default="8x8192,2x16384", help="batch x tokens, comma-separated"
    )
    p.add_argument("--ratio", type=types.positive_float, default=16.0)
    p.add_argument("--tag", default=None, help="entropy codec (default: the GPU default, see docs/performance.md)")
    p.add_argument("--block-size", type=types.positive_int, default=16)
    p.add_argument("--repeat", type=types.positive_int, default=3)
    p.add_argument(
        "--layer-groups", type=types.positive_int, default=4, help="also run NeMo with this many layer groups (1: no)"
    )
    p.add_argument(
        "--codec-sms",
        type=types.positive_ints,
        default="16,32,64",
        help="interference curve: also run the codec in a green context of each of these SM counts",
    )
    p.add_argument("--cpu-tokens", type=types.positive_int, default=256, help="coded tokens of the 2-core CPU decode")
    p.add_argument(
        "--budget-s", type=types.positive_float, default=420.0, help="skip optional parts once this is spent"
    )
    p.add_argument(
        "--skip",
        type=lambda v: [x.strip() for x in v.split(",") if x.strip()],
        default=[],
        help="optional parts not to run, comma-separated: 'nvCOMP sync check', 'overlap check', 'codec choice', "
        "'layer-group variant', 'cpu path'",
    )
    p.add_argument(
        "--kv-dtype",
        choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        default="auto",
        help="also restore each configuration into an FP8 paged cache and compare with a raw copy of that FP8 cache",
    )
    p.add_argument("--plot", dest="plot_path", help="write a PNG of TTFT and compress/decompress vs the paper")
    p.add_argument("--json", dest="json_path")


def run(args: argparse.Namespace) -> int:
    from ..bench.gpu import run_bench_gpu

    return run_bench_gpu(args)
