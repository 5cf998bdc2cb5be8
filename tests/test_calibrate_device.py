"""The GPU calibration path, run on CPU tensors at small size: randomized PCA against the exact one, the DP sample
kept on the device, checkpoints in pieces, a random-initialised bf16 model shape, and ``bench calibrate``."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch

from dynamo_kvtc.calibration.build import load_state, save_state
from dynamo_kvtc.calibration.calibrate import CalibrationConfig, Calibrator, KvSample
from dynamo_kvtc.calibration.pca import Moments, centred_gram_f32, default_rank, fit_pca, subspace_gap


def _powerlaw_rows(n: int, p: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(p, p, generator=g, dtype=torch.float64))[0]
    lam = torch.arange(1, p + 1, dtype=torch.float64) ** -1.1
    z = torch.randn(n, p, generator=g, dtype=torch.float64) * lam.sqrt()
    return (z @ q.t() + 3.0).float()  # an offset: the moments' shift must cancel it


def test_randomized_pca_is_close_to_the_exact_one():
    p, rank = 256, 64
    m = Moments(p)
    rows = _powerlaw_rows(2000, p)
    for i in range(0, len(rows), 700):
        m.add(rows[i : i + 700])
    exact = fit_pca(m, rank, method="exact")
    rsvd = fit_pca(m, rank, niter=8, seed=0, method="randomized", low_memory=True)  # the GPU's form, on the CPU
    assert rsvd.method == "randomized" and exact.method == "exact"
    cpu = fit_pca(m, rank, niter=8, seed=0, method="randomized", low_memory=False)
    assert subspace_gap(cpu.basis[:, :32], rsvd.basis[:, :32]) < 0.02
    assert rsvd.orthonormality_error < 1e-5
    assert abs(exact.total_variance - rsvd.total_variance) < 1e-9 * exact.total_variance
    # the leading components agree closely; explained variance at the rank cap within 0.1 percentage points
    assert subspace_gap(exact.basis[:, :32], rsvd.basis[:, :32]) < 0.02
    ev = [float(x.variances.sum() / x.total_variance) for x in (exact, rsvd)]
    assert abs(ev[0] - ev[1]) < 1e-3
    top = slice(0, 32)
    torch.testing.assert_close(rsvd.variances[top], exact.variances[top], rtol=1e-3, atol=0)
    # the device form of the centred Gram (float32, built by blocks) is the float64 one rounded
    torch.testing.assert_close(centred_gram_f32(m, block=100), m.covariance_gram().float(), rtol=1e-6, atol=1e-6)
    assert default_rank(32768) == 10240 and default_rank(5760) == 5760


def test_dp_sample_filter_keeps_the_same_sample(synth, monkeypatch):
    """Rows whose key cannot make the DP sample never reach it: the sample is the one of keeping every row."""
    from dynamo_kvtc.calibration.dp import compact_sample

    samples = [KvSample(*synth.sample(300, start=i * 300)) for i in range(10)]
    cfg = CalibrationConfig(ratios=(16,), dp_tokens=200, progress=False, seed=5)
    fast = Calibrator(synth.fp, cfg)
    for s in samples:
        fast.add(s)
    assert fast._res_cut < 0.5  # after the first compaction most rows are turned away before any copy
    monkeypatch.setattr(Calibrator, "_compact", lambda self: compact_sample(self.res_u, self.res_rows, 200))
    plain = Calibrator(synth.fp, cfg)  # keeps every row until each compaction, as before
    for s in samples:
        plain.add(s)
    assert plain._res_cut == float("inf")
    fast._compact(), plain._compact()
    for kind in ("k", "v", "dist"):
        assert torch.equal(fast.res_rows[kind][0], plain.res_rows[kind][0])
    assert torch.equal(fast.res_u[0], plain.res_u[0])


def test_checkpoint_in_pieces_resumes_to_the_same_calibration(synth, tmp_path):
    samples = [KvSample(*synth.sample(300, start=i * 300)) for i in range(6)]
    cfg = CalibrationConfig(ratios=(16,), dp_tokens=300, progress=False, seed=2, rank=48)
    whole = Calibrator(synth.fp, cfg)
    for s in samples:
        whole.add(s)
    first = Calibrator(synth.fp, cfg)
    for s in samples[:4]:
        first.add(s)
    state = first.state_dict()
    manifest = save_state(tmp_path, state, piece_bytes=30000)  # the Gram and DP rows split into many files
    assert len(list(tmp_path.glob("state-*.safetensors"))) > 3
    back = load_state(tmp_path, {"manifest": manifest})
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    resumed = Calibrator(synth.fp, cfg)
    resumed.load_state_dict(back)
    for s in samples[4:]:
        resumed.add(s)
    a, b = whole.finish(), resumed.finish()
    assert a.id == b.id and a.provenance["pca"]["method"] == "randomized"
    assert a.provenance["pca"]["orthonormality_error"] < 1e-5 and a.provenance["pca"]["rank"]["g0.k"] == 48


def test_bf16_random_shape_calibrates_on_cpu(tmp_path):
    """The GPU path's pieces at tiny size on the CPU: a bf16 random model of a real shape, streamed into moments."""
    from dynamo_kvtc.calibration.models import capture_kv, fingerprint_of, load_model

    model, _ = load_model("shape:smollm2-135m@2", "bfloat16", "cpu")
    assert next(model.parameters()).dtype == torch.bfloat16
    fp = fingerprint_of(model)
    assert (fp.num_layers, fp.num_kv_heads, fp.head_dim) == (2, 3, 64)
    cal = Calibrator(fp, CalibrationConfig(ratios=(16,), dp_tokens=64, max_tokens=400, rank=64, progress=False))
    g = torch.Generator().manual_seed(0)
    while not cal.full:
        cal.add(KvSample(*capture_kv(model, torch.randint(0, 49152, (128,), generator=g))))
    out = cal.finish()
    assert out.provenance["tokens"] == 400 and out.groups[0].k_basis.shape[0] == 2 * 3 * 64


