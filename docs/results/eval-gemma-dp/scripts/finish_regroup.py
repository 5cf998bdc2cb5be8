"""Gemma calibrations with each attention type split into G groups (full layers: one group each at G=3), one shared
DP; from the saved capture state (regroup: no recapture)."""

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from safetensors.torch import load_file

from dynamo_kvtc.calibration.calibrate import CalibrationConfig, Calibrator, _compact
from dynamo_kvtc.calibration.models import fingerprint_of, load_model

G = int(sys.argv[1])
configs = json.loads(sys.argv[2])
state = Path("/work/cal-gemma/state-2k-16k")
model, tok = load_model("gemma3-270m")
fp = fingerprint_of(model, tok)
del model
base = CalibrationConfig(ratios=(8, 16, 32, 64), layer_groups=1, max_tokens=16384, dp_tokens=16384, seed=0)
d = load_file(str(state / "state.safetensors"))
prov0 = json.loads((state / "prov.json").read_text())
cal0 = Calibrator(fp, base)
cal0.load_state_dict(d)
cal0.max_len = 2048
_compact(cal0.res_u, cal0.res_rows, base.dp_tokens)
cg = cal0.regroup(G)
print("slices", cg.slices, "tokens", cg.group_tokens, flush=True)
t0 = time.time()
fits = cg._fit_groups()
print("fits", time.time() - t0, flush=True)
for c in configs:
    name = c.pop("name")
    cal = cal0.regroup(G)
    cal.cfg = replace(cal.cfg, **{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()})
    cal._fit_groups = lambda: fits
    t1 = time.time()
    res = cal.finish(dict(prov0))
    st = res.provenance["stats"]
    print(name, res.id, "dp", round(time.time() - t1, 1), res.provenance.get("group_budget"), flush=True)
    for r in (8, 16, 32):
        for kind in "kv":
            print(
                "  ",
                r,
                kind,
                [
                    (
                        st[f"g{g}.{kind}.{r}x"]["bits_per_token"],
                        round(st[f"g{g}.{kind}.{r}x"]["relative_error_dp_sample"], 4),
                    )
                    for g in range(len(res.groups))
                ],
                flush=True,
            )
    res.save(Path("/work/cal-gemma") / name)
    print("saved", name, flush=True)
