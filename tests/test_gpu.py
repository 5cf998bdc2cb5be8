"""CPU <-> GPU parity of the reference path and nvCOMP interoperability. Skipped cleanly where CUDA is absent.

The codecs here are pinned to the reference path (``fused=False``); the fused GPU path is tested in
test_gpu_fused.py."""

from __future__ import annotations

import zlib

import pytest
import torch

from dynamo_kvtc import KvtcCodec
from dynamo_kvtc.codec.entropy import EntropyCoder, nvcomp_available

from .conftest import offload_seq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
needs_nvcomp = pytest.mark.skipif(not nvcomp_available(), reason="needs nvidia-nvcomp-cu13")


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


def test_cpu_blob_decodes_on_gpu_and_back(synth, synth_cal):
    k, v, pos = synth.sample(700, start=3)
    cpu = KvtcCodec(synth_cal, ratio=8, device="cpu")
    gpu = KvtcCodec(synth_cal, ratio=8, device="cuda", fused=False)
    blob_cpu = cpu.encode(k, v, pos)
    blob_gpu = gpu.encode(k.cuda(), v.cuda(), pos)
    for blob in (blob_cpu, blob_gpu):
        kc, vc = cpu.decode(blob)
        kg, vg = gpu.decode(blob)
        assert kg.is_cuda
        assert rel(kg, kc) <= 1e-3 and rel(vg, vc) <= 1e-3
    # both devices reconstruct the input equally well
    kc, _ = cpu.decode(blob_cpu)
    kg, _ = gpu.decode(blob_gpu)
    assert abs(rel(kc[:, 4:-128], k[:, 4:-128]) - rel(kg[:, 4:-128], k[:, 4:-128])) < 1e-3


@needs_nvcomp
def test_nvcomp_deflate_and_zlib_read_each_other():
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(300_000, generator=g) * 6).round().clamp(-8, 7).to(torch.int8).view(torch.uint8)
    gpu = EntropyCoder("deflate", "cuda")
    cpu = EntropyCoder("deflate", "cpu")
    assert gpu.gpu
    chunks_gpu = gpu.compress(data.cuda())
    assert bytes(cpu.decompress(chunks_gpu, data.numel()).numpy()) == bytes(data.numpy())
    chunks_cpu = cpu.compress(data)
    assert zlib.decompress(chunks_cpu[0], -15) == bytes(data[: 1 << 16].numpy())
    assert torch.equal(gpu.decompress(chunks_cpu, data.numel()).cpu(), data)


@needs_nvcomp
@pytest.mark.parametrize("tag", ["ans", "gdeflate"])
def test_gpu_only_codecs_roundtrip(synth, synth_cal, tag):
    k, v, pos = synth.sample(500)
    codec = KvtcCodec(synth_cal, ratio=8, device="cuda", tag=tag, fused=False)
    blob = codec.encode(k.cuda(), v.cuda(), pos)
    k2, v2 = codec.decode(blob)
    ref = KvtcCodec(synth_cal, ratio=8, device="cuda", fused=False).decode(
        KvtcCodec(synth_cal, ratio=8).encode(k, v, pos)
    )
    assert rel(k2, ref[0]) <= 1e-3 and rel(v2, ref[1]) <= 1e-3


async def test_store_on_cuda_orders_after_producer_and_signals_layers(synth, synth_cal):
    from dynamo_kvtc.codec.options import CodecOptions
    from dynamo_kvtc.tiers import KvtcStore, TierConfig

    # fp16 projections: "auto" is FP8 on an H200, whose error bound is test_projection.py's, not this one
    opts = CodecOptions(projection="fp16", fused_strict=True)
    cfg = TierConfig(host_bytes=1 << 20, ratio=8, min_tokens=0, window=32, page_bytes=1024, codec=opts)
    store = KvtcStore(synth_cal, cfg, device="cuda", block_size=16, span_tokens=128)
    assert store.host.pinned
    k, v, _ = synth.sample(256)
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):  # the "forward pass" writes the KV on its own stream
        kc, vc = k.cuda(non_blocking=True) * 1, v.cuda(non_blocking=True) * 1
        ready = torch.cuda.Event()
        ready.record()
    toks = list(range(256))
    res = offload_seq(store, toks, kc, vc, ready_event=ready)
    assert res.stored_blocks == 16
    out = torch.zeros_like(kc)

    def sink(layer, start, kk, vv):
        out[layer, start : start + kk.shape[0]] = kk

    h = store.start_onboard(store.hashes(toks), sink=sink)
    for layer in range(k.shape[0]):
        h.wait_layer(layer, timeout=30)
    assert h.wait(30)
    torch.cuda.synchronize()
    cpu = KvtcStore(synth_cal, cfg, device="cpu", block_size=16, span_tokens=128)
    offload_seq(cpu, toks, k, v)
    ref = torch.zeros_like(k)

    def sink_cpu(layer, start, kk, vv):
        ref[layer, start : start + kk.shape[0]] = kk

    assert await cpu.start_onboard(cpu.hashes(toks), sink=sink_cpu).done()
    # the CUDA store runs the fused path (fp16 tensor-core projections): within about one bf16 rounding step
    assert rel(out, ref) <= 5e-3
    store.close()
    cpu.close()
