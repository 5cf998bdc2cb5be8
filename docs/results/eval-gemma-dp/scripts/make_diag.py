"""Diagnostic calibrations: one group's 16x plans replaced by fp8 on every stored basis column (near-lossless)."""

import dataclasses
import sys

from dynamo_kvtc.calibration.artifact import Calibration
from dynamo_kvtc.codec.plan import Plan

src = Calibration.load(sys.argv[1])
for hi, name in ((1, "fullhi"), (0, "slidehi")):
    groups = []
    for g, bg in enumerate(src.groups):
        if g == hi:
            kp, vp = dict(bg.k_plans), dict(bg.v_plans)
            for plans, basis in ((kp, bg.k_basis), (vp, bg.v_basis)):
                p, w = basis.shape
                fp8 = tuple((s, 16, "fp8") for s in range(0, w - w % 16, 16))
                pl = Plan(p, 16.0, 0, fp8)
                plans[16.0] = Plan(p, 16.0, pl.bits_per_token, fp8)
            bg = dataclasses.replace(bg, k_plans=kp, v_plans=vp)
            print(name, "group", g, "K width", bg.k_basis.shape, "V width", bg.v_basis.shape)
        groups.append(bg)
    out = dataclasses.replace(
        src,
        id="",
        groups=groups,
        provenance={**src.provenance, "diagnostic": f"group {hi} 16x plans: fp8 on every stored basis column"},
    )
    out.save(f"/work/cal-gemma/diag-{name}")
    print("saved", name, out.id)
