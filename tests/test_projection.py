"""FP8 projections (issue 14): the codec option ``projection``, the FP8 numerics, their accuracy cost on real SmolLM2
KV with the shipped calibration, and cross decoding between fp16 and fp8 projections, on the CPU reference path
(which emulates the FP8 GEMM) and on CUDA (``torch._scaled_mm``).

The blob format does not depend on the projection: only reconstruction error differs. Speed is measured by the
benchmarks, never here.
"""

from __future__ import annotations

import gc

import pytest
import torch

from dynamo_kvtc import KvtcCodec
from dynamo_kvtc.codec.container import parse_blob
from dynamo_kvtc.codec.fp8 import E4M3_MAX, fake_e4m3
from dynamo_kvtc.codec.gpu.projection import (
    Fp8Projector,
    Projector,
    fp8_support,
    make_projector,
    quantize_rows,
    resolve_projection,
)
from dynamo_kvtc.codec.kvtc import CodecConfig
from dynamo_kvtc.codec.options import CodecOptions
from dynamo_kvtc.errors import ConfigError
from dynamo_kvtc.tiers.config import TierConfig

from .conftest import marks, rel

CUDA = torch.cuda.is_available()
cuda_only = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def same_format(b1: bytes, b2: bytes) -> None:
    """Two blobs of one span: identical header and section table (names, tags, raw sizes); payloads may differ."""
    h1, r1 = parse_blob(b1)
    h2, r2 = parse_blob(b2)
    assert {**h1, "sections": None} == {**h2, "sections": None}
    assert [(r.name, r.tag, r.raw_len) for r in r1] == [(r.name, r.tag, r.raw_len) for r in r2]


STRICT = CodecOptions(fused_strict=True)  # a failing fast path must fail the test, not fall back


# ------------------------------------------------------------------------------------------------ config
def test_projection_option_is_validated(synth_cal):
    for good in ("auto", "fp16", "fp8"):
        assert CodecConfig(projection=good).projection == good
        assert KvtcCodec(synth_cal, ratio=8, projection=good).config.projection == good
    with pytest.raises(ConfigError, match="'fp4'"):
        CodecConfig(projection="fp4")
    with pytest.raises(ConfigError, match="'bf16'.*auto"):
        KvtcCodec(synth_cal, ratio=8, projection="bf16")
    assert KvtcCodec(synth_cal, ratio=8).config.projection == "auto"  # the table's default
    fp8 = TierConfig.from_env({"DYN_KVTC_PROJECTION": "FP8"}).codec  # the configuration parses it, the codec never
    assert KvtcCodec(synth_cal, ratio=8, options=fp8).config.projection == "fp8"
    assert KvtcCodec(synth_cal, ratio=8, projection="fp16", options=fp8).config.projection == "fp16"  # the argument
    with pytest.raises(ConfigError, match="DYN_KVTC_PROJECTION"):
        TierConfig.from_env({"DYN_KVTC_PROJECTION": "int8"})
    with pytest.raises(ConfigError, match="'int8'"):
        CodecOptions(projection="int8")


def test_projector_choice_on_the_cpu():
    assert resolve_projection("fp16", "cpu")[0] == "fp16"
    assert resolve_projection("auto", "cpu")[0] == "fp16"  # no FP8 tensor cores without CUDA
    assert resolve_projection("fp8", "cpu")[0] == "fp8-emulated"
    assert type(make_projector("auto", "cpu")) is Projector
    p = make_projector("fp8", "cpu")
    assert isinstance(p, Fp8Projector) and p.name == "fp8-emulated"
    assert not fp8_support("cpu").ok
    from dynamo_kvtc.codec.gpu import fused_status

    st = fused_status("cpu", "fp8")
    assert (st["projection"], st["projection_choice"]) == ("fp8-emulated", "fp8")


# ------------------------------------------------------------------------------------------------ numerics
def test_e4m3_rounding_per_row_and_per_column():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 70, generator=g) * torch.logspace(-3, 3, 40)[:, None]  # rows of very different scales
    x[7] = 0
    for dim in (1, 0):
        y = fake_e4m3(x, dim)
        amax = x.abs().amax(dim=dim, keepdim=True)
        assert torch.allclose(y.abs().amax(dim=dim, keepdim=True), amax, rtol=1e-6, atol=0)  # max is exact
        big = x.abs() >= amax * 2**-6  # e4m3 normal range below each slice's amax: relative error <= 2^-4
        err = ((y - x).abs() / x.abs().clamp_min(1e-30))[big]
        assert float(err.max()) <= 2**-4 + 1e-6
        assert 0.005 < float(err.mean()) < 0.04  # it really rounds (3 mantissa bits)
    assert torch.equal(fake_e4m3(x, 1)[7], torch.zeros(70))  # an all-zero row stays zero, no NaN
    q, s = quantize_rows(x.half(), k_pad=80)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (40, 80) and s.shape == (40, 1)
    assert torch.equal(q[:, 70:].float(), torch.zeros(40, 10))  # padding columns are zero
    assert float(q.float().abs().amax()) == E4M3_MAX
    assert rel(q[:, :70].float() * s, fake_e4m3(x.half(), 1)) < 1e-6


