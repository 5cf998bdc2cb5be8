"""FP8 KV caches (vLLM ``--kv-cache-dtype fp8``/``fp8_e4m3``/``fp8_e5m2``): the connector's worker reads real FP8 paged
tensors (uint8 storage as vLLM allocates them, or float8) through per-layer scales, encodes the values, and restores
them as FP8 bytes with the same scales. The real engine cannot run an FP8 cache on this machine's CPU (vLLM needs
AVX-512 or AMX for it; the first test proves it with vLLM's own check), so the worker is driven in-process."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
import torch

from dynamo_kvtc.calibration.synthetic import synthetic_calibration, synthetic_kv
from dynamo_kvtc.codec import fp8
from dynamo_kvtc.connector.config import ConnectorConfig
from dynamo_kvtc.connector.vllm.step_plan import LoadOp, SaveOp, StepPlan
from dynamo_kvtc.connector.vllm.worker import KvtcWorker
from dynamo_kvtc.errors import ConfigError
from dynamo_kvtc.tiers.keys import sequence_hashes
from dynamo_kvtc.tiers.layout import PagedKV

L, H, D, BS, NB = 4, 2, 64, 16, 40
K_SCALES, V_SCALES = (0.02, 0.01, 0.03, 0.015), (0.01, 0.02, 0.005, 0.01)


def test_vllm_cpu_fp8_kv_needs_avx512_or_amx():
    """Why the engine is not in this test: vLLM's CPU attention refuses an FP8 cache without AVX-512/AMX."""
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU runs FP8 KV in vLLM")
    with pytest.raises(NotImplementedError, match="AVX-512 or AMX"):
        cpu_attn._get_attn_isa(torch.bfloat16, BS, D, "fp8")


def test_quantize_saturates_and_round_trips_through_bfloat16():
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = torch.arange(256, dtype=torch.uint8).view(fmt)
        q = q[torch.isfinite(q.float())].view(torch.uint8)  # every finite byte
        for scale in (1.0, 0.0173, 3.5):
            x = fp8.dequantize(q, fmt, scale)  # bfloat16, what the codec sees
            assert torch.equal(fp8.quantize(x, fmt, scale, torch.uint8).view(fmt).float(), q.view(fmt).float())
        big = torch.tensor([1e9, -1e9, float(torch.finfo(fmt).max) * 2])
        back = fp8.quantize(big, fmt, 1.0, fmt).float()
        assert torch.isfinite(back).all() and back.abs().max() == torch.finfo(fmt).max  # saturated, never inf/NaN


