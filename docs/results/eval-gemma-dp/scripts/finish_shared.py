"""Finish Gemma calibrations from the saved capture state with several DP budget configs (fits computed once)."""

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from safetensors.torch import load_file

from dynamo_kvtc.calibration.calibrate import CalibrationConfig, Calibrator, _compact
from dynamo_kvtc.calibration.group_budget import held_tokens, overall_ratio
from dynamo_kvtc.calibration.models import fingerprint_of, load_model

state = Path("/work/cal-gemma/state-2k-16k")
configs = json.loads(
    sys.argv[1]
)  # list of {"name":..., "shared_budget":..., "budget_tokens":..., "group_error_weights": [...]}
model, tok = load_model("gemma3-270m")
fp = fingerprint_of(model, tok)
del model
base = CalibrationConfig(ratios=(8, 16, 32, 64), layer_groups=1, max_tokens=16384, dp_tokens=16384, seed=0)
d = load_file(str(state / "state.safetensors"))
prov0 = json.loads((state / "prov.json").read_text())
cal0 = Calibrator(fp, base)
cal0.load_state_dict(d)
cal0.max_len = 2048
t0 = time.time()

_compact(cal0.res_u, cal0.res_rows, base.dp_tokens)
fits = cal0._fit_groups()
print("fits", time.time() - t0, "s", flush=True)
for c in configs:
    name = c.pop("name")
    save = c.pop("save", True)
    cfg = replace(base, **{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()})
    cal = Calibrator(fp, cfg)
    cal.load_state_dict(d)
    cal.max_len = 2048
    cal._fit_groups = lambda: fits
    t1 = time.time()
    res = cal.finish(dict(prov0))
    st = res.provenance["stats"]
    line = {
        "name": name,
        "id": res.id,
        "dp_s": round(time.time() - t1, 1),
        "budget": res.provenance.get("group_budget"),
    }
    for r in (8, 16, 32):
        for kind in "kv":
            bits = [st[f"g{g}.{kind}.{r}x"]["bits_per_token"] for g in (0, 1)]
            line[f"{r}x.{kind}"] = {
                "bits": bits,
                "rank": [st[f"g{g}.{kind}.{r}x"]["rank"] for g in (0, 1)],
                "rel_err": [round(st[f"g{g}.{kind}.{r}x"]["relative_error_dp_sample"], 4) for g in (0, 1)],
                "ratio@T": {
                    T: round(overall_ratio([3840, 768], bits, held_tokens([511, 0], T)), 2) for T in (2048, 4096, 8000)
                },
            }
    print(json.dumps(line), flush=True)
    if save:
        res.save(Path("/work/cal-gemma") / name)
        print("saved", name, flush=True)
