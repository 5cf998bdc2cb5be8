"""Mixed-precision Gemma calibrations from one per-group calibration: each variant is what `dynamo-kvtc calibrate
--full-attention-v int4 --full-attention-k R` writes in one go (tests/test_sliding_window.py checks they match).
The variants share their bases (sliding groups and full K: the source's PCA; full V: identity), so they are merged
into one calibration with one plan key per variant (the ratio each reaches at 4096 tokens, window-only raw tier).

    python derive.py SRC OUT
"""

import json
import sys

from dynamo_kvtc.calibration.artifact import Calibration
from dynamo_kvtc.calibration.sliding import mixed_precision, plan_ratio

src, out = Calibration.load(sys.argv[1]), sys.argv[2]
variants = {  # name: (sliding ratio, full K spec)
    "s16-k16": (16, None),
    "s16-k8": (16, 8),
    "s16-k4": (16, 4),
    "s32-k16": (32, None),
    "s32-k4": (32, 4),
}
merged, names = None, {}
for name, (r, k) in variants.items():
    cal = mixed_precision(src, [r], full_k=k, full_v="int4", group_size=64, span_tokens=4096)
    (key,) = cal.ratios
    names[f"{key:g}"] = name
    if merged is None:
        merged = cal
        continue
    for gm, gc in zip(merged.groups, cal.groups):
        assert key not in gm.k_plans, (name, key)
        gm.k_plans[key], gm.v_plans[key] = gc.k_plans[key], gc.v_plans[key]
merged.provenance["mixed_precision"] = {
    **merged.provenance["mixed_precision"],
    "full_k": "per variant",
    "variants": {
        kk: {"name": n, "sliding": variants[n][0], "full_k": variants[n][1] or variants[n][0]}
        for kk, n in names.items()
    },
}
merged.provenance["mixed_precision"].pop("plans", None)
merged = Calibration(
    merged.fingerprint, merged.groups, merged.rope_removed, merged.provenance, layer_order=merged.layer_order
)
merged.save(out)
rows = {n: {t: round(plan_ratio(merged, float(k), t), 2) for t in (2048, 4096, 8000)} for k, n in names.items()}
print(merged.id[:12], json.dumps({k: n for k, n in names.items()}), json.dumps(rows))
print("source", src.id[:12], {r: [round(plan_ratio(src, r, t), 2) for t in (2048, 4096, 8000)] for r in src.ratios})