def test_bench_calibrate_smoke(tmp_path):
    """One tiny shape through the child process the H200 run uses; the JSON has every field the docs name."""
    from dynamo_kvtc.bench.calibrate import run_bench_calibrate

    args = Namespace(
        shapes=["smollm2-135m@2"], tokens=300, device="cpu", dtype="auto", ratios=(16,), rank=None, dp_tokens=64,
        seq_len=128, checkpoint_every=None, reference=None, out_dir=str(tmp_path / "cals"), budget_s=0,
        in_process=False, no_progress=True, json_path=str(tmp_path / "bench.json"),
    )  # fmt: skip
    assert run_bench_calibrate(args) == 0
    rep = json.loads((tmp_path / "bench.json").read_text())
    assert rep["benchmark"] == "calibrate" and "platform" in rep["machine"]
    (res,) = rep["results"]
    assert res["status"] == "ok" and res["model"] == "shape:smollm2-135m@2" and res["tokens"] == 300
    assert set(res["seconds"]) >= {"load", "capture", "checkpoint", "pca", "dp", "save", "total"}
    assert res["tokens_per_s"] > 0 and res["peak_host_rss_gib"] > 0 and res["features_per_kind"] == 384


@pytest.mark.parametrize("spec", ["shape:nope", "shape:llama-3.1-8b@0", "shape:llama-3.1-8b@x"])
def test_bad_shapes_are_config_errors(spec):
    from dynamo_kvtc.calibration.shapes import parse_shape
    from dynamo_kvtc.errors import ConfigError

    with pytest.raises(ConfigError):
        parse_shape(spec)


def test_compare_a_calibration_with_itself(synth_cal):
    """``bench calibrate --reference``: the same calibration is 0 apart (fp16 bases are orthonormalised first)."""
    from dynamo_kvtc.bench.calibrate import compare

    out = compare(synth_cal, synth_cal)
    assert out["same_id"]
    for kind in "kv":
        g = out[f"g0.{kind}"]
        assert g["max_sin_angle"] and all(v < 1e-6 for v in g["max_sin_angle"].values())
        assert all(a == b for a, b in g["rank"].values()) and g["mean_rel_diff"] == 0
