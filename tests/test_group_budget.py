"""One bit budget across basis groups (issue 16, dynamo_kvtc/calibration/group_budget.py).

The shared DP is checked against an independent search (every split of the budget between two groups, each group
solved by the ordinary DP), single-group calibrations are checked to come out unchanged (same plans as the ordinary
DP; the same artifact ids as before the shared budget existed), and a sliding-window calibration is checked to spend
its bits where they lower the error while its blobs keep the ratio at the representative span length.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from dynamo_kvtc import calibrate
from dynamo_kvtc.calibration.calibrate import CalibrationConfig, Calibrator, KvSample
from dynamo_kvtc.calibration.dp import allocate, block_errors, plan_error
from dynamo_kvtc.calibration.group_budget import GroupTable, held_tokens, overall_ratio, share_budget, token_weights
from dynamo_kvtc.codec.kvtc import KvtcCodec
from dynamo_kvtc.codec.quant import group_cost_bits
from dynamo_kvtc.errors import CalibrationError, ConfigError

from .conftest import SLIDING_W, SyntheticKV, cpu_isa, make_fp

SIZES = (1, 16)


def _tables(seed: int, features: int, rows: int = 256, decay: float = 0.9) -> tuple[np.ndarray, dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g) * decay ** torch.arange(features)
    return block_errors(x, sizes=SIZES)


def test_token_weights_count_the_tokens_each_group_holds():
    assert held_tokens([511, 0], 2048) == [511, 2048] and held_tokens([511, 0], 300) == [300, 300]
    assert token_weights([511, 0], 2048) == [1, 4] and token_weights([511, 0], 8192) == [1, 16]
    assert token_weights([511, 0], 400) == [1, 1]  # a span inside the window: every layer holds every token
    with pytest.raises(CalibrationError):
        held_tokens([511, 0], 0)


def test_cost_scale_of_ones_changes_nothing():
    zero, errs = _tables(0, 48)
    budgets = [200, 400, 800]
    plain = allocate(zero, errs, budgets)
    ones = allocate(zero, errs, budgets, cost_scale=np.ones(48, dtype=np.int64))
    assert [(a.groups, a.bits, a.error) for a in plain] == [(a.groups, a.bits, a.error) for a in ones]


def test_one_group_shares_its_budget_with_nobody():
    zero, errs = _tables(1, 64)
    ratios = (4, 8, 16)
    ref = allocate(zero, errs, [int(16 * 64 / r) for r in ratios])
    got = share_budget([GroupTable(zero, errs, 64, 256, 3, 2.0)], ratios, sizes=SIZES)
    assert [g[0].groups for g in got] == [a.groups for a in ref]
    assert [g[0].bits for g in got] == [a.bits for a in ref]


def test_shared_dp_matches_a_search_over_every_budget_split():
    """Two groups (token weights 1 and 3, error weights 1 and 2): the shared DP's weighted error equals the best of
    every split of the budget, each side solved by the ordinary DP; it never exceeds the budget."""
    z1, e1 = _tables(2, 48, decay=0.93)
    z2, e2 = _tables(3, 32, decay=0.8)
    t1, t2 = GroupTable(z1, e1, 48, 256, 1, 1.0), GroupTable(z2, e2, 32, 256, 3, 2.0)
    for ratio in (4, 8, 16):
        budget = int(16 * (48 * 1 + 32 * 3) / ratio)
        a1, a2 = share_budget([t1, t2], [ratio], sizes=SIZES)[0]
        assert a1.bits + 3 * a2.bits <= budget
        assert a1.error == pytest.approx(plan_error(a1.groups, z1, e1))
        got = a1.error / 256 + 2 * 3 * a2.error / 256
        splits = range(0, budget // 3 + 1, 2)  # group costs are even: every reachable split
        sides = allocate(z2, e2, list(splits))
        best = min(
            allocate(z1, e1, [budget - 3 * b2])[0].error / 256 + 2 * 3 * s.error / 256 for b2, s in zip(splits, sides)
        )
        assert got == pytest.approx(best, rel=1e-9)
        # and it is strictly better than giving each group its own share at this ratio
        own = allocate(z1, e1, [int(16 * 48 / ratio)])[0].error / 256
        own += 2 * 3 * allocate(z2, e2, [int(16 * 32 / ratio)])[0].error / 256
        assert got <= own


def test_padding_is_never_coded_and_groups_stay_in_their_features():
    z1, e1 = _tables(4, 40)  # 40 and 24 coordinates: padded to 48 and 32 in the joint table
    z2, e2 = _tables(5, 24)
    for a1, a2 in share_budget([GroupTable(z1, e1, 40, 256, 1), GroupTable(z2, e2, 24, 256, 2)], [2, 4], SIZES):
        assert all(s + n <= 40 for s, n, _ in a1.groups) and all(s + n <= 24 for s, n, _ in a2.groups)
        assert a2.bits == sum(group_cost_bits(k, n) for _, n, k in a2.groups)


# ------------------------------------------------------------------ calibrations
W = SLIDING_W


@pytest.fixture(scope="module")
def win_samples(win_synth):
    return [win_synth.sample(400, start=i * 41) for i in range(8)]


def plans_id(cal) -> str:
    """The id of a calibration's plans alone (the artifact id's JSON part: fingerprint, layers, every plan): what the
    DP decided, integers that a CPU's float rounding does not move unless a decision sits on a tie."""
    return hashlib.sha256(json.dumps(cal._meta(), sort_keys=True).encode()).hexdigest()[:32]


