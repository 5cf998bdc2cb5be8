"""One bit budget across basis groups (issue 16, dynamo_kvtc/calibration/group_budget.py).

The shared DP is checked against an independent search (every split of the budget between two groups, each group
solved by the ordinary DP), single-group calibrations are checked to come out unchanged (same plans as the ordinary
DP; the same artifact ids as before the shared budget existed), and a sliding-window calibration is checked to spend
its bits where they lower the error while its blobs keep the ratio at the representative span length.
"""

from __future__ import annotations

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

from .conftest import SLIDING_W, SyntheticKV, make_fp

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


def test_single_group_calibrations_are_unchanged():
    """Ids of the pre-shared-budget code on the same samples (this CPU VM, torch 2.13): one group, and two groups
    without token sets (each keeps its own DP). A fresh source, not the session's ``synth``: its generator advances
    with every test that samples from it, so the samples (and ids) would depend on the test order."""
    synth = SyntheticKV(make_fp())
    samples = [synth.sample(512, start=i * 37) for i in range(8)]
    one = calibrate(samples, synth.fp, ratios=(4, 8, 16), dp_tokens=2048, progress=False, seed=0)
    two = calibrate(samples, synth.fp, ratios=(4, 8, 16), layer_groups=2, dp_tokens=2048, progress=False, seed=0)
    assert "group_budget" not in one.provenance and "group_budget" not in two.provenance
    if torch.__version__.startswith("2.13"):
        assert one.id == "400bd8ec13e6aa0d6d53209b03e90306"
        assert two.id == "5183b185b6651f09b9ce1a24f4b28b3b"
    for g in two.groups:  # each group's plan budget is its own 16 bits / ratio per feature
        p = g.k_basis.shape[0]
        assert all(pl.budget_bits == int(16 * p / r) for r, pl in g.k_plans.items())


@pytest.mark.model
def test_smollm2_single_group_calibration_is_unchanged(smollm2, smol_fp):
    """A SmolLM2 joint-basis calibration (the shipped calibration's recipe on 4096 tokens) has the id the
    pre-shared-budget code gave (torch 2.13 on the CPU; one id per vector ISA, both checked against that code: the
    model's forward rounds differently with and without AVX-512)."""
    from dynamo_kvtc.calibration.data import calibration_texts
    from dynamo_kvtc.calibration.models import iter_model_kv

    if not torch.__version__.startswith("2.13"):
        pytest.skip("ids recorded with torch 2.13 on the CPU")
    model, tok = smollm2
    smol = list(iter_model_kv(model, tok, calibration_texts(), seq_len=2048, max_tokens=4096))
    cal = calibrate(smol, smol_fp, ratios=(8, 16, 32, 64), rank=512, niter=4, dp_tokens=2048, progress=False, seed=0)
    from .conftest import cpu_avx512

    expected = "9e2d791079909986eeaabda448a2cfa1" if cpu_avx512() else "6954f9324f633fff106616dbabeaaf0c"
    assert cal.id == expected and "group_budget" not in cal.provenance


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
