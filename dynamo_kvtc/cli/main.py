"""``dynamo-kvtc``: entry point and argument parsing (each command lives in its own module)."""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import KvtcError


def _ratios(s: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"ratios must be comma-separated numbers, got {s!r}") from None
    if not out or any(r <= 0 for r in out):
        raise argparse.ArgumentTypeError(f"ratios must be positive, got {s!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynamo-kvtc", description="KV Cache Transform Coding for NVIDIA Dynamo")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="multi-turn chat on a real vLLM engine restoring history from the compressed tier")
    d.add_argument("--model", default="smollm2-135m-instruct")
    d.add_argument("--calibration", help="calibration directory (default: the shipped one)")
    d.add_argument("--ratio", type=float, default=16.0)
    d.add_argument("--cpu-cache-gb", type=float, default=1.0, help="compressed host tier size")
    d.add_argument("--tokens", type=int, default=1500, help="length of the essay the conversation is about")
    d.add_argument("--turns", type=int, default=3)
    d.add_argument("--max-tokens", type=int, default=32, help="reply length per turn (greedy)")
    d.add_argument("--json", dest="json_path", help="also write the per-turn results as JSON")

    d = sub.add_parser("codec-demo", help="calibrate -> encode -> decode on the embedded default model, no engine")
    d.add_argument("--model", default="smollm2-135m-instruct")
    d.add_argument("--calibration", help="calibration directory (default: shipped or cached, else calibrated now)")
    d.add_argument("--tokens", type=int, default=2048, help="held-out context length to compress")
    d.add_argument("--ratios", type=_ratios, default=None, help="ratios to show (default: all in the calibration)")
    d.add_argument("--json", dest="json_path", help="also write the results as JSON")

    c = sub.add_parser("calibrate", help="calibrate a model: cross-layer PCA + DP plans")
    c.add_argument("--model", default="smollm2-135m-instruct", help="embedded name, HF directory or GGUF file")
    c.add_argument("--data", nargs="*", default=None, help="text files (default: the embedded calibration split)")
    c.add_argument("--tokens", type=int, default=65536, help="calibration tokens (sinks excluded)")
    c.add_argument("--ratios", type=_ratios, default=(8, 16, 32, 64))
    c.add_argument("--layer-groups", type=int, default=1)
    c.add_argument("--rank", type=int, default=None, help="cap on retained PCA components")
    c.add_argument("--dp-tokens", type=int, default=16384)
    c.add_argument("--seq-len", type=int, default=2048)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default="cpu")
    c.add_argument("--tp-rank", type=int, default=0)
    c.add_argument("--tp-size", type=int, default=1)
    c.add_argument("--keep-rope", action="store_true", help="ablation: do not remove RoPE from keys")
    c.add_argument("--checkpoint-every", type=int, default=16384, help="tokens between resumable checkpoints")
    c.add_argument("--stop-after-tokens", type=int, default=0, help=argparse.SUPPRESS)  # tests: simulate a stop
    c.add_argument("--out", required=True, help="output calibration directory")

    b = sub.add_parser("bench", help="benchmarks (JSON output)")
    bsub = b.add_subparsers(dest="bench", required=True)
    bx = bsub.add_parser("chaos", help="fault injection against the real tiers: wrong KV served, blocks lost, crashes")
    from .chaos import add_arguments as _chaos_arguments

    _chaos_arguments(bx)
    bt = bsub.add_parser(
        "transfer", help="prefill->decode hand-off over NIXL: compressed blobs vs raw KV, two processes"
    )
    bt.add_argument("--shapes", default="smollm2-135m", help="comma-separated: " + ", ".join(_synthetic_names()))
    bt.add_argument("--tokens", default="2048", help="comma-separated prompt lengths")
    bt.add_argument("--prefill-device", default="cpu")
    bt.add_argument("--decode-device", default="cpu")
    bt.add_argument("--ratio", type=float, default=16.0)
    bt.add_argument("--rank", type=int, default=1024, help="PCA components of the synthetic calibration")
    bt.add_argument("--repeat", type=int, default=3)
    bt.add_argument("--timeout", type=float, default=120.0)
    bt.add_argument("--json", dest="json_path", help="write results as JSON")
    bc = bsub.add_parser("codec", help="encode/decode throughput per stage, ratio and reconstruction error")
    bc.add_argument("--device", default="cpu")
    bc.add_argument("--calibration", help="calibration directory (real data: needs --kv or the model)")
    bc.add_argument("--kv", help="safetensors file with keys, values, positions (default: capture from --model)")
    bc.add_argument("--model", default="smollm2-135m-instruct")
    bc.add_argument("--synthetic", help="synthetic shape instead of a real model: " + ", ".join(_synthetic_names()))
    bc.add_argument("--tokens", type=int, default=2048)
    bc.add_argument("--batch", type=int, default=1, help="spans per measurement (synthetic only)")
    bc.add_argument("--ratios", type=_ratios, default=None)
    bc.add_argument("--tag", default="deflate")
    bc.add_argument("--repeat", type=int, default=3)
    bc.add_argument("--json", dest="json_path", help="write results as JSON")

    e = sub.add_parser("eval", help="offline accuracy: kvtc vs baselines on held-out tasks (JSON, Markdown, PNG)")
    e.add_argument("--model", default="smollm2-135m-instruct")
    e.add_argument("--calibration", help="calibration directory (default: the shipped one)")
    e.add_argument("--preset", choices=("quick", "short", "full"), default="quick")
    e.add_argument("--tasks", nargs="*", choices=("ppl", "passkey", "copy", "kv", "vt"))
    e.add_argument("--ratios", type=_ratios, default=None, help="kvtc ratios (default: every plan in the calibration)")
    e.add_argument("--ablation", action="append", metavar="NAME=DIR", help="extra calibration evaluated at 16x")
    e.add_argument(
        "--ablations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sinks-compressed and window-16 rows (default: on for the full preset)",
    )
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", required=True, help="output folder")

    bt = bsub.add_parser("tiers", help="offload/onboard throughput, time to first layer vs all layers")
    bt.add_argument("--device", default="cpu")
    bt.add_argument("--calibration")
    bt.add_argument("--kv")
    bt.add_argument("--model", default="smollm2-135m-instruct")
    bt.add_argument("--synthetic")
    bt.add_argument("--tokens", type=int, default=2048)
    bt.add_argument("--batch", type=int, default=1)
    bt.add_argument("--ratios", type=_ratios, default=None, help="the ratio to store at (first value)")
    bt.add_argument("--block-size", type=int, default=16)
    bt.add_argument("--span-tokens", type=int, default=1024)
    bt.add_argument("--window", type=int, default=128)
    bt.add_argument("--disk-dir", default=None, help="where the disk tier's temporary directory goes")
    bt.add_argument("--repeat", type=int, default=3)
    bt.add_argument("--json", dest="json_path")

    bg = bsub.add_parser("gpu", help="GPU speed: fused compress/restore vs raw restore and recompute, one run")
    bg.add_argument("--shapes", default="mistral-nemo-12b,llama-3.1-8b,llama-3.3-70b-pp20")
    bg.add_argument("--configs", default="8x8192,2x16384", help="batch x tokens, comma-separated")
    bg.add_argument("--ratio", type=float, default=16.0)
    bg.add_argument("--tag", default=None, help="entropy codec (default: the GPU default, see docs/performance.md)")
    bg.add_argument("--block-size", type=int, default=16)
    bg.add_argument("--repeat", type=int, default=3)
    bg.add_argument("--layer-groups", type=int, default=4, help="also run NeMo with this many layer groups (1: no)")
    bg.add_argument("--cpu-tokens", type=int, default=256, help="coded tokens of the 2-core CPU decode")
    bg.add_argument("--budget-s", type=float, default=420.0, help="skip optional parts once this is spent")
    bg.add_argument("--plot", dest="plot_path", help="write a PNG of TTFT and compress/decompress vs the paper")
    bg.add_argument("--json", dest="json_path")

    i = sub.add_parser("inspect", help="describe a calibration directory or a blob file")
    i.add_argument("path")
    return p


def _synthetic_names() -> list[str]:
    from .shapes import SHAPES

    return sorted(SHAPES)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args)
        if args.command == "codec-demo":
            from .codec_demo import run_codec_demo

            return run_codec_demo(args)
        if args.command == "calibrate":
            from .calibrate import run_calibrate

            return run_calibrate(args)
        if args.command == "bench" and args.bench == "tiers":
            from .bench import run_bench_tiers

            return run_bench_tiers(args)
        if args.command == "bench" and args.bench == "chaos":
            from .chaos import run_bench_chaos

            return run_bench_chaos(args)
        if args.command == "bench" and args.bench == "transfer":
            from .transfer_bench import run_bench_transfer

            return run_bench_transfer(args)
        if args.command == "bench" and args.bench == "gpu":
            from .bench import run_bench_gpu

            return run_bench_gpu(args)
        if args.command == "bench" and args.bench == "codec":
            from .bench import run_bench_codec

            return run_bench_codec(args)
        if args.command == "eval":
            from .eval import run_eval

            return run_eval(args)
        if args.command == "inspect":
            from .inspect import run_inspect

            return run_inspect(args)
    except KvtcError as e:
        print(f"dynamo-kvtc: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