def test_emulated_gemm_equals_scaled_product_and_caches_operands(synth_cal):
    """The projector's emulated restore == fake-quantized operands multiplied in fp32; quantized coefficients are
    reused across layers, recomputed after an in-place change and dropped with their tensor."""
    from dynamo_kvtc.codec.gpu.fused import FusedCodec

    fc = FusedCodec(KvtcCodec(synth_cal, ratio=8, projection="fp8", fused=True, options=STRICT), ops="torch")
    proj, tab = fc.projector, fc.tables[0]
    assert proj.name == "fp8-emulated"
    rank = tab.k_plans[8.0].rank
    coeffs = (torch.randn(50, rank, generator=torch.Generator().manual_seed(1)) * 3).half()
    HD = fc.fp.num_kv_heads * fc.fp.head_dim
    for layer in range(2):
        cols = slice(layer * HD, (layer + 1) * HD)
        y = proj.restore(coeffs, tab, "k", cols)
        want = fake_e4m3(coeffs, 1) @ fake_e4m3(tab.k_basis[cols, :rank], 1).t()
        assert rel(y, want) < 1e-5
    q1 = proj.coeff_operand(coeffs)[0]
    assert proj.coeff_operand(coeffs)[0] is q1 and proj.cached_coefficients() == 1
    coeffs.mul_(2)  # in place: the cached operand is stale
    q2 = proj.coeff_operand(coeffs)[0]
    assert q2 is not q1 and proj.cached_coefficients() == 1
    del coeffs, q1, q2
    gc.collect()
    assert proj.cached_coefficients() == 0
    rows = torch.randn(30, tab.k_basis.shape[0], generator=torch.Generator().manual_seed(2)).half()
    c = proj.encode(rows, tab, "v", rank)
    assert c.shape == (30, rank) and c.dtype == torch.float32 and c.is_contiguous()
    assert rel(c, fake_e4m3(rows, 1) @ fake_e4m3(tab.v_basis[:, :rank], 0)) < 1e-5


def test_fp16_and_auto_reference_paths_stay_float32(synth, synth_cal):
    """On the CPU reference path, auto and fp16 are today's float32 math (bit-identical blobs and decodes); fp8
    changes the numbers (positive control) but not the format."""
    k, v, pos = synth.sample(400, start=5)
    c16, cau, c8 = (KvtcCodec(synth_cal, ratio=8, projection=p, fused=False) for p in ("fp16", "auto", "fp8"))
    b16, bau, b8 = c16.encode(k, v, pos), cau.encode(k, v, pos), c8.encode(k, v, pos)
    assert b16 == bau
    assert all(torch.equal(a, b) for a, b in zip(c16.decode(b16), cau.decode(b16)))
    same_format(b16, b8)
    assert b8 != b16
    assert rel(c8.decode(b16)[0], c16.decode(b16)[0]) > 1e-3


# ------------------------------------------------------------------------------------------------ real KV
@pytest.fixture(scope="module")
def shipped_cal():
    from dynamo_kvtc.calibration.artifact import Calibration
    from dynamo_kvtc.calibration.catalog import find_calibration

    path = find_calibration("smollm2-135m-instruct")
    assert path is not None, "the shipped calibration calibrations/smollm2-135m-instruct is missing"
    return Calibration.load(path)


@pytest.fixture(scope="module")
def real_kv(smollm2):
    """KV of 640 held-out tokens of SmolLM2-135M-Instruct (an essay its calibration never saw)."""
    from dynamo_kvtc.calibration.data import heldout_texts
    from dynamo_kvtc.calibration.models import capture_kv

    model, tok = smollm2
    ids = tok(heldout_texts()[1], return_tensors="pt", add_special_tokens=False)["input_ids"][0][:640]
    with torch.no_grad():
        return capture_kv(model, ids)