def relative_errors(cal) -> dict[str, float]:
    """Each group, kind and ratio's relative error on the DP sample, and the variance each basis width captures."""
    st = cal.provenance["stats"]
    return {k: v["relative_error_dp_sample"] if isinstance(v, dict) else v for k, v in st.items()}


def assert_same_calibration(cal, ids: dict[str, str], plans: str | None, errors: dict[str, float], rel: float) -> None:
    """``cal`` is the recorded calibration: the same bases and means up to float rounding (the relative errors they
    give, and the variance their width captures, within ``rel``); the same plans where they are robust to rounding
    (``plans``: their id); and, on a CPU of an ISA the artifact id was recorded on (``ids``), the same id. Other ISAs
    round torch's vectorised randn, GEMMs and a model's forward otherwise, and the fp16 basis bytes move with them."""
    if plans is not None:
        assert plans_id(cal) == plans
    got = relative_errors(cal)
    assert got.keys() == errors.keys()
    for k, want in errors.items():
        assert got[k] == pytest.approx(want, rel=rel), k
    if cpu_isa() in ids:
        assert cal.id == ids[cpu_isa()]


# One group, and two groups without token sets, calibrated by the pre-shared-budget code on the same samples (AVX2,
# torch 2.13): the artifact ids, the ids of their plans, and their relative errors. Perturbing those samples far
# more than another CPU's rounding does (the last bf16 bit of 1% or 5% of all K/V values flipped, with or without
# float64 projections) left every plan as it was and moved the relative errors by at most 5% (the 4x and 8x ones are
# ~5e-4, at the samples' bf16 noise): the bound is twice that.
SINGLE_GROUP = {
    "one": (
        {"avx2": "400bd8ec13e6aa0d6d53209b03e90306"},
        "8112d163bab2f7d61deac7d4dd815530",
        {"g0.k.4x": 0.0005, "g0.k.8x": 0.000746, "g0.k.16x": 0.040369, "g0.v.4x": 0.000494, "g0.v.8x": 0.000752,
         "g0.v.16x": 0.042202, "g0.k.variance_captured_by_width": 0.999961,
         "g0.v.variance_captured_by_width": 0.999961},
    ),
    "two": (
        {"avx2": "5183b185b6651f09b9ce1a24f4b28b3b"},
        "5f744a4f7212c8c08d07b07e82a018e8",
        {"g0.k.4x": 0.000664, "g0.k.8x": 0.031669, "g0.k.16x": 0.145819, "g0.v.4x": 0.000726, "g0.v.8x": 0.036037,
         "g0.v.16x": 0.151628, "g1.k.4x": 0.000711, "g1.k.8x": 0.038829, "g1.k.16x": 0.148982, "g1.v.4x": 0.000709,
         "g1.v.8x": 0.035462, "g1.v.16x": 0.149397, "g0.k.variance_captured_by_width": 0.999946,
         "g0.v.variance_captured_by_width": 0.999939, "g1.k.variance_captured_by_width": 0.999935,
         "g1.v.variance_captured_by_width": 0.999944},
    ),
}  # fmt: skip


