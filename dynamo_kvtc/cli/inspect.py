"""``dynamo-kvtc inspect PATH``: summary of a calibration directory or a blob's header."""

from __future__ import annotations

import json
from pathlib import Path

from ..calibration.artifact import Calibration
from ..codec.container import parse_blob


def run_inspect(args) -> int:
    p = Path(args.path)
    if p.is_dir():
        cal = Calibration.load(p)
        info = {**cal.summary(), "provenance": {k: v for k, v in cal.provenance.items() if k != "stats"}}
    else:
        h, recs = parse_blob(p.read_bytes())
        h.pop("sections")
        info = {
            "header": h,
            "sections": [{"name": r.name, "tag": r.tag, "raw": r.raw_len, "stored": r.stored_len} for r in recs],
        }
    print(json.dumps(info, indent=1, default=str))
    return 0