@pytest.mark.model
@pytest.mark.parametrize("ratio", [16, 32])
def test_fp8_emulation_error_on_real_kv(shipped_cal, real_kv, ratio):
    """FP8 projections on the shipped SmolLM2 calibration: a small, bounded extra error on top of the codec's own,
    either way round (fp8-encoded blobs decode with fp16 projections and the reverse, same format)."""
    k, v, pos = real_kv
    c16 = KvtcCodec(shipped_cal, ratio=ratio, projection="fp16", fused=False)
    c8 = KvtcCodec(shipped_cal, ratio=ratio, projection="fp8", fused=False)
    b16, b8 = c16.encode(k, v, pos), c8.encode(k, v, pos)
    same_format(b16, b8)
    sl = slice(4, k.shape[1] - 128)  # the transform-coded tokens
    err = {}
    for enc, blob in (("fp16", b16), ("fp8", b8)):
        for dec, codec in (("fp16", c16), ("fp8", c8)):
            k2, v2 = codec.decode(blob)
            err[enc, dec] = (rel(k2[:, sl], k[:, sl]), rel(v2[:, sl], v[:, sl]))
    base_k, base_v = err["fp16", "fp16"]
    assert base_k < 0.2 and base_v < 0.4  # the codec itself (16x: ~0.09 / 0.23, 32x: ~0.13 / 0.35)
    for key, (ek, ev) in err.items():  # measured: fp8 both ways +0.002 K, +0.003 V (relative to the KV's norm)
        assert ek - base_k < 0.01 and ev - base_v < 0.015, (key, ek, ev, base_k, base_v)
    k16, v16 = c16.decode(b16)
    k8, v8 = c8.decode(b16)  # the same blob, the same coefficients: what the fp8 GEMM alone changes
    dk, dv = rel(k8[:, sl], k16[:, sl]), rel(v8[:, sl], v16[:, sl])
    assert 0.003 < dk < 0.03 and 0.006 < dv < 0.06, (dk, dv)  # measured ~0.017 / ~0.035
    assert torch.equal(k8[:, -128:], k[:, -128:])  # the raw window never goes through a projection


@pytest.mark.model
def test_fused_cpu_fp8_matches_reference_fp8(shipped_cal, real_kv):
    """The fused path's FP8 projector (emulated on the CPU) computes what the reference path's emulation does."""
    k, v, pos = real_kv
    ref = KvtcCodec(shipped_cal, ratio=16, projection="fp8", fused=False)
    fus = KvtcCodec(shipped_cal, ratio=16, projection="fp8", fused=True, options=STRICT)
    assert fus.fused.projector.name == "fp8-emulated"
    blob_ref, blob_fus = ref.encode(k, v, pos), fus.encode(k, v, pos)
    same_format(blob_ref, blob_fus)
    sl = slice(4, k.shape[1] - 128)
    for blob in (blob_ref, blob_fus):
        a, b = ref.decode(blob), fus.decode(blob)
        assert rel(b[0][:, sl], a[0][:, sl]) < 0.01 and rel(b[1][:, sl], a[1][:, sl]) < 0.01


# ------------------------------------------------------------------------------------------------ CUDA
@marks(cuda_only)
def test_cuda_fp8_gemm_support_and_auto():
    cc = torch.cuda.get_device_capability()
    sup = fp8_support("cuda")
    if cc < (8, 9):
        assert not sup.ok and resolve_projection("auto", "cuda")[0] == "fp16"
        assert type(make_projector("fp8", "cuda")) is Projector  # refused: fp16, logged once
        return
    assert sup.ok, sup.why
    assert sup.out_dtype in (torch.float32, torch.bfloat16)
    assert resolve_projection("auto", "cuda")[0] == "fp8"
    assert make_projector("auto", "cuda").name == "fp8"


def _fp8_cuda(cal, ratio=8, **kw):
    if not fp8_support("cuda").ok:
        pytest.skip(f"no FP8 GEMM here: {fp8_support('cuda').why}")
    c = KvtcCodec(cal, ratio=ratio, device="cuda", projection="fp8", options=STRICT, **kw)
    assert c.fused is not None and c.fused.projector.name == "fp8"
    return c


@marks(cuda_only)
def test_cuda_fp8_projector_matches_its_emulation(synth_cal):
    """torch._scaled_mm with row-wise scales == the same e4m3 operands multiplied in fp32 (up to its output dtype)."""
    c = _fp8_cuda(synth_cal)
    fc = c.fused
    tab = fc.tables[0]
    emu = Fp8Projector(out_dtype=None)
    rank = tab.k_plans[8.0].rank
    g = torch.Generator().manual_seed(3)
    coeffs = (torch.randn(3000, rank, generator=g) * torch.logspace(1, -2, rank)).half().cuda()
    HD = fc.fp.num_kv_heads * fc.fp.head_dim
    for layer in range(fc.fp.num_layers):
        cols = slice(layer * HD, (layer + 1) * HD)
        for kind in ("k", "v"):
            y, ye = fc.projector.restore(coeffs, tab, kind, cols), emu.restore(coeffs, tab, kind, cols)
            assert y.shape == ye.shape and rel(y, ye) < 5e-3
    assert fc.projector.cached_coefficients() == 1  # quantized once, reused by every layer and kind
    rows = torch.randn(2000, tab.k_basis.shape[0], generator=g).half().cuda()
    ce, cg = emu.encode(rows, tab, "k", rank), fc.projector.encode(rows, tab, "k", rank)
    assert cg.dtype == torch.float32 and cg.shape == (2000, rank) and rel(cg, ce) < 5e-3


