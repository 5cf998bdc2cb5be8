"""``dynamo-kvtc inspect PATH``: summary of a calibration directory (its JSON card, no torch) or a blob's header."""

from __future__ import annotations

import argparse
import json

from . import types

HELP = "describe a calibration directory or a blob file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=types.existing_path, help="a calibration directory or a blob file")


def run(args: argparse.Namespace) -> int:
    if args.path.is_dir():
        from ..calibration.card import card

        info = card(args.path)
    else:
        from ..codec.container import parse_blob

        h, recs = parse_blob(args.path.read_bytes())
        h.pop("sections")
        info = {
            "header": h,
            "sections": [{"name": r.name, "tag": r.tag, "raw": r.raw_len, "stored": r.stored_len} for r in recs],
        }
    print(json.dumps(info, indent=1, default=str))
    return 0
