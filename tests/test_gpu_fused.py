"""The fused GPU codec (dynamo_kvtc.codec.gpu): kernels against their torch twins, blobs against the reference path,
interoperability, paged sources and destinations, corruption, streams, the store on CUDA.

- Kernel tests run on CUDA; without CUDA they skip, unless Triton is installed and ``TRITON_INTERPRET=1``, which runs
  them on the CPU through Triton's interpreter (its fp32->fp8 and fp32->bf16 conversions do not round to nearest
  even, so those two comparisons stay CUDA-only).
- Codec tests run the whole fused pipeline: on CUDA with the Triton kernels, on the CPU with the torch twins of each
  stage (same batching, layouts, CRCs, container; zlib instead of nvCOMP).
- Speed is measured by ``dynamo-kvtc bench gpu``, never here.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from dynamo_kvtc import KvtcCodec, settings
from dynamo_kvtc.codec import CodecOptions
from dynamo_kvtc.codec.container import parse_blob
from dynamo_kvtc.codec.entropy import nvcomp_available
from dynamo_kvtc.codec.rope import RotaryConfig, rotate
from dynamo_kvtc.errors import CorruptBlobError, InputError

from .conftest import marks, offload_seq, rel

CUDA = torch.cuda.is_available()


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


INTERPRET = not CUDA and os.environ.get("TRITON_INTERPRET") == "1" and _triton_ok()
DEV = "cuda" if CUDA else "cpu"

kernels = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA (or Triton with TRITON_INTERPRET=1 on the CPU)"),
]
cuda_only = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
needs_nvcomp = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA and nvcomp_available()), reason="needs CUDA and nvidia-nvcomp-cu13"),
]


STRICT = CodecOptions(fused_strict=True)  # a failing fast path must fail the test, not fall back


@pytest.fixture(scope="module")
def ops():
    if CUDA and not _triton_ok():
        pytest.skip("Triton not importable on this CUDA machine")
    from dynamo_kvtc.codec.gpu.ops import TorchOps, TritonOps

    return TritonOps(), TorchOps()


# ------------------------------------------------------------------------------------------------ kernels
@marks(kernels)
def test_crc_kernel_equals_zlib(ops):
    tri, _ = ops
    g = torch.Generator().manual_seed(0)
    n = 300_000 if CUDA else 40_000
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    offs = [0, 5, n // 3, n - 10, 7, 0]
    lens = [5, n // 3 - 5, n // 2 + 1, 10, 0, n]
    want = [zlib.crc32(bytes(data[o : o + k].numpy())) for o, k in zip(offs, lens)]
    assert tri.crc(data.to(DEV), offs, lens) == want


@marks(kernels)
def test_copy_chunks(ops):
    tri, ref = ops
    src = torch.randint(0, 256, (100_000,), dtype=torch.uint8).to(DEV)
    so, do, ln = [0, 1000, 77, 99_000], [5, 40_000, 90_001, 75_000], [999, 30_000, 3, 1000]  # disjoint targets
    a = torch.zeros(100_000, dtype=torch.uint8, device=DEV)
    b = a.clone()
    tri.copy_chunks(src, a, so, do, ln)
    ref.copy_chunks(src, b, so, do, ln)
    assert torch.equal(a, b) and int(a[5:1004].sum()) == int(src[:999].sum())
    tri.COPY_PIECE = 4096  # chunks given on the host are split into pieces of at most this (one program each)
    c = torch.zeros_like(a)
    tri.copy_chunks(src, c, so, do, ln)
    assert torch.equal(c, b)


ROPES = [
    RotaryConfig(16, theta=1e4),
    RotaryConfig(16, style="interleaved", rotary_dim=8),
    RotaryConfig(16, scaling="yarn", factor=4.0, original_max_position_embeddings=64),
    RotaryConfig(16, scaling="none"),
]


@marks(kernels)
@pytest.mark.parametrize("cfg", ROPES, ids=["half", "interleaved-partial", "yarn", "none"])
def test_prep_and_post_match_torch_and_rope(ops, cfg):
    from dynamo_kvtc.codec.gpu.ops import rope_tables

    tri, ref = ops
    H, D, R = 3, 16, 70
    g = torch.Generator().manual_seed(1)
    src = torch.randn(200, H, D, generator=g).to(torch.bfloat16).to(DEV)
    roff = (torch.randperm(200, generator=g)[:R] * H * D).to(torch.int64).to(DEV)
    pos = (torch.arange(R) * 3 + 5).to(DEV)
    mean = torch.randn(H * D, generator=g).to(DEV)
    inv = rope_tables(cfg, pos, D, inverse=True)
    outs = []
    for o in (tri, ref):
        out = torch.full((R, 2 * H * D), float("nan"), dtype=torch.float16, device=DEV)
        flag = torch.zeros(1, dtype=torch.int32, device=DEV)
        o.prep(src, roff, out, H * D, mean, inv, flag, H, D, D, 1)
        assert int(flag) == 0
        outs.append(out)
    assert torch.equal(outs[0][:, H * D :], outs[1][:, H * D :])
    x = src[(roff // (H * D))].float()
    if cfg.scaling != "none":
        cos, sin = cfg.cos_sin(pos)
        x = rotate(x, cos, sin, cfg, inverse=True)
    want = x.reshape(R, -1) - mean
    assert (outs[0][:, H * D :].float() - want).abs().max() <= 2e-3 * want.abs().max()
    # post: the forward rotation, + mean, scattered to offsets; -1 rows untouched
    fwd = rope_tables(cfg, pos, D, inverse=False)
    doff = (torch.arange(R) * H * D + 50 * H * D).to(torch.int64).to(DEV)
    doff[3] = -1
    for dtype in (torch.float32, torch.bfloat16):
        dsts = []
        for o in (tri, ref):
            dst = torch.zeros(300, H, D, dtype=dtype, device=DEV)
            o.post(want.to(DEV), doff, dst, mean, fwd, H, D, D, 1)
            dsts.append(dst)
        if dtype == torch.float32:
            assert torch.allclose(dsts[0], dsts[1], rtol=1e-6, atol=1e-6)
            keep = torch.ones(R, dtype=torch.bool)
            keep[3] = False
            back = dsts[0][50 : 50 + R][keep.to(DEV)]
            assert rel(back, src[(roff // (H * D))][keep.to(DEV)]) < 2e-3
            assert float(dsts[0][53].abs().sum()) == 0.0
        elif CUDA:  # the interpreter truncates fp32 -> bf16
            assert torch.equal(dsts[0], dsts[1])


@marks(kernels)
def test_prep_flags_nonfinite_and_fp16_overflow(ops):
    tri, _ = ops
    H, D = 2, 16
    src = torch.randn(40, H, D).to(torch.bfloat16).to(DEV)
    src[7, 1, 3] = 1e5  # beyond fp16 after mean subtraction
    roff = (torch.arange(40) * H * D).to(DEV)
    out = torch.empty(40, H * D, dtype=torch.float16, device=DEV)
    flag = torch.zeros(1, dtype=torch.int32, device=DEV)
    tri.prep(src, roff, out, 0, torch.zeros(H * D, device=DEV), None, flag, H, D, D, 1)
    assert int(flag) == 2
    src[9, 0, 0] = float("nan")
    flag.zero_()
    tri.prep(src, roff, out, 0, torch.zeros(H * D, device=DEV), None, flag, H, D, D, 1)
    assert int(flag) & 1


@marks(kernels)
@pytest.mark.parametrize("kind", ["int2", "int4", "fp8"])
@pytest.mark.parametrize("size", [1, 16, 64, 256])
@pytest.mark.parametrize("T", [64, 60, 33])
def test_quantize_and_dequantize_match_torch(ops, kind, size, T):
    if kind == "fp8" and not CUDA:
        pytest.skip("Triton's interpreter converts fp32->fp8 without round-to-nearest-even")
    from dynamo_kvtc.codec.quant import BITS

    tri, ref = ops
    n, rank = 3, 4 * size
    g = torch.Generator().manual_seed(T * 7 + size)
    c = (torch.randn(T + 5, rank + 7, generator=g) * 3).to(DEV)
    starts = torch.tensor([0, size, 3 * size], dtype=torch.int64, device=DEV)
    bits = BITS[kind]
    per = 8 // bits
    pack = per == 1 or T % per == 0
    nb = (n * size * T * bits + 7) // 8 if pack else n * size * T
    res = []
    for o in (tri, ref):
        shift = torch.zeros(n * T, dtype=torch.float16, device=DEV)
        scale = torch.zeros(n * T, dtype=torch.float16, device=DEV)
        codes = torch.zeros(nb, dtype=torch.uint8, device=DEV)
        o.quantize(c, T, kind, size, starts, shift, scale, codes, pack)
        res.append((shift, scale, codes))
    for a, b in zip(*res):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if pack:
        outs = []
        for o in (tri, ref):
            out = torch.zeros(T, rank, dtype=torch.float16, device=DEV)
            o.dequant(res[1][2], res[1][0], res[1][1], kind, size, starts, out, T)
            outs.append(out)
        assert torch.equal(outs[0], outs[1])


# ------------------------------------------------------------------------------------------------ codec
def _fused(synth_cal, ratio=8, **kw):
    """The fused path: Triton kernels on CUDA, the torch twins of each stage on the CPU. fp16 projections: these
    tests hold the fused path to the float32 reference within fp16 rounding (5e-3); the default ``auto`` picks FP8
    on an H200, whose accuracy tests/test_projection.py checks against its own bounds."""
    kw.setdefault("projection", "fp16")
    c = KvtcCodec(synth_cal, ratio=ratio, device=DEV, fused=True, options=STRICT, **kw)
    assert c.fused is not None and (c.fused.ops.name == "triton" or not CUDA)
    return c


@pytest.mark.parametrize("T,start", [(700, 3), (300, 0), (150, 0), (10, 0)])
def test_fused_blobs_match_reference_path(synth, synth_cal, T, start):
    """Same format and sections; each path decodes the other's blob; reconstruction error unchanged."""
    k, v, pos = synth.sample(T, start=start)
    ref = KvtcCodec(synth_cal, ratio=8, device=DEV, fused=False)
    fus = _fused(synth_cal, tag="deflate")
    b_ref = ref.encode(k.to(DEV), v.to(DEV), pos)
    b_fus = fus.encode(k.to(DEV), v.to(DEV), pos)
    h1, r1 = parse_blob(b_ref)
    h2, r2 = parse_blob(b_fus)
    assert {**h1, "sections": None} == {**h2, "sections": None}
    assert [(r.name, r.tag, r.raw_len) for r in r1] == [(r.name, r.tag, r.raw_len) for r in r2]
    kr, vr = ref.decode(b_ref)
    kf, vf = fus.decode(b_fus)
    assert kf.device.type == torch.device(DEV).type and kf.dtype == k.dtype
    for blob in (b_ref, b_fus):  # cross-decoding: same blob, both paths
        a, b = ref.decode(blob), fus.decode(blob)
        assert rel(b[0], a[0]) <= 5e-3 and rel(b[1], a[1]) <= 5e-3
    ns, nw = h1["sinks"], h1["window"]
    if h1["mode"] == "kvtc":
        sl = slice(ns, T - nw)
        for x_f, x_r, x in ((kf, kr, k), (vf, vr, v)):
            ef, er = rel(x_f[:, sl], x[:, sl]), rel(x_r[:, sl], x[:, sl])
            assert abs(ef - er) <= 0.02 * er + 1e-4, (ef, er)
    assert torch.equal(kf[:, T - nw :].cpu(), k[:, T - nw :])  # the raw window is exact
    assert torch.equal(vf[:, T - nw :].cpu(), v[:, T - nw :])


