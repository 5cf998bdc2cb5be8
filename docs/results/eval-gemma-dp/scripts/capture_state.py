"""Capture Gemma's calibration state once (same windows/config as `dynamo-kvtc calibrate --model gemma3-270m
--tokens 16384 --seq-len 2048 --ratios 8,16,32,64`) and save the Calibrator state, so the DP can be re-run."""

import argparse
import json
import sys
import time
from pathlib import Path

from safetensors.torch import save_file

from dynamo_kvtc.calibration.build import _texts
from dynamo_kvtc.calibration.calibrate import CalibrationConfig, Calibrator, KvSample
from dynamo_kvtc.calibration.models import capture_kv, fingerprint_of, iter_windows, load_model

out = Path(sys.argv[1])
args = argparse.Namespace(data=None)
texts, desc = _texts(args)
cfg = CalibrationConfig(ratios=(8, 16, 32, 64), layer_groups=1, max_tokens=16384, dp_tokens=16384, seed=0)
model, tok = load_model("gemma3-270m")
fp = fingerprint_of(model, tok)
cal = Calibrator(fp, cfg)
lengths = {}
t0 = time.time()
for window in iter_windows(tok, texts, 2048):
    if cal.full:
        break
    window = window[: cfg.max_tokens - cal.tokens + cfg.sinks]
    lengths[str(len(window))] = lengths.get(str(len(window)), 0) + 1
    cal.add(KvSample(*capture_kv(model, window)))
out.mkdir(parents=True, exist_ok=True)
save_file(cal.state_dict(), str(out / "state.safetensors"))
prov = {
    "model": "gemma3-270m",
    "data": desc,
    "seq_len": 2048,
    "window_lengths": dict(sorted(lengths.items(), key=lambda x: int(x[0]))),
}
(out / "prov.json").write_text(json.dumps(prov))
print("captured", cal.tokens, "tokens in", time.time() - t0, "s")
