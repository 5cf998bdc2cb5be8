"""Diagnostic calibrations: only the full group's K (or V) 16x plan replaced by fp8 on every stored basis column."""

import dataclasses
import sys

from dynamo_kvtc.calibration.artifact import Calibration
from dynamo_kvtc.codec.plan import Plan

src = Calibration.load(sys.argv[1])
for which in ("k", "v"):
    groups = []
    for g, bg in enumerate(src.groups):
        if g == 1:
            plans = dict(getattr(bg, f"{which}_plans"))
            p, w = getattr(bg, f"{which}_basis").shape
            fp8 = tuple((s, 16, "fp8") for s in range(0, w - w % 16, 16))
            plans[16.0] = Plan(p, 16.0, Plan(p, 16.0, 0, fp8).bits_per_token, fp8)
            bg = dataclasses.replace(bg, **{f"{which}_plans": plans})
        groups.append(bg)
    out = dataclasses.replace(
        src,
        id="",
        groups=groups,
        provenance={**src.provenance, "diagnostic": f"full group {which} 16x plan: fp8 on every stored basis column"},
    )
    out.save(f"/work/cal-gemma/diag-full{which}")
    print("saved", which, out.id)
