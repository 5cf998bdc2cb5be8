"""The fused restore streams layer group by layer group and never synchronises the host on its way to the last layer.

- CPU (the fused pipeline with its torch stages, zlib instead of nvCOMP): multi-group calibrations round trip like the
  reference path; group g+1 is decoded only after group g's layers were yielded; a corrupt byte in group 1 leaves a
  sentinel-filled destination byte for byte untouched and ``finish()`` names the blob and section.
- CUDA (skipped elsewhere): the same, plus no host synchronisation between ``open()`` and the last layer
  (``torch.cuda.set_sync_debug_mode("error")``), and the first layer ready before all of them.
"""

from __future__ import annotations

import pytest
import torch

from dynamo_kvtc import KvtcCodec, calibrate
from dynamo_kvtc.codec.container import parse_blob
from dynamo_kvtc.codec.entropy import nvcomp_available
from dynamo_kvtc.codec.options import CodecOptions
from dynamo_kvtc.errors import CorruptBlobError

from .conftest import rel

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TAG = "ans" if (CUDA and nvcomp_available()) else ("store" if CUDA else "deflate")  # sync-free on CUDA needs nvCOMP
cuda_only = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


STRICT = CodecOptions(fused_strict=True)  # a failing fast path must fail the test, not fall back


@pytest.fixture(scope="module", params=[2, 4], ids=["2groups", "4groups"])
def grouped_cal(request, synth):
    samples = [synth.sample(512, start=i * 37) for i in range(6)]
    return calibrate(
        samples, synth.fp, ratios=(8, 16), layer_groups=request.param, dp_tokens=2048, progress=False, seed=0
    )


def _fused(cal, tag=TAG, ratio=8):
    # fp16 projections: these tests hold the streamed restore to the float32 reference within 5e-3; the default
    # "auto" would be FP8 on an H200 (its own bounds: tests/test_projection.py)
    return KvtcCodec(cal, ratio=ratio, device=DEV, fused=True, window=32, tag=tag, projection="fp16", options=STRICT)


def _blobs(synth, codec, lens=(300, 200)):
    parts = [synth.sample(n, start=7 * i) for i, n in enumerate(lens)]
    return parts, [codec.encode(k.to(DEV), v.to(DEV), p) for k, v, p in parts]


def _dest(parts, fill):
    from dynamo_kvtc.codec.gpu import DenseKV

    K = torch.cat([p[0] for p in parts], dim=1).to(DEV)
    kk, vv = torch.full_like(K, fill), torch.full_like(K, fill)
    starts = [0]
    for k, _, _ in parts[:-1]:
        starts.append(starts[-1] + k.shape[1])
    return DenseKV(kk, vv, seq_starts=starts), kk, vv


def test_grouped_round_trip_matches_the_reference(synth, grouped_cal):
    """Every layer of every blob, written into a destination or handed out fresh, agrees with the reference
    decoder; both fused outputs are the same tensors; the raw window is exact."""
    fus = _fused(grouped_cal)
    ref = KvtcCodec(grouped_cal, ratio=8, device=DEV, fused=False, window=32)
    parts, blobs = _blobs(synth, fus)
    dest, kk, vv = _dest(parts, float("nan"))
    job = fus.fused.open(blobs)
    assert list(job.layers(dest=dest)) == list(range(synth.fp.num_layers))
    job.finish()
    job2 = fus.fused.open(blobs)
    fresh = {layer: (k, v) for layer, k, v in job2.layers()}
    job2.finish()
    a = 0
    for (k, v, _), blob in zip(parts, blobs):
        n = k.shape[1]
        kr, vr = ref.decode(blob)
        assert rel(kk[:, a : a + n], kr) <= 5e-3 and rel(vv[:, a : a + n], vr) <= 5e-3
        assert torch.equal(kk[:, a + n - 32 : a + n].cpu(), k[:, -32:]) and torch.equal(
            vv[:, a + n - 32 : a + n].cpu(), v[:, -32:]
        )
        a += n
    assert torch.equal(torch.stack([fresh[i][0] for i in sorted(fresh)]), kk)
    assert torch.equal(torch.stack([fresh[i][1] for i in sorted(fresh)]), vv)