def test_single_group_calibrations_are_unchanged():
    """The pre-shared-budget code's calibrations of the same samples (SINGLE_GROUP): one group, and two groups
    without token sets (each keeps its own DP). A fresh source, not the session's ``synth``: its generator advances
    with every test that samples from it, so the samples (and ids) would depend on the test order."""
    synth = SyntheticKV(make_fp())
    samples = [synth.sample(512, start=i * 37) for i in range(8)]
    one = calibrate(samples, synth.fp, ratios=(4, 8, 16), dp_tokens=2048, progress=False, seed=0)
    two = calibrate(samples, synth.fp, ratios=(4, 8, 16), layer_groups=2, dp_tokens=2048, progress=False, seed=0)
    assert "group_budget" not in one.provenance and "group_budget" not in two.provenance
    if torch.__version__.startswith("2.13"):
        assert_same_calibration(one, *SINGLE_GROUP["one"], rel=0.1)
        assert_same_calibration(two, *SINGLE_GROUP["two"], rel=0.1)
    for g in two.groups:  # each group's plan budget is its own 16 bits / ratio per feature
        p = g.k_basis.shape[0]
        assert all(pl.budget_bits == int(16 * p / r) for r, pl in g.k_plans.items())


# The SmolLM2 calibration below by the pre-shared-budget code (torch 2.13 on the CPU): its id on AVX2 (here) and on an
# AVX-512 CPU without AMX (the model's forward rounds differently there); its relative errors, ranks and bits (AVX2,
# where this code gives the recorded id). Its plans are not pinned: with the model's forward in float64 instead
# (another rounding of every K/V value) a plan's quantization groups moved (another plans id) while every rank and
# bit count stayed; the relative errors moved by at most 7.3e-4 relatively, the captured variances by 1e-7: the bound
# is 5e-3.
SMOL_IDS = {"avx2": "6954f9324f633fff106616dbabeaaf0c", "avx512": "9e2d791079909986eeaabda448a2cfa1"}
SMOL_ERRORS = {
    "g0.k.8x": 0.072901, "g0.k.16x": 0.073021, "g0.k.32x": 0.074531, "g0.k.64x": 0.115456,
    "g0.v.8x": 0.1133, "g0.v.16x": 0.113497, "g0.v.32x": 0.115589, "g0.v.64x": 0.179157,
    "g0.k.variance_captured_by_width": 0.927954, "g0.v.variance_captured_by_width": 0.887215,
}  # fmt: skip
SMOL_RANK_BITS = {  # (ratio, kind): (rank, bits per token) of each plan
    (8, "k"): (512, 11516), (16, "k"): (512, 5756), (32, "k"): (512, 2880), (64, "k"): (384, 1440),
    (8, "v"): (512, 11516), (16, "v"): (512, 5756), (32, "v"): (512, 2880), (64, "v"): (400, 1440),
}  # fmt: skip