def test_fused_batch_dense_and_paged(synth, synth_cal):
    """Several spans of several sequences in one call; restore into permuted paged blocks, partial ranges."""
    from dynamo_kvtc.codec.gpu import DenseKV, PagedBlocks, Span

    fus = _fused(synth_cal, tag="deflate")
    ref = KvtcCodec(synth_cal, ratio=8, device=DEV, fused=False)
    lens = (384, 256, 512)
    parts = [synth.sample(n) for n in lens]
    K = torch.cat([p[0] for p in parts], dim=1).to(DEV)
    V = torch.cat([p[1] for p in parts], dim=1).to(DEV)
    starts = [0, 384, 640]
    dense = DenseKV(K, V, seq_starts=starts)
    spans = [Span(0, 0, parts[0][2][:256], window=0), Span(0, 256, parts[0][2][256:]), Span(1, 0, parts[1][2])]
    spans.append(Span(2, 0, parts[2][2]))
    blobs = fus.fused.encode_batch(dense, spans)
    for sp, blob in zip(spans, blobs):  # each blob is a standalone, reference-readable blob
        n = len(sp.positions)
        a = starts[sp.seq] + sp.start
        kk, _ = ref.decode(blob)
        assert kk.shape[1] == n and rel(kk, K[:, a : a + n]) < 0.1
    # the same KV held in paged blocks (16 tokens each, permuted) as the source
    L, H, D, bs = K.shape[0], K.shape[2], K.shape[3], 16
    nblk = sum(lens) // bs
    perm = torch.randperm(nblk, generator=torch.Generator().manual_seed(3))
    cache = [torch.zeros(2, nblk, bs, H, D, dtype=K.dtype, device=DEV) for _ in range(L)]
    ids, b0 = [], 0
    for n in lens:
        ids.append(perm[b0 : b0 + n // bs].tolist())
        b0 += n // bs
    for layer in range(L):
        for s, n in enumerate(lens):
            blk = torch.tensor(ids[s], device=DEV)
            cache[layer][0].index_copy_(0, blk, K[layer, starts[s] : starts[s] + n].reshape(-1, bs, H, D))
            cache[layer][1].index_copy_(0, blk, V[layer, starts[s] : starts[s] + n].reshape(-1, bs, H, D))
    paged = PagedBlocks(lambda i: (cache[i][0], cache[i][1]), L, ids)
    blobs_p = fus.fused.encode_batch(paged, spans)
    for bp, bd in zip(blobs_p, blobs):  # the same KV read from blocks or a dense tensor: the same blobs
        assert parse_blob(bp)[0]["positions"] == parse_blob(bd)[0]["positions"]
        assert rel(ref.decode(bp)[0], ref.decode(bd)[0]) <= 1e-3
    # restore into other paged blocks; blob 2 only its tokens 64..191
    out = [torch.full_like(c, float("nan")) for c in cache]
    dest = PagedBlocks(lambda i: (out[i][0], out[i][1]), L, ids)
    job = fus.fused.open(blobs)
    layers = list(job.layers(dest=dest, targets=[(0, 0), (0, 256), (1, 0), (2, 0)], keep=[None, None, (64, 192), None]))
    assert layers == list(range(L))
    job.finish()
    for s, n in enumerate(lens):
        blk = torch.tensor(ids[s], device=DEV)
        got = out[0][0].index_select(0, blk).reshape(n, H, D)
        if s == 1:
            assert torch.isnan(got[:64]).all() and torch.isnan(got[192:]).all()
            got, want = got[64:192], K[0, starts[1] + 64 : starts[1] + 192]
        else:
            want = K[0, starts[s] : starts[s] + n]
        assert torch.isfinite(got).all() and rel(got, want) < 0.1


def test_fused_restore_mixes_ratios_and_raw_blobs(synth, synth_cal):
    """One restore of blobs at different ratios (the store's policy may mix them) and a raw-mode (short) blob."""
    from dynamo_kvtc.codec.gpu import FusedCodec

    parts = [synth.sample(n) for n in (300, 400, 12)]
    blobs = [
        KvtcCodec(synth_cal, ratio=r, device=DEV, fused=False).encode(k.to(DEV), v.to(DEV), p)
        for (k, v, p), r in zip(parts, (4, 16, 8))
    ]
    fus = _fused(synth_cal)
    fc = fus.fused if CUDA else FusedCodec(fus, ops="torch")
    job = fc.open(blobs)
    got = {layer: (k, v) for layer, k, v in job.layers()}
    job.finish()
    ref = KvtcCodec(synth_cal, ratio=8, device=DEV, fused=False)
    for i, blob in enumerate(blobs):
        kr, vr = ref.decode(blob)
        a, n = job.bases[i], job.tokens[i]
        kf = torch.stack([got[layer][0][a : a + n] for layer in sorted(got)])
        vf = torch.stack([got[layer][1][a : a + n] for layer in sorted(got)])
        assert rel(kf, kr) <= 5e-3 and rel(vf, vr) <= 5e-3


@marks(needs_nvcomp)
def test_fused_gpu_deflate_is_cpu_readable_and_back(synth, synth_cal):
    k, v, pos = synth.sample(600, start=2)
    fus = _fused(synth_cal, tag="deflate")
    cpu = KvtcCodec(synth_cal, ratio=8, device="cpu", fused=False)
    blob_gpu = fus.encode(k.cuda(), v.cuda(), pos)
    assert all(r.tag in ("deflate", "store") for r in parse_blob(blob_gpu)[1])
    kc, vc = cpu.decode(blob_gpu)  # zlib inflates nvCOMP's raw Deflate
    kg, vg = fus.decode(blob_gpu)
    assert rel(kg, kc) <= 5e-3 and rel(vg, vc) <= 5e-3
    blob_cpu = cpu.encode(k, v, pos)
    kg2, _ = fus.decode(blob_cpu)  # nvCOMP inflates zlib's
    assert rel(kg2, cpu.decode(blob_cpu)[0]) <= 5e-3


@marks(needs_nvcomp)
@pytest.mark.parametrize("tag", ["ans", "gdeflate"])
def test_fused_gpu_only_tags(synth, synth_cal, tag):
    k, v, pos = synth.sample(500)
    fus = _fused(synth_cal, tag=tag)
    blob = fus.encode(k.cuda(), v.cuda(), pos)
    assert tag in {r.tag for r in parse_blob(blob)[1]}
    ref = KvtcCodec(synth_cal, ratio=8, device="cuda", fused=False)
    a, b = ref.decode(blob), fus.decode(blob)
    assert rel(b[0], a[0]) <= 5e-3 and rel(b[1], a[1]) <= 5e-3
    assert fus.fused.entropy.decode_mode in ("config", "out", "views")


def test_fused_rejects_corrupt_blob_before_writing(synth, synth_cal):
    """Device verification (the default): the layers run, nothing is written, finish() names the section; eager
    verification refuses at open(); without a destination the verdict is read before the first layer."""
    from dynamo_kvtc.codec.gpu import DenseKV, RestoreJob

    k, v, pos = synth.sample(400)
    fus = _fused(synth_cal, tag="deflate")
    blob = bytearray(fus.encode(k.to(DEV), v.to(DEV), pos))
    rec = next(r for r in parse_blob(bytes(blob))[1] if r.name == "0.k")
    blob[rec.offset + rec.stored_len // 2] ^= 0x10
    out_k = torch.full_like(k, 7.0).to(DEV)
    out_v = torch.full_like(v, 7.0).to(DEV)
    job = fus.fused.open([bytes(blob)])
    assert list(job.layers(dest=DenseKV(out_k, out_v))) == list(range(k.shape[0]))
    with pytest.raises(CorruptBlobError, match="blob 0 section '0.k' checksum mismatch"):
        job.finish()
    assert job.bad_blobs == [0]
    assert bool((out_k == 7).all()) and bool((out_v == 7).all())
    with pytest.raises(CorruptBlobError, match="'0.k'"):
        RestoreJob(fus.fused, [bytes(blob)], verify="eager")  # the old contract: refused before anything is decoded
    with pytest.raises(InputError):
        RestoreJob(fus.fused, [bytes(blob)], verify="later")
    layers = fus.decode_layers(bytes(blob))
    with pytest.raises(CorruptBlobError):
        next(iter(layers))  # no layer of a corrupt blob is ever handed out


@marks(kernels)
def test_scatter_matches_torch_and_skips_negative_offsets(ops):
    tri, ref = ops
    H, D, n = 3, 16, 50
    g = torch.Generator().manual_seed(5)
    for src_dtype, dst_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)):
        vals = torch.randn(n, H, D, generator=g).to(src_dtype)
        vals[0, 0, 0] = -0.0
        vals = vals.to(DEV)
        off = (torch.randperm(120, generator=g)[:n] * H * D).to(DEV)
        off[7] = -1
        outs = []
        for o in (tri, ref):
            dst = torch.full((120, H, D), 3.0, dtype=dst_dtype, device=DEV)
            o.scatter(vals, off, dst, H, D, D, 1)
            outs.append(dst)
        if dst_dtype == torch.bfloat16 or CUDA:  # same dtype: bit for bit (-0.0 stays -0.0)
            assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
        keep = off >= 0
        assert torch.equal(outs[1][(off[keep] // (H * D))], vals[keep].to(dst_dtype))
        untouched = torch.ones(120, dtype=torch.bool, device=DEV)
        untouched[off[keep] // (H * D)] = False
        assert bool((outs[0][untouched] == 3.0).all())  # the -1 row went nowhere


@marks(kernels)
def test_crc_check_on_the_device(ops):
    tri, ref = ops
    g = torch.Generator().manual_seed(2)
    n = 200_000 if CUDA else 30_000
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    offs, lens = [0, 17, n // 2, 5], [n // 3, 1000, n // 2, 0]
    want = [zlib.crc32(bytes(data[o : o + k].numpy())) for o, k in zip(offs, lens)]
    want[1] ^= 1  # one wrong checksum
    for o in (tri, ref):
        got = o.crc_check(data.to(DEV), offs, lens, want)
        assert got.device.type == torch.device(DEV).type and got.cpu().tolist() == [True, False, True, True]


def test_fused_fp16_overflow_reruns_in_bf16(synth, synth_cal):
    k, v, pos = synth.sample(300)
    k = k.clone()
    k[1, 100, 0, :] = 8.0e4  # a (pathological) key beyond fp16 range
    fus = _fused(synth_cal, tag="deflate")
    blob = fus.encode(k.to(DEV), v.to(DEV), pos)
    assert fus.last_timings.get("encode_bf16_retry") == 1.0
    ref = KvtcCodec(synth_cal, ratio=8, device=DEV, fused=False)
    assert torch.isfinite(ref.decode(blob)[0]).all()


def test_fused_refuses_nonfinite_input(synth, synth_cal):
    k, v, pos = synth.sample(300)
    v = v.clone()
    v[2, 150, 1, 3] = float("inf")
    with pytest.raises(InputError):
        _fused(synth_cal, tag="deflate").encode(k.to(DEV), v.to(DEV), pos)


@marks(cuda_only)
def test_fused_work_is_ordered_on_the_callers_stream(synth, synth_cal):
    """Encode/decode queue on the current stream: a side stream ordered after its producer gets the right bytes."""
    k, v, pos = synth.sample(500)
    fus = _fused(synth_cal)
    ref_blob = fus.encode(k.cuda(), v.cuda(), pos)
    side = torch.cuda.Stream()
    src_k = torch.zeros_like(k, device="cuda")
    src_v = torch.zeros_like(v, device="cuda")
    torch.cuda._sleep(int(2e7))  # the producer is still busy when the side stream's work is queued
    src_k.copy_(k.cuda(non_blocking=True))
    src_v.copy_(v.cuda(non_blocking=True))
    ev = torch.cuda.Event()
    ev.record()
    with torch.cuda.stream(side):
        side.wait_event(ev)
        blob = fus.encode(src_k, src_v, pos)
        k2, _ = fus.decode(blob)
        side.synchronize()
    # had the side stream not waited for the producer it would have encoded zeros or a partial copy
    assert rel(k2, fus.decode(ref_blob)[0]) <= 1e-3 and rel(k2, k) < 0.1


@marks(cuda_only)
async def test_store_on_cuda_uses_the_fused_path(synth, synth_cal, monkeypatch):
    from dynamo_kvtc.tiers import KvtcStore, TierConfig

    proj = settings.env_value("projection")  # "auto" is FP8 on an H200 but float32 on the CPU reference store
    codec = CodecOptions(fused_strict=True, projection="fp16" if proj == "auto" else proj)
    cfg = TierConfig(host_bytes=1 << 22, ratio=8, min_tokens=0, window=32, page_bytes=1024, codec=codec)
    store = KvtcStore(synth_cal, cfg, device="cuda", block_size=16, span_tokens=128)
    k, v, _ = synth.sample(512)
    toks = list(range(512))
    res = offload_seq(store, toks, k.cuda(), v.cuda())
    assert res.stored_blocks == 32 and store.codec(8).fused is not None
    out_k = torch.zeros_like(k, device="cuda")

    def sink(layer, start, kk, vv):
        out_k[layer, start : start + kk.shape[0]] = kk

    h = store.start_onboard(store.hashes(toks), sink=sink)
    assert await h.done()
    torch.cuda.synchronize()
    cpu = KvtcStore(synth_cal, cfg, device="cpu", block_size=16, span_tokens=128)
    offload_seq(cpu, toks, k, v)
    ref = torch.zeros_like(k)

    def sink_cpu(layer, start, kk, vv):
        ref[layer, start : start + kk.shape[0]] = kk

    assert await cpu.start_onboard(cpu.hashes(toks), sink=sink_cpu).done()
    # fp16 GEMMs track the float32 reference closely; FP8 ones (DYN_KVTC_PROJECTION=fp8, emulated on the CPU side)
    # round both operands to e4m3, so the two paths differ by about one e4m3 step on some coefficients
    fp8 = store.codec(8).fused.projector.name.startswith("fp8")
    assert rel(out_k, ref) <= (2e-2 if fp8 else 5e-3)
    assert abs(rel(out_k, k) - rel(ref, k)) <= 0.02 * rel(ref, k) + 1e-4
    store.close()
    cpu.close()
