"""``dynamo-kvtc bench transfer`` (the work: :mod:`dynamo_kvtc.bench.transfer`)."""

from __future__ import annotations

import argparse

from . import types

HELP = "prefill->decode hand-off over NIXL: compressed blobs vs raw KV vs the link-aware policy, two processes"


def link_rates(s: str) -> list[float]:
    """Comma-separated link rates in Gbit/s, 0 (or ``uncapped``) for no cap: ``0,100,200,400``."""
    out = []
    for x in s.split(","):
        x = x.strip().lower()
        if not x:
            continue
        try:
            v = 0.0 if x in ("uncapped", "none") else float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"comma-separated link rates in Gb/s expected, got {s!r}") from None
        if not (v >= 0 and v < 1e6):
            raise argparse.ArgumentTypeError(f"link rates must be >= 0 Gb/s (0 = uncapped), got {s!r}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"comma-separated link rates in Gb/s expected, got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes", type=types.shapes, default="smollm2-135m", help="comma-separated: " + ", ".join(types.shape_names())
    )
    p.add_argument("--tokens", type=types.positive_ints, default="2048", help="comma-separated prompt lengths")
    p.add_argument("--prefill-device", default="cpu")
    p.add_argument("--decode-device", default="cpu")
    p.add_argument("--ratio", type=types.positive_float, default=16.0)
    p.add_argument(
        "--rank", type=types.positive_int, default=1024, help="PCA components of a one-group synthetic calibration"
    )
    p.add_argument("--repeat", type=types.positive_int, default=3)
    p.add_argument("--timeout", type=types.positive_float, default=120.0)
    p.add_argument(
        "--link-gbps",
        type=link_rates,
        default="0",
        help="emulated link rates in Gb/s, comma-separated, 0 = uncapped: a token bucket paces both paths' READs",
    )
    p.add_argument(
        "--replay-gbps",
        type=link_rates,
        default=None,
        help="also emulate these link rates (Gb/s) by replay, for links faster than the real path between the two "
        "processes: the compressed restore runs on the bytes of one real fetch, each layer group released when a "
        "link of that rate would have delivered it; raw = its bytes at the rate",
    )
    p.add_argument(
        "--chunk-mb",
        type=types.positive_float,
        default=4.0,
        help="smallest READ chunk of a paced link (MiB; <= 16 per READ)",
    )
    p.add_argument(
        "--layer-groups",
        type=types.positive_int,
        default=4,
        help="layer groups of the synthetic calibration: the compressed hand-off READs and restores one at a time",
    )
    p.add_argument("--json", dest="json_path", help="write results as JSON")


def run(args: argparse.Namespace) -> int:
    from ..bench.transfer import run_bench_transfer

    return run_bench_transfer(args)