@pytest.mark.model
def test_smollm2_single_group_calibration_is_unchanged(smollm2, smol_fp):
    """A SmolLM2 joint-basis calibration (the shipped calibration's recipe on 4096 tokens) is the one the
    pre-shared-budget code gave (SMOL_IDS, SMOL_ERRORS, SMOL_RANK_BITS): each plan at its own budget."""
    from dynamo_kvtc.calibration.data import calibration_texts
    from dynamo_kvtc.calibration.models import iter_model_kv

    if not torch.__version__.startswith("2.13"):
        pytest.skip("recorded with torch 2.13 on the CPU")
    model, tok = smollm2
    smol = list(iter_model_kv(model, tok, calibration_texts(), seq_len=2048, max_tokens=4096))
    cal = calibrate(smol, smol_fp, ratios=(8, 16, 32, 64), rank=512, niter=4, dp_tokens=2048, progress=False, seed=0)
    assert "group_budget" not in cal.provenance
    st = cal.provenance["stats"]
    p = cal.groups[0].k_basis.shape[0]
    for r in (8, 16, 32, 64):
        for kind in "kv":
            rank, bits = SMOL_RANK_BITS[(r, kind)]
            s = st[f"g0.{kind}.{r}x"]
            assert s["budget_bits"] == int(16 * p / r)  # its own budget: no bits shared with another group
            # one DP decision more or less at a near tie moves a rank by one block of 16 and the bits by a little
            assert abs(s["rank"] - rank) <= 16 and s["bits_per_token"] == pytest.approx(bits, rel=0.01)
    assert_same_calibration(cal, SMOL_IDS, None, SMOL_ERRORS, rel=5e-3)


def _cal(win_synth, samples, **kw):
    return calibrate(samples, win_synth.fp, ratios=(4, 8, 16), dp_tokens=2048, progress=False, seed=0, **kw)


def test_sliding_calibration_shares_one_budget(win_synth, win_samples):
    own = _cal(win_synth, win_samples, shared_budget=False)
    shared = _cal(win_synth, win_samples)  # span: the longest sample, 400 tokens -> sliding 100, full 400: 1:4
    assert shared.provenance["group_budget"] == {
        "span_tokens": 400,
        "token_weights": [1, 4],
        "error_weights": [1.0, 1.0],
        "error": "relative",
    }
    assert "group_budget" not in own.provenance
    st_own, st = own.provenance["stats"], shared.provenance["stats"]
    feats = [g.k_basis.shape[0] for g in shared.groups]
    for r in (4, 8, 16):
        for kind in "kv":
            bits = [st[f"g{g}.{kind}.{r}x"]["bits_per_token"] for g in (0, 1)]
            assert bits[0] + 4 * bits[1] <= int(16 * (feats[0] + 4 * feats[1]) / r)
            assert [st[f"g{g}.{kind}.{r}x"]["budget_bits"] for g in (0, 1)] == bits

            def werr(s, kind=kind, r=r):  # token-weighted relative errors (2 layers each) are what the DP lowers
                return sum(w * s[f"g{g}.{kind}.{r}x"]["relative_error_dp_sample"] for g, w in ((0, 1), (1, 4)))

            assert werr(st) <= werr(st_own) * (1 + 1e-9)


def _squared_error(codec, k, v, pos) -> float:
    """Squared reconstruction error of every token each layer holds, the raw window excluded."""
    layers = codec.decode_ragged(codec.encode(k, v, pos))
    T = k.shape[1]
    out = 0.0
    for i, (k2, v2) in enumerate(layers):
        a = T - k2.shape[0]
        out += float((k2[:-16].float() - k[i, a:-16].float()).square().sum())
        out += float((v2[:-16].float() - v[i, a:-16].float()).square().sum())
    return out


