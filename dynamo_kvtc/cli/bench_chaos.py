"""``dynamo-kvtc bench chaos`` (the work: :mod:`dynamo_kvtc.reliability`; ``python -m dynamo_kvtc.reliability``
takes the same arguments)."""

from __future__ import annotations

import argparse

from . import types

HELP = "fault injection against the real tiers: wrong KV served, blocks lost, crashes"


def _kinds(s: str) -> tuple[str, ...]:
    from ..reliability.ledger import KINDS

    kinds = tuple(k.strip() for k in s.split(",") if k.strip())
    bad = sorted(set(kinds) - set(KINDS))
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"unknown fault kinds {bad}; choose from {', '.join(KINDS)}")
    return kinds


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..reliability.ledger import KINDS

    p.add_argument("--quick", action="store_true", help="the CI-sized run (about a minute on 2 cores)")
    p.add_argument(
        "--duration", type=types.nonneg_float, default=None, help="seconds of soak per mode (lossless, lossy)"
    )
    p.add_argument("--clients", type=types.positive_int, default=None, help="concurrent soak clients")
    p.add_argument(
        "--rounds", type=types.positive_int, default=None, help="disk-file fault rounds (others scale with it)"
    )
    p.add_argument("--kills", type=types.nonneg_int, default=None, help="kill -9 restarts of a writing process")
    p.add_argument("--kinds", type=_kinds, default=None, help="comma-separated subset of: " + ",".join(KINDS))
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one, removed after)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write the counts (per kind and in total) as JSON")


def run(args: argparse.Namespace) -> int:
    from ..reliability.chaos import run_bench_chaos

    return run_bench_chaos(args)