def test_layer_zero_comes_before_group_one_is_decoded(synth, grouped_cal):
    """Group by group: when layer 0 is yielded, only group 0 was copied, checked, inflated and dequantized; the stage
    marks show h2d -> crc -> entropy -> dequantize -> that group's layers for each group in turn."""
    fus = _fused(grouped_cal)
    parts, blobs = _blobs(synth, fus)
    dest, _, _ = _dest(parts, 0.0)
    job = fus.fused.open(blobs)
    gen = job.layers(dest=dest)
    assert next(gen) == 0
    names = [n for n, _ in job.clock.marks]
    assert names.count("entropy") == 1 and names.count("dequantize") == 1
    assert all("raw_off" not in row for row in job.rows[1])  # group 1 not even laid out for inflation yet
    rest = list(gen)
    assert rest == list(range(1, synth.fp.num_layers))
    job.finish()
    names = [n for n, _ in job.clock.marks]
    groups = [t.layers for t in fus.fused.tables]
    want = ["start"]
    for l0, l1 in groups:
        want += ["h2d", "crc", "entropy", "dequantize"] + [f"layer{i}" for i in range(l0, l1)]
    assert names == want


@pytest.mark.parametrize("section", ["1.k", "1.window"])
def test_corrupt_group_one_leaves_the_destination_untouched(synth, grouped_cal, section):
    """One flipped byte in blob 1's group-1 section: every layer still comes out (nothing waits on the host); only
    verified bytes are written — group 0's layers hold the correct KV, every layer from group 1 on is byte for byte
    the sentinel — and finish() raises naming blob and section (the caller recomputes)."""
    from dynamo_kvtc.codec.gpu import PagedBlocks

    fus = _fused(grouped_cal)
    parts, blobs = _blobs(synth, fus, lens=(256, 192))
    bad = bytearray(blobs[1])
    rec = next(r for r in parse_blob(bytes(bad))[1] if r.name == section)
    bad[rec.offset + rec.stored_len // 3] ^= 0x04
    L, _, H, D = parts[0][0].shape
    bs = 16
    cache = [torch.full((2, 40, bs, H, D), -3.25, dtype=torch.bfloat16, device=DEV) for _ in range(L)]
    cache[0][0, 5, 3, 1, 2] = float("nan")
    before = [c.clone() for c in cache]
    ids = [list(range(39, 23, -1)), list(range(12))]  # permuted blocks, 16 for blob 0 and 12 for blob 1
    dest = PagedBlocks(lambda i: (cache[i][0], cache[i][1]), L, ids)
    job = fus.fused.open([blobs[0], bytes(bad)])
    assert list(job.layers(dest=dest)) == list(range(L))
    with pytest.raises(CorruptBlobError, match=f"blob 1 section '{section}' checksum mismatch"):
        job.finish()
    assert job.bad_blobs == [1]
    g1 = fus.fused.tables[1].layers[0]
    for c, b in zip(cache[g1:], before[g1:]):  # from the corrupt group on: untouched
        assert torch.equal(c.view(torch.int16), b.view(torch.int16))
    written = [c.clone() for c in cache[:g1]]
    # the same blobs intact: the sentinel is overwritten where the blobs go, and group 0 got the same bytes as before
    job = fus.fused.open(blobs)
    list(job.layers(dest=dest))
    job.finish()
    for c, w in zip(cache[:g1], written):
        assert torch.equal(c.view(torch.int16), w.view(torch.int16))
    assert not torch.equal(cache[L - 1][0, 39], before[L - 1][0, 39]) and torch.equal(cache[0][0, 20], before[0][0, 20])


def test_eager_verification_refuses_at_open(synth, grouped_cal):
    from dynamo_kvtc.codec.gpu import RestoreJob

    fus = _fused(grouped_cal)
    _, blobs = _blobs(synth, fus)
    bad = bytearray(blobs[0])
    rec = next(r for r in parse_blob(bytes(bad))[1] if r.name == "1.v")
    bad[rec.offset] ^= 0x80
    with pytest.raises(CorruptBlobError, match="blob 0 section '1.v'"):
        RestoreJob(fus.fused, [bytes(bad), blobs[1]], verify="eager")
    job = RestoreJob(fus.fused, blobs, verify="eager")
    assert len(list(job.layers())) == synth.fp.num_layers
    assert job.finish()["decode_first_layer_s"] > 0


# ------------------------------------------------------------------------------------------------ CUDA
def _pinned(blobs):
    out = []
    for b in blobs:
        t = torch.empty(len(b), dtype=torch.uint8, pin_memory=True)
        t.numpy()[:] = memoryview(b)
        out.append((t, 0, len(b)))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "bytes"])