def test_paged_fp8_refuses_bad_scales_and_mismatched_dtypes():
    c = [torch.zeros(2, NB, BS, H, D, dtype=torch.uint8) for _ in range(L)]
    with pytest.raises(ConfigError, match="k_scales"):
        PagedKV(c, "flash", cache_dtype="fp8", k_scales=[1.0] * (L - 1))
    with pytest.raises(ConfigError, match="v_scales"):
        PagedKV(c, "flash", cache_dtype="fp8", v_scales=[1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ConfigError, match="needs an fp8 cache dtype"):
        PagedKV(c, "flash")  # uint8 bytes without a format
    kv = PagedKV(c, "flash", cache_dtype="fp8_e5m2")
    assert kv.dtype == torch.float8_e5m2 and kv.value_dtype == torch.bfloat16 and not kv.addressable


@pytest.fixture(scope="module")
def cal_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal") / "synthetic"
    synthetic_calibration(L, H, D, theta=1e4, ratios=(16,), rank=256, dp_rows=1024).save(d)
    return d


def _worker(cfg: ConnectorConfig, cache_dtype: str) -> KvtcWorker:
    hf = SimpleNamespace(
        architectures=["SyntheticForCausalLM"],
        num_hidden_layers=L,
        num_key_value_heads=H,
        num_attention_heads=H,
        hidden_size=H * D,
        head_dim=D,
        rope_theta=1e4,
    )
    return KvtcWorker(
        cfg,
        engine_id=f"t-{uuid.uuid4()}",
        model="synthetic",
        hf_config=hf,
        block_size=BS,
        num_blocks=NB,
        kv_cache_dtype=cache_dtype,
    )


def _names():
    return [f"model.layers.{i}.self_attn.attn" for i in range(L)]


@pytest.mark.parametrize(
    "cache_dtype, storage, layout",
    [
        ("fp8", torch.uint8, "flash"),
        ("fp8_e4m3", torch.float8_e4m3fn, "flashinfer"),
        ("fp8_e5m2", torch.uint8, "flash"),
    ],
)
@pytest.mark.parametrize("lossless", [True, False])
def test_worker_saves_and_restores_an_fp8_cache(cal_dir, cache_dtype, storage, layout, lossless):
    fmt = fp8.kv_format(cache_dtype)
    extra = {"calibration": str(cal_dir), "min_tokens": 16, "ratio": 16}
    extra["window"] = 1 << 20 if lossless else 16
    w = _worker(ConnectorConfig.from_sources(extra, {}), cache_dtype)
    shape = (2, NB, BS, H, D) if layout == "flash" else (NB, 2, BS, H, D)
    caches = {n: torch.zeros(shape, dtype=storage) for n in _names()}
    w.register_kv_caches(caches, scales={n: (K_SCALES[i], V_SCALES[i]) for i, n in enumerate(_names())})
    try:
        assert w.disabled is None, w.disabled
        assert w.store.kv.dtype == fmt
        n = 12
        k, v, _ = synthetic_kv(w.store.cal, n * BS)
        src, dst = list(range(3, 3 + n)), list(range(20, 20 + n))
        kv = w.store.kv
        for i in range(L):  # the engine writes FP8 bytes (values / scale)
            kv.scatter_layer(i, src, k[i], v[i])
        k8, v8 = kv.gather(src)  # what the cache holds, as values
        assert kv.gather(dst)[0].abs().max() == 0
        tokens = list(range(1000, 1000 + n * BS))
        hashes = sequence_hashes(tokens, BS)
        w.save(StepPlan(saves=[SaveOp("r1", hashes, None, 0, tokens, src, tail=True, final=True)]))
        w.wait_idle()
        assert w.match(hashes) == (n, n)
        w.start_load(StepPlan(loads=[LoadOp("r2", hashes, dst)]))
        for name in caches:
            w.wait_layer(name)
        w.save(None)
        assert w.load_errors() == set()
        k2, v2 = kv.gather(dst)
        raw = [c.view(torch.uint8) for c in caches.values()]
        blocks = (lambda c, ids: c[:, ids]) if layout == "flash" else (lambda c, ids: c[ids])
        if lossless:  # the same FP8 bytes come back
            assert all(torch.equal(blocks(c, dst), blocks(c, src)) for c in raw)
        else:
            rk = float((k2.float() - k8.float()).norm() / k8.float().norm())
            rv = float((v2.float() - v8.float()).norm() / v8.float().norm())
            assert rk < 0.3 and rv < 0.3, (rk, rv)
        st = w.store.stats  # the stored ratio is stated against the FP8 cache: one byte per element
        assert st.offload_raw_bytes == n * BS * 2 * L * H * D
        if not lossless:
            assert st.offload_raw_bytes / st.offload_stored_bytes > 2, st
    finally:
        w.shutdown()


def test_fp8_cache_without_scales_for_every_layer_is_refused(cal_dir):
    w = _worker(ConnectorConfig.from_sources({"calibration": str(cal_dir)}, {}), "fp8")
    caches = {n: torch.zeros(2, NB, BS, H, D, dtype=torch.uint8) for n in _names()}
    try:
        w.register_kv_caches(caches, scales={})  # vLLM's layers could not be read: never guess scales
        assert w.store is None and "scale" in w.disabled
    finally:
        w.shutdown()


def test_blobs_name_their_fp8_source_and_other_caches_miss_them(cal_dir):
    from dynamo_kvtc.calibration.artifact import Calibration
    from dynamo_kvtc.codec.container import parse_blob
    from dynamo_kvtc.codec.factory import make_codec
    from dynamo_kvtc.errors import WrongCalibrationError

    cal = Calibration.load(cal_dir)
    k, v, pos = synthetic_kv(cal, 64)
    plain = make_codec(cal, ratio=16, sinks=4, window=16)
    e4m3 = make_codec(cal, ratio=16, sinks=4, window=16)
    fp8.mark_kv_source(e4m3, "fp8_e4m3")
    e5m2 = make_codec(cal, ratio=16, sinks=4, window=16)
    fp8.mark_kv_source(e5m2, "fp8_e5m2")
    from_fp8 = e4m3.encode(k, v, pos)
    from_bf16 = plain.encode(k, v, pos)
    assert parse_blob(from_fp8)[0]["kv"] == "fp8_e4m3" and "kv" not in parse_blob(from_bf16)[0]
    e4m3.check_blob(from_fp8)
    plain.check_blob(from_bf16)  # a 16-bit cache's blobs keep their bytes (no key written)
    for codec, blob in ((plain, from_fp8), (e5m2, from_fp8), (e4m3, from_bf16)):
        with pytest.raises(WrongCalibrationError, match="KV cache"):
            codec.check_blob(blob)  # a restore's miss, never values of the wrong format


def test_eval_fp8_input_rounds_in_and_out_and_states_ratios_against_fp8(synth, synth_cal):
    from dynamo_kvtc.evaluation.methods import Kvtc, Vanilla
    from dynamo_kvtc.evaluation.methods.fp8_input import Fp8Input

    k, v, pos = synth.sample(256, dtype=torch.float32)
    fmt = torch.float8_e4m3fn
    van = Fp8Input(Vanilla(window=32)).reconstruct(k, v, pos)
    assert torch.equal(van.keys, fp8.round_fp8(k, fmt, 1.0)) and not torch.equal(van.keys, k)  # the FP8-KV baseline
    plain, wrapped = Kvtc(synth_cal, 8, window=32), Fp8Input(Kvtc(synth_cal, 8, window=32))
    rec = wrapped.reconstruct(k, v, pos)
    assert torch.equal(fp8.round_fp8(rec.keys, fmt, 1.0), rec.keys)  # written back as FP8
    assert rec.ratio == pytest.approx(plain.reconstruct(k, v, pos).ratio / 2, rel=0.05)  # 8x of 16-bit = 4x of FP8


def test_calibration_sees_fp8_rounded_kv():
    from argparse import Namespace

    from dynamo_kvtc.calibration.build import _as_cached

    k, v, pos = torch.randn(2, 8, 1, 4) * 3, torch.randn(2, 8, 1, 4), torch.arange(8)
    assert _as_cached(Namespace(kv_dtype="auto"), k, v, pos)[0] is k
    k8, v8, _ = _as_cached(Namespace(kv_dtype="fp8_e5m2", kv_scale=0.5), k, v, pos)
    assert torch.equal(k8, fp8.round_fp8(k, torch.float8_e5m2, 0.5)) and not torch.equal(k8, k)


def test_cli_takes_the_fp8_options():
    from dynamo_kvtc.cli.main import build_parser

    p = build_parser()
    assert p.parse_args(["bench", "gpu", "--kv-dtype", "fp8"]).kv_dtype == "fp8"
    assert p.parse_args(["eval", "--kv-dtype", "fp8", "--out", "x"]).kv_dtype == "fp8"
    a = p.parse_args(["calibrate", "--kv-dtype", "fp8_e4m3", "--kv-scale", "0.25", "--out", "x"])
    assert (a.kv_dtype, a.kv_scale) == ("fp8_e4m3", 0.25)
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "gpu", "--kv-dtype", "int8"])