def test_shared_calibration_keeps_its_ratio_and_lowers_the_error(win_synth, win_samples):
    """On a held-out 400-token span (the representative length): blobs of the shared calibration are at least at
    the ratio, every layer decodes its own tokens, and the total squared error is never above the per-group DP's
    (measured at 8x: 5403 vs 7209, the per-group DP leaves bits unspent at 10.8x; equal at 4x and 16x)."""
    own = _cal(win_synth, win_samples, shared_budget=False)
    cal = _cal(win_synth, win_samples, budget_tokens=400, budget_error="absolute")
    k, v, pos = win_synth.sample(400, start=5)
    errs = {}
    for r in (4, 8, 16):
        codec = KvtcCodec(cal, ratio=r, window=16)
        blob = codec.encode(k, v, pos)
        assert codec.stats(blob)["ratio"] >= r
        bits = [g.k_plans[float(r)].bits_per_token + g.v_plans[float(r)].bits_per_token for g in cal.groups]
        feats = [2 * g.k_basis.shape[0] for g in cal.groups]
        assert overall_ratio(feats, bits, held_tokens([W, 0], 400)) >= r
        assert [x[0].shape[0] for x in codec.decode_ragged(blob)] == [W, 400, W, 400]
        errs[r] = (_squared_error(codec, k, v, pos), _squared_error(KvtcCodec(own, ratio=r, window=16), k, v, pos))
        assert errs[r][0] <= errs[r][1] * 1.001
    assert errs[8][0] < 0.9 * errs[8][1]


def test_error_weights_move_bits_and_are_checked(win_synth, win_samples):
    plain = _cal(win_synth, win_samples)
    heavy = _cal(win_synth, win_samples, group_error_weights=(1.0, 50.0))
    b = [sum(c.provenance["stats"][f"g1.{kind}.8x"]["bits_per_token"] for kind in "kv") for c in (plain, heavy)]
    assert b[1] > b[0]  # the full group weighs more: it gets more bits at the same ratio
    with pytest.raises(ConfigError, match="group_error_weights"):
        _cal(win_synth, win_samples, group_error_weights=(1.0, 1.0, 1.0))
    with pytest.raises(ConfigError):
        CalibrationConfig(group_error_weights=(1.0, 0.0))
    with pytest.raises(ConfigError, match="budget_error"):
        CalibrationConfig(budget_error="mse")


def test_checkpoint_keeps_the_longest_sample(win_synth):
    cfg = CalibrationConfig(ratios=(4,), dp_tokens=256, progress=False)
    cal = Calibrator(win_synth.fp, cfg)
    cal.add(KvSample(*win_synth.sample(300)))
    cal.add(KvSample(*win_synth.sample(200, start=300)))
    back = Calibrator(win_synth.fp, cfg)
    back.load_state_dict(cal.state_dict())
    assert cal.max_len == back.max_len == 300
    assert back.finish().provenance["group_budget"]["span_tokens"] == 300


def test_k_and_v_can_share_one_budget(win_synth, win_samples):
    """share_kv: one DP over K and V of every group; K and V bits together stay within the ratio's budget and the
    token-weighted relative error over both kinds is never above the one of a budget per kind."""
    per_kind = _cal(win_synth, win_samples)
    joint = _cal(win_synth, win_samples, share_kv=True)
    assert joint.provenance["group_budget"]["share_kv"] and "share_kv" not in per_kind.provenance["group_budget"]
    feats = [g.k_basis.shape[0] for g in joint.groups]
    for r in (4, 8, 16):
        st = joint.provenance["stats"]
        bits = [st[f"g{g}.{kind}.{r}x"]["bits_per_token"] * w for g, w in ((0, 1), (1, 4)) for kind in "kv"]
        assert sum(bits) <= int(16 * 2 * (feats[0] + 4 * feats[1]) / r)

        def werr(c, r=r):
            s = c.provenance["stats"]
            return sum(w * s[f"g{g}.{k}.{r}x"]["relative_error_dp_sample"] for g, w in ((0, 1), (1, 4)) for k in "kv")

        assert werr(joint) <= werr(per_kind) * (1 + 1e-9)
