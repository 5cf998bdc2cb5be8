"""SmolLM2-135M: randomized vs exact PCA on the same moments, and a bf16 vs float32 model capture (CPU).

Run from the repository root: PYTHONPATH=. python docs/results/calibrate-gpu/smollm2_rsvd_vs_exact.py 8192
Writes JSON to stdout (smollm2-rsvd-vs-exact.json is one run on the 2-core CPU VM, 2026-12-03).
"""

import json
import sys
import time

import torch

from dynamo_kvtc.bench.calibrate import compare
from dynamo_kvtc.calibration.calibrate import CalibrationConfig, Calibrator, KvSample
from dynamo_kvtc.calibration.data import calibration_texts
from dynamo_kvtc.calibration.models import capture_kv, fingerprint_of, iter_windows, load_model
from dynamo_kvtc.calibration.pca import fit_pca, subspace_gap

TOK = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
out = {"tokens": TOK}
texts = calibration_texts()
cals = {}
for dt in ("float32", "bfloat16"):
    t = time.time()
    model, tok = load_model("smollm2-135m-instruct", dt, "cpu")
    cfg = CalibrationConfig(ratios=(16, 32), dp_tokens=4096, max_tokens=TOK, progress=False, pca_method="exact")
    cal = Calibrator(fingerprint_of(model, tok), cfg)
    for w in iter_windows(tok, texts, 2048):
        if cal.full:
            break
        cal.add(KvSample(*capture_kv(model, w[: TOK - cal.tokens + 4])))
    out[f"capture_s_{dt}"] = round(time.time() - t, 1)
    cals[dt] = cal
    del model
res = {}
for kind in "kv":
    m = cals["float32"].mom[(0, kind)]
    t = time.time()
    ex = fit_pca(m, None, method="exact")
    r_ = {"exact_s": round(time.time() - t, 1)}
    for rank in (1024, 2048):
        t = time.time()
        rs = fit_pca(m, rank, niter=8, seed=0, method="randomized")
        ev_ex = torch.cumsum(ex.variances[:rank], 0) / ex.total_variance
        ev_rs = torch.cumsum(rs.variances, 0) / ex.total_variance
        r_[f"rank{rank}"] = {
            "seconds": round(time.time() - t, 1),
            "orthonormality_error": rs.orthonormality_error,
            "max_sin_angle_top": {
                k: round(subspace_gap(ex.basis[:, :k], rs.basis[:, :k]), 5) for k in (64, 256, 512, 1024) if k <= rank
            },
            "explained_variance_exact": float(ev_ex[-1]),
            "explained_variance_rsvd": float(ev_rs[-1]),
            "max_abs_cum_explained_variance_diff": float((ev_ex - ev_rs).abs().max()),
            "max_rel_eigenvalue_diff_top256": float(
                ((ex.variances[:256] - rs.variances[:256]).abs() / ex.variances[:256]).max()
            ),
        }
    res[kind] = r_
out["rsvd_vs_exact"] = res
out["bf16_vs_fp32_model"] = compare(cals["bfloat16"].finish(), cals["float32"].finish())
print(json.dumps(out, indent=1, default=float))
