"""Per-layer token sets (issue 16): layers that keep only a window (sliding-window attention) encode only that window.

A calibration of a model with sliding-window layers groups layers by attention type (``layer_order``) and fits each
sliding group on the tokens those layers keep; its blobs record each group's token range in the header, decode gives
each layer its own tokens, older blobs are untouched (tests/test_compat.py), and the fused path refuses such a codec
so the reference path does the work.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dynamo_kvtc import calibrate
from dynamo_kvtc.calibration.artifact import Calibration
from dynamo_kvtc.calibration.calibrate import group_plan
from dynamo_kvtc.codec import CodecOptions, EncodeSpan, RestoreRun
from dynamo_kvtc.codec.container import BlobHeader, frame_header, parse_blob
from dynamo_kvtc.codec.kvtc import KvtcCodec
from dynamo_kvtc.errors import CorruptBlobError, InputError, TierError

from .conftest import SLIDING_W, make_fp, rel

W = SLIDING_W  # the artificial sliding window of layers 0 and 2


@pytest.fixture(scope="module")
def win_cal(win_synth):
    samples = [win_synth.sample(400, start=i * 41) for i in range(8)]
    return calibrate(samples, win_synth.fp, ratios=(4, 8, 16), dp_tokens=2048, progress=False, seed=0)


def test_group_plan_groups_layers_by_attention_type():
    fp = dataclasses.replace(make_fp(layers=6), windows=(511, 511, 0, 511, 511, 0))
    assert group_plan(fp, 1) == ((0, 1, 3, 4, 2, 5), [(0, 4), (4, 6)], [511, 0])
    assert group_plan(fp, 2) == ((0, 1, 3, 4, 2, 5), [(0, 2), (2, 4), (4, 5), (5, 6)], [511, 511, 0, 0])
    assert group_plan(fp, 1, token_sets=False) == (None, [(0, 6)], [0])
    assert group_plan(make_fp(layers=6), 2) == (None, [(0, 3), (3, 6)], [0, 0])  # no sliding layers: as before


def test_calibration_records_order_and_token_sets_and_round_trips(win_cal, tmp_path):
    assert win_cal.layer_order == (0, 2, 1, 3)
    assert [(g.layers, g.tokens) for g in win_cal.groups] == [((0, 2), W), ((2, 4), 0)]
    assert win_cal.token_sets and win_cal.fingerprint.windows == (W, 0, W, 0)
    back = Calibration.load(win_cal.save(tmp_path / "cal"))
    assert back.id == win_cal.id and back.layer_order == win_cal.layer_order
    assert [g.tokens for g in back.groups] == [W, 0]


def test_round_trip_gives_each_layer_its_own_tokens(win_cal, win_synth):
    k, v, pos = win_synth.sample(300, start=7)
    codec = KvtcCodec(win_cal, ratio=4, window=16)  # 4x: each type's group alone codes the synthetic KV well
    blob = codec.encode(k, v, pos)
    assert codec.layer_ranges(blob) == [(200, 300), (0, 300), (200, 300), (0, 300)]
    layers = codec.decode_ragged(blob)
    for layer, (k2, v2) in enumerate(layers):
        a = 0 if layer % 2 else 300 - W
        assert k2.shape == (300 - a, k.shape[2], k.shape[3]) and k2.dtype == k.dtype
        assert rel(k2, k[layer, a:]) < 0.05 and rel(v2, v[layer, a:]) < 0.05
        assert torch.equal(k2[-16:], k[layer, -16:])  # the raw window, exact
    with pytest.raises(InputError):
        codec.decode(blob)  # no [L, T, H, D] tensor for ragged layers
    st = codec.stats(blob)
    held = 2 * 2 * k.shape[2] * k.shape[3] * (2 * 300 + 2 * W)  # K+V, 16 bits, what the four layers hold
    assert st["held_bytes_16bit"] == held < st["raw_bytes_16bit"]
    assert 3.5 < st["ratio"] < 6  # the 4x plan, accounted on the tokens the layers hold


def test_header_records_token_ranges_and_is_checked(win_cal, win_synth):
    k, v, pos = win_synth.sample(300)
    codec = KvtcCodec(win_cal, ratio=8)
    blob = codec.encode(k, v, pos)
    h, recs = parse_blob(blob)
    assert h["order"] == [0, 2, 1, 3] and h["token_sets"] == [[200, 300], [0, 300]]
    hdr = BlobHeader.from_dict(h)
    assert hdr.token_sets == [[200, 300], [0, 300]] and hdr.to_dict()["order"] == [0, 2, 1, 3]
    # a header naming other token ranges than its calibration implies is refused
    body = bytes(blob)[16 + len(frame_header(hdr, recs)) - 16 :]
    forged = frame_header(dataclasses.replace(hdr, token_sets=[[150, 300], [0, 300]]), recs) + body
    with pytest.raises(CorruptBlobError, match="token sets"):
        codec.check_blob(forged)
    for bad in ([[0, 301], [0, 300]], [[0, 300]], [[10, 5], [0, 300]]):  # out of range, too few, reversed
        with pytest.raises(CorruptBlobError, match="token.set"):
            parse_blob(frame_header(dataclasses.replace(hdr, token_sets=bad), recs) + body)
    with pytest.raises(CorruptBlobError, match="permutation"):
        parse_blob(frame_header(dataclasses.replace(hdr, order=[0, 0, 1, 3]), recs) + body)


def test_blobs_without_token_sets_have_no_new_keys(synth_cal, synth):
    k, v, pos = synth.sample(200)
    h, _ = parse_blob(KvtcCodec(synth_cal, ratio=8).encode(k, v, pos))
    assert "order" not in h and "token_sets" not in h
    assert "order" not in BlobHeader.from_dict(h).to_dict()


def test_a_short_span_and_a_raw_span_keep_every_token(win_cal, win_synth):
    codec = KvtcCodec(win_cal, ratio=8, window=16)
    k, v, pos = win_synth.sample(60)  # shorter than the window: every layer holds every token
    assert codec.layer_ranges(codec.encode(k, v, pos)) == [(0, 60)] * 4
    k, v, pos = win_synth.sample(150)  # raw-mode span (window 150): sliding layers store their last W tokens raw
    blob = codec.encode(k, v, pos, window=150)
    assert parse_blob(blob)[0]["mode"] == "raw"
    layers = codec.decode_ragged(blob)
    assert torch.equal(layers[0][0], k[0, 50:]) and torch.equal(layers[1][1], v[1])


def test_fused_path_refuses_token_sets_and_spans_use_the_reference_path(win_cal, win_synth):
    force = CodecOptions(fused="force")  # the fused path would run on the CPU for any other calibration
    codec = KvtcCodec(win_cal, ratio=8, window=16, options=force)
    assert codec.fused is None and codec.token_sets
    k, v, pos = win_synth.sample(300)
    spans = [EncodeSpan(0, pos[:160], window=0), EncodeSpan(160, pos[160:])]
    enc = codec.encode_spans(spans, lambda a, b: (k[:, a:b], v[:, a:b]))
    assert not enc.fused
    blobs = list(enc.blobs)
    assert blobs[1] == codec.encode(k[:, 160:], v[:, 160:], pos[160:])
    restore = codec.restore([RestoreRun(blobs[1], 60, 80)])  # tokens 220..300: inside every layer's set
    got = list(restore)
    assert not restore.fused and [layer for layer, _ in got] == [0, 1, 2, 3]
    ref = codec.decode_ragged(blobs[1])
    for layer, parts in got:
        (kk, vv), a = parts[0], codec.layer_ranges(blobs[1])[layer][0]
        assert torch.equal(kk, ref[layer][0][60 - a : 140 - a]) and torch.equal(vv, ref[layer][1][60 - a : 140 - a])
    with pytest.raises(TierError, match="token sets"):  # tokens a sliding layer does not hold: refused, never wrong
        list(codec.restore([RestoreRun(blobs[1], 0, 80)]))


@pytest.mark.model
def test_real_smollm2_kv_with_an_artificial_window(smol_samples, smol_fp, smol_heldout):
    """Real KV (SmolLM2) with every third layer given a 511-token window: the sliding group is fitted and coded on
    its last 511 tokens only, and each layer decodes its own tokens with a bounded error at 16x."""
    windows = tuple(511 if i % 3 == 0 else 0 for i in range(smol_fp.num_layers))
    fp = dataclasses.replace(smol_fp, windows=windows)
    cal = calibrate(smol_samples[:4], fp, ratios=(16,), rank=1024, niter=2, dp_tokens=4096, progress=False)
    assert [g.tokens for g in cal.groups] == [511, 0]
    k, v, pos = smol_heldout
    codec = KvtcCodec(cal, ratio=16)
    blob = codec.encode(k, v, pos)
    T = k.shape[1]
    ranges = codec.layer_ranges(blob)
    rk, rv = [], []
    for layer, (k2, v2) in enumerate(codec.decode_ragged(blob)):
        a = T - 511 if windows[layer] else 0
        assert ranges[layer] == (a, T) and k2.shape[0] == T - a
        rk.append(rel(k2, k[layer, a:]))
        rv.append(rel(v2, v[layer, a:]))
    # measured 0.152 / 0.378 (two groups by type fitted on 8K tokens; the joint basis on 98K: K 0.084, V 0.22)
    assert max(rk) < 0.2 and sum(rv) / len(rv) < 0.45
    st = codec.stats(blob)
    assert st["held_bytes_16bit"] < 0.8 * st["raw_bytes_16bit"] and st["ratio"] > 14


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("transformers")
    from dynamo_kvtc.calibration.models import load_model, resolve_model
    from dynamo_kvtc.errors import ModelError

    try:
        resolve_model("gemma3-270m")
    except ModelError as e:
        pytest.skip(f"Gemma-3-270M not installed: {e}")
    return load_model("gemma3-270m")


@pytest.mark.model
def test_gemma3_sliding_layers_round_trip_and_score_like_the_model(gemma):
    """Gemma-3-270M (15 of 18 layers slide over 512 positions): capture keeps every layer's full KV, the harness's
    cache drops what a sliding layer drops and scores exactly like the model itself; a token-set calibration then
    codes the sliding layers' last 511 tokens only and the kvtc reconstruction scores close to vanilla."""
    from dynamo_kvtc.calibration.data import calibration_texts
    from dynamo_kvtc.calibration.models import capture_kv, fingerprint_of, iter_model_kv
    from dynamo_kvtc.evaluation.harness import score

    model, tok = gemma
    fp = fingerprint_of(model, tok)
    assert fp.windows == tuple(0 if i % 6 == 5 else 511 for i in range(18))
    ids = tok(calibration_texts()[0], return_tensors="pt", add_special_tokens=False)["input_ids"][0][:1100]
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids[None]).logits[0, -40:].float(), -1)
    k, v, pos = capture_kv(model, ids[:-40], kv_dtype=torch.float32)
    assert k.shape[:2] == (18, 1060)
    lp = score(model, ids[-40:], k, v, 1060)
    assert (lp - ref).abs().max() < 1e-3  # the built cache is the model's own (sliding layers truncated)
    samples = list(iter_model_kv(model, tok, calibration_texts()[1:], seq_len=1024, max_tokens=3000))
    cal = calibrate(samples, fp, ratios=(16,), rank=768, niter=2, dp_tokens=2048, progress=False)
    assert cal.layer_order[:15] == tuple(i for i in range(18) if i % 6 != 5)
    codec = KvtcCodec(cal, ratio=16)
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    blob = codec.encode(kb, vb, pos)
    layers = codec.decode_ragged(blob)
    assert [x[0].shape[0] for x in layers] == [1060 if w == 0 else 511 for w in fp.windows]
    from dynamo_kvtc.evaluation.methods import Kvtc

    rec = Kvtc(cal, 16).reconstruct(kb, vb, pos)
    lp2 = score(model, ids[-40:], rec.keys, rec.values, 1060)
    kl = float((ref.exp() * (ref - lp2)).sum(-1).mean())
    assert kl < 0.2


@pytest.mark.parametrize("kept_only", [False, True])
def test_sliding_groups_fit_on_every_row_or_on_the_kept_rows(win_synth, kept_only):
    from dynamo_kvtc.calibration.calibrate import CalibrationConfig, Calibrator, KvSample

    cfg = CalibrationConfig(ratios=(4,), dp_tokens=256, progress=False, kept_rows_only=kept_only)
    cal = Calibrator(win_synth.fp, cfg)
    for i in range(3):
        cal.add(KvSample(*win_synth.sample(400, start=i * 41)))  # the first sample's 4 sinks are excluded
    assert cal.mom[(1, "k")].n == 3 * 400 - 4
    assert cal.mom[(0, "k")].n == (3 * W if kept_only else 3 * 400 - 4)
    out = cal.finish()
    assert [g.tokens for g in out.groups] == [W, 0] and out.layer_order == (0, 2, 1, 3)