def test_no_host_sync_between_open_and_the_last_layer(synth, grouped_cal, pinned):
    from dynamo_kvtc.codec.gpu import PagedBlocks

    fus = _fused(grouped_cal)
    parts, blobs = _blobs(synth, fus, lens=(256, 192))
    srcs = _pinned(blobs) if pinned else blobs
    L, _, H, D = parts[0][0].shape
    cache = [torch.full((2, 32, 16, H, D), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(L)]
    ids = [list(range(16)), list(range(16, 28))]
    warm = fus.fused.open(srcs)  # first use: kernels compiled, plan tables built
    list(warm.layers(dest=PagedBlocks(lambda i: (cache[i][0], cache[i][1]), L, ids)))
    warm.finish()
    for c in cache:
        c.fill_(float("nan"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        job = fus.fused.open(srcs)
        dest = PagedBlocks(lambda i: (cache[i][0], cache[i][1]), L, ids)
        got = list(job.layers(dest=dest))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got == list(range(L))
    st = job.finish()
    assert 0 < st["decode_first_layer_s"] < st["decode_total_s"]
    ref = KvtcCodec(grouped_cal, ratio=8, device=DEV, fused=False, window=32)
    kr, _ = ref.decode(blobs[1])
    got_k = torch.stack([cache[i][0][16:28].reshape(-1, H, D)[:192] for i in range(L)])
    assert rel(got_k, kr) <= 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_first_layer_before_all_layers_with_four_groups(synth):
    """With 4 groups (one layer each here) layer 0's event fires before group 1 is even inflated."""
    samples = [synth.sample(512, start=i * 37) for i in range(6)]
    cal = calibrate(samples, synth.fp, ratios=(8,), layer_groups=4, dp_tokens=2048, progress=False, seed=0)
    fus = _fused(cal)
    parts, blobs = _blobs(synth, fus, lens=(2048, 2048))
    dest, _, _ = _dest(parts, 0.0)
    for _ in range(2):  # the second run is timed
        job = fus.fused.open(_pinned(blobs))
        list(job.layers(dest=dest))
        st = job.finish()
    marks = dict(job.clock.marks[::-1])  # first occurrence of each name
    first, total = st["decode_first_layer_s"], st["decode_total_s"]
    assert 0 < first < total
    entropy_marks = [ev for n, ev in job.clock.marks if n == "entropy"]
    assert len(entropy_marks) == 4 and marks["layer0"].elapsed_time(entropy_marks[1]) >= 0


@pytest.mark.parametrize("projection", ["fp16", "fp8"])
def test_projection_chunks_of_layers_write_the_same_kv(synth, synth_cal, projection):
    """One GEMM per chunk of layers (``RestoreJob.gemm_bytes`` caps the chunk's K and V outputs): one layer per GEMM,
    chunks that do not divide the group, and the whole group write the same destination bit for bit; the chunk size
    follows the cap (at least one layer, at most the group)."""
    from dynamo_kvtc.codec.gpu.restore import RestoreJob

    fus = KvtcCodec(synth_cal, ratio=8, device=DEV, fused=True, window=32, tag=TAG, projection=projection,
                    options=STRICT)  # fmt: skip
    parts, blobs = _blobs(synth, fus)
    HD = synth.fp.num_kv_heads * synth.fp.head_dim
    Lg = [t.layers[1] - t.layers[0] for t in fus.fused.tables]
    outs, pers = [], []
    try:
        for layers in (1, 3, max(Lg)):
            dest, kk, vv = _dest(parts, float("nan"))
            job = fus.fused.open(blobs)
            rows = sum(n - 32 for n in (300, 200))  # coded rows: every token but the 32-token window (no sinks)
            esize = 4 if getattr(fus.fused.projector, "out_dtype", None) is None else 2
            RestoreJob.gemm_bytes = layers * 2 * rows * HD * esize
            assert list(job.layers(dest=dest)) == list(range(synth.fp.num_layers))
            job.finish()
            pers.append([job._layers_per_gemm(n, HD) for n in Lg])
            outs.append((kk.clone(), vv.clone()))
    finally:
        RestoreJob.gemm_bytes = 512 << 20
    assert Lg == [synth.fp.num_layers] and Lg[0] > 3  # one joint basis: 3 layers do not divide the group
    assert pers == [[1], [3], Lg]
    for kk, vv in outs[1:]:
        assert torch.equal(kk, outs[0][0]) and torch.equal(vv, outs[0][1])
    assert not torch.isnan(outs[0][0]).any() and not torch.isnan(outs[0][1]).any()