def test_bench_gpu_fp8_restore_runs_at_tiny_size(monkeypatch, synth_cal):
    """``bench gpu --kv-dtype fp8``'s part on the CPU stand-in (the numbers mean nothing here; the H200 measures)."""
    from dynamo_kvtc.bench import gpu_timing as gt
    from dynamo_kvtc.bench.gpu_fp8 import fp8_restore
    from dynamo_kvtc.bench.gpu_model import PagedCache, fill_synthetic_kv

    monkeypatch.setattr(gt, "cuda", gt.CpuCuda())
    fp = synth_cal.fingerprint
    B, T, bs = 2, 256, 16
    nb = B * T // bs
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(0))
    block_ids = [perm[b * (T // bs) : (b + 1) * (T // bs)] for b in range(B)]
    src = PagedCache(fp.num_layers, nb, bs, fp.num_kv_heads, fp.head_dim, torch.device("cpu"))
    fill_synthetic_kv(src, synth_cal, block_ids, T, seed=1)
    run = SimpleNamespace(
        L=fp.num_layers, H=fp.num_kv_heads, D=fp.head_dim, bs=bs, nblocks=nb, B=B, T=T, dev=torch.device("cpu"),
        args=SimpleNamespace(ratio=8.0, tag="deflate", repeat=1), flat_ids=torch.cat(block_ids), block_ids=block_ids,
        src=src, cal=synth_cal,
    )  # fmt: skip
    out = fp8_restore(run, "fp8")
    assert out["finite"] and out["rel_err_k"] < 0.3 and out["rel_err_v"] < 0.3, out
    assert out["raw_fp8_bytes"] == 2 * fp.num_layers * B * T * fp.num_kv_heads * fp.head_dim
    assert out["raw_restore_all_layers_ms"] > 0 and out["kvtc_restore_all_layers_ms"] > 0