@marks(cuda_only)
@pytest.mark.parametrize("T,start", [(900, 0), (333, 7)])
def test_cuda_fp8_restore_and_encode_against_fp16_and_reference(synth, synth_cal, T, start):
    """On the same blobs: the fused FP8 restore is within a bounded distance of the fused fp16 restore and of the CPU
    reference (float32, and its fp8 emulation); blobs cross between CPU and GPU and between fp8 and fp16."""
    k, v, pos = synth.sample(T, start=start)
    g8 = _fp8_cuda(synth_cal, tag="deflate")
    g16 = KvtcCodec(synth_cal, ratio=8, device="cuda", projection="fp16", tag="deflate", options=STRICT)
    r32 = KvtcCodec(synth_cal, ratio=8, projection="fp16", fused=False)
    r8 = KvtcCodec(synth_cal, ratio=8, projection="fp8", fused=False)
    b_g8 = g8.encode(k.cuda(), v.cuda(), pos)
    b_g16 = g16.encode(k.cuda(), v.cuda(), pos)
    b_r32 = r32.encode(k, v, pos)
    same_format(b_g8, b_r32)
    same_format(b_g16, b_r32)
    sl = slice(4 if start < 4 else 0, T - 128)
    for blob in (b_g8, b_g16, b_r32):
        x8, x16, x32, xe = g8.decode(blob), g16.decode(blob), r32.decode(blob), r8.decode(blob)
        for i in (0, 1):
            a8, a16, a32, ae = (t[i][:, sl].cpu() for t in (x8, x16, x32, xe))
            assert rel(a16, a32) < 5e-3  # fp16 fused path: the reference up to fp16 operands
            assert rel(a8, ae) < 1e-2  # fp8 fused path: the reference's fp8 emulation up to rounding order
            assert rel(a8, a32) < 0.06 and rel(a8, a16) < 0.06  # fp8 vs fp16/float32: bounded
    for x, i in ((k, 0), (v, 1)):  # end to end: fp8 on both sides costs little more than the codec's own error
        e8 = rel(g8.decode(b_g8)[i][:, sl].cpu(), x[:, sl])
        e32 = rel(r32.decode(b_r32)[i][:, sl], x[:, sl])
        assert e8 < e32 + 0.03, (e8, e32)


def test_fp8_restore_into_paged_blocks_layer_by_layer(synth, synth_cal):
    """The FP8 projector behind the engine-facing restore (CUDA: tensor cores; CPU: emulated): a paged destination,
    layers in order, the quantized coefficients made once per K/V and held for the job only."""
    from dynamo_kvtc.codec.gpu import PagedBlocks

    dev = "cuda" if CUDA else "cpu"
    if CUDA:
        g8 = _fp8_cuda(synth_cal, tag="deflate")
    else:
        g8 = KvtcCodec(synth_cal, ratio=8, projection="fp8", fused=True, options=STRICT)
    r8 = KvtcCodec(synth_cal, ratio=8, projection="fp8", fused=False)
    k, v, pos = synth.sample(512, start=0)
    blob = g8.encode(k.to(dev), v.to(dev), pos)
    L, T, H, D = k.shape
    bs, nblk = 16, T // 16
    ids = torch.randperm(nblk + 5, generator=torch.Generator().manual_seed(4))[:nblk].tolist()
    cache = [torch.full((2, nblk + 5, bs, H, D), float("nan"), dtype=k.dtype, device=dev) for _ in range(L)]
    dest = PagedBlocks(lambda i: (cache[i][0], cache[i][1]), L, [ids])
    job = g8.fused.open([blob])
    seen = []
    for layer in job.layers(dest=dest):
        seen.append(layer)
        assert g8.fused.projector.cached_coefficients() == 2  # K and V of the job's one plan, quantized once each
    job.finish()
    assert seen == list(range(L))
    ke, ve = r8.decode(blob)
    blk = torch.tensor(ids, device=dev)
    for layer in range(L):
        got_k = cache[layer][0].index_select(0, blk).reshape(T, H, D).cpu()
        got_v = cache[layer][1].index_select(0, blk).reshape(T, H, D).cpu()
        assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()
        assert rel(got_k[4:-128], ke[layer, 4:-128]) < 1e-2 and rel(got_v[4:-128], ve[layer, 4:-128]) < 1e-2
        assert torch.equal(got_k[-128:], k[layer, -128:])
    del job
    gc.collect()
    assert g8.fused.projector.cached_coefficients() == 0
