"""``dynamo-kvtc bench gpu --kv-dtype fp8``: one configuration's restore into an FP8 paged cache (vLLM
``--kv-cache-dtype fp8``) against a raw copy of that FP8 cache from pinned host memory.

The FP8 source is the configuration's bf16 source quantized with per-layer amax scales (what an FP8 checkpoint's
calibrated k/v scales give). The kvtc path is the connector's for an FP8 cache: gather and dequantize
(:class:`~dynamo_kvtc.tiers.layout.PagedKV`), encode the values, and on restore decode each layer and write it back
as FP8 with the same scales; the fused kernels' in-place paged path does not read FP8, so both sides go through dense
per-layer tensors. Ratios are against the FP8 cache (one byte per element)."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..codec import fp8
from ..codec.base import RestoreRun
from ..tiers.layout import PagedKV
from .gpu_checks import projection
from .gpu_timing import med, sync


def _timed(fn, repeat: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def fp8_restore(run: Any, cache_dtype: str) -> dict[str, Any]:
    """Raw FP8 restore vs kvtc restore into an FP8 cache, for ``run`` (a :class:`~.gpu_config.ConfigRun`)."""
    from ..codec.kvtc import KvtcCodec

    fmt = fp8.kv_format(cache_dtype)
    L, H, D, bs, n, B, T, dev = run.L, run.H, run.D, run.bs, run.nblocks, run.B, run.T, run.dev
    args, hi = run.args, float(torch.finfo(fmt).max)
    ids = run.flat_ids
    seqs = [b.tolist() for b in run.block_ids]
    ks, vs = [], []
    for layer in range(L):
        k, v = run.src.views(layer)
        ks.append(max(float(k.index_select(0, ids).abs().amax()) / hi, 1e-12))
        vs.append(max(float(v.index_select(0, ids).abs().amax()) / hi, 1e-12))

    def cache() -> PagedKV:
        c = [torch.zeros(2, n, bs, H, D, dtype=torch.uint8, device=dev) for _ in range(L)]
        return PagedKV(c, "flash", bs, cache_dtype=cache_dtype, k_scales=ks, v_scales=vs)

    src, dst = cache(), cache()
    all_ids = ids.tolist()
    for layer in range(L):
        k, v = run.src.views(layer)
        src.scatter_layer(
            layer, all_ids, k.index_select(0, ids).reshape(-1, H, D), v.index_select(0, ids).reshape(-1, H, D)
        )
    raw_bytes = 2 * L * n * bs * H * D  # one byte per element
    host = torch.empty(L, 2, n, bs, H, D, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    for layer in range(L):
        host[layer].copy_(src.caches[layer][:, ids])
    stage = torch.empty(2, n, bs, H, D, dtype=torch.uint8, device=dev)

    def raw() -> None:
        for layer in range(L):
            stage.copy_(host[layer], non_blocking=True)
            dst.caches[layer][0].index_copy_(0, ids, stage[0])
            dst.caches[layer][1].index_copy_(0, ids, stage[1])

    raw_ms = _timed(raw, args.repeat)
    codec = KvtcCodec(run.cal, ratio=args.ratio, device=dev, tag=args.tag, projection=projection())
    fp8.mark_kv_source(codec, fp8.source_name(fmt))
    t0 = time.perf_counter()
    blobs = []
    for b in range(B):
        k, v = src.gather(seqs[b])
        blobs.append(codec.encode(k, v, torch.arange(T)))
    sync()
    encode_ms = (time.perf_counter() - t0) * 1e3
    stored = sum(len(x) for x in blobs)
    for c in dst.caches:
        c.fill_(0x7F)  # e4m3 NaN / e5m2 +inf bytes: every element must be rewritten

    def restore() -> None:
        for layer, parts in codec.restore([RestoreRun(blob, 0, T) for blob in blobs]):
            for b, (k, v) in enumerate(parts):
                dst.scatter_layer(layer, seqs[b], k, v)

    kvtc_ms = _timed(restore, args.repeat)
    got, want = dst.gather(all_ids), src.gather(all_ids)
    rel = [float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)) for g, w in zip(got, want)]
    out = {
        "cache_dtype": cache_dtype,
        "raw_fp8_bytes": raw_bytes,
        "stored_bytes": stored,
        "ratio_vs_fp8_with_window": raw_bytes / stored,
        "raw_restore_all_layers_ms": med(raw_ms),
        "kvtc_restore_all_layers_ms": med(kvtc_ms),
        "kvtc_vs_raw_restore": med(kvtc_ms) / med(raw_ms),
        "encode_ms": encode_ms,
        "rel_err_k": rel[0],
        "rel_err_v": rel[1],
        "finite": bool(all(torch.isfinite(g.float()).all() for g in got)),
        "path": "dense per layer (gather+dequantize, decode+quantize+scatter)",
    }
    return out
