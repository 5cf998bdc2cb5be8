"""``dynamo-kvtc inspect PATH``: summary of a calibration directory (its JSON card), a blob's header, or a disk-tier
file's record and blob, with which decoder a blob needs (no torch)."""

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
        from ..codec.entropy.registry import coder
        from ..tiers.disk_format import MAGIC, OLD_MAGICS, split_file

        data, info = args.path.read_bytes(), {}
        if data[: len(MAGIC)] in (MAGIC, *OLD_MAGICS):  # a disk-tier file: its record, then the blob
            record, data = split_file(data)
            info["disk_record"] = record
        h, recs = parse_blob(data)
        h.pop("sections")
        if "keys" in h:  # the blocks' 128-bit keys, as hex
            h["keys"] = [h["keys"][i : i + 16].hex() for i in range(0, len(h["keys"]), 16)]
        tags = sorted({r.tag for r in recs})
        gpu_only = [t for t in tags if not coder(t).cpu]
        info.update(
            header=h,
            sections=[{"name": r.name, "tag": r.tag, "raw": r.raw_len, "stored": r.stored_len} for r in recs],
            needs={
                "entropy_codecs": tags,
                "readable_on_cpu": not gpu_only,
                "decoder": f"a GPU with nvCOMP ({', '.join(gpu_only)})" if gpu_only else "any (CPU or GPU)",
            },
        )
    print(json.dumps(info, indent=1, default=str))
    return 0
