"""``dynamo-kvtc bench codec``: encode/decode throughput per stage, ratio by the paper's accounting, error."""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial
from typing import Any

import torch

from ..calibration.artifact import Calibration
from ..codec.kvtc import KvtcCodec
from ..errors import ConfigError
from .common import find_calibration, machine, write_json


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _real_inputs(args) -> tuple[Calibration, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict[str, Any]]:
    path = args.calibration or find_calibration(args.model)
    if path is None:
        raise ConfigError(
            f"no calibration for {args.model}: pass --calibration DIR (make one with `dynamo-kvtc calibrate`)"
        )
    cal = Calibration.load(path)
    if args.kv:
        from safetensors.torch import load_file

        t = load_file(args.kv)
        spans = [(t["keys"], t["values"], t["positions"])]
        src = {"kv": str(args.kv)}
    else:
        from ..calibration.data import heldout_texts
        from ..calibration.models import capture_kv, load_model

        model, tok = load_model(args.model)
        ids = tok("\n\n".join(heldout_texts()), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        spans = [capture_kv(model, ids[: args.tokens])]
        src = {"model": args.model, "text": "held-out Paul Graham essays", "tokens": int(spans[0][2].numel())}
    return cal, spans, {"calibration": str(path), "calibration_id": cal.id, **src}


def _synthetic_inputs(args):
    from ..calibration.synthetic import synthetic_calibration, synthetic_kv
    from .shapes import SHAPES

    if args.synthetic not in SHAPES:
        raise ConfigError(f"unknown synthetic shape {args.synthetic!r}; choose one of {sorted(SHAPES)}")
    s = SHAPES[args.synthetic]
    cal = synthetic_calibration(
        s.layers,
        s.kv_heads,
        s.head_dim,
        s.theta,
        device=args.device,
        name=args.synthetic,
        ratios=args.ratios or (8, 16, 32, 64),
    )
    spans = [synthetic_kv(cal, args.tokens, start=0, device=args.device, seed=1 + b) for b in range(args.batch)]
    return (
        cal,
        spans,
        {
            "synthetic": args.synthetic,
            "tokens": args.tokens,
            "batch": args.batch,
            "note": "synthetic calibration and KV: throughput only, errors are not meaningful",
        },
    )


def _timed(dev: str, codec: KvtcCodec, prefix: str, calls: list) -> tuple[list, float, dict[str, float]]:
    """Run the calls; return their results, the wall time, and the codec's stage timings summed over the calls."""
    stages: dict[str, float] = {}
    out = []
    _sync(dev)
    t0 = time.perf_counter()
    for call in calls:
        out.append(call())
        for key, val in codec.last_timings.items():
            if key.startswith(prefix + "_"):
                stages[key] = stages.get(key, 0.0) + val
    _sync(dev)
    return out, time.perf_counter() - t0, stages


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_bench_codec(args) -> int:
    dev = args.device
    if torch.device(dev).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but CUDA is not available")
    cal, spans, source = _synthetic_inputs(args) if args.synthetic else _real_inputs(args)
    spans = [(k.to(dev), v.to(dev), p) for k, v, p in spans]
    raw_bytes = sum(k.numel() * k.element_size() * 2 for k, _, _ in spans)
    results = []
    for ratio in args.ratios or cal.ratios:
        codec = KvtcCodec(cal, ratio=ratio, device=dev, tag=args.tag, profile=True)
        blobs = [codec.encode(k, v, p) for k, v, p in spans]  # warm-up
        for b in blobs:
            codec.decode(b)
        enc, dec, enc_st, dec_st = [], [], [], []
        for _ in range(max(1, args.repeat)):
            blobs, seconds, stages = _timed(dev, codec, "encode", [partial(codec.encode, k, v, p) for k, v, p in spans])
            enc.append(seconds)
            enc_st.append(stages)
            outs, seconds, stages = _timed(dev, codec, "decode", [partial(codec.decode, b) for b in blobs])
            dec.append(seconds)
            dec_st.append(stages)
        st = [codec.stats(b) for b in blobs]
        coded = [(s["sink_tokens"], s["sink_tokens"] + s["coded_tokens"]) for s in st]
        ek = statistics.fmean(_rel(o[0][:, a:b], s[0][:, a:b]) for o, s, (a, b) in zip(outs, spans, coded) if b > a)
        ev = statistics.fmean(_rel(o[1][:, a:b], s[1][:, a:b]) for o, s, (a, b) in zip(outs, spans, coded) if b > a)
        te, td = statistics.median(enc), statistics.median(dec)
        stage_med = {k: statistics.median(d[k] for d in enc_st) for k in enc_st[0]}
        stage_med.update({k: statistics.median(d[k] for d in dec_st) for k in dec_st[0]})
        results.append(
            {
                "ratio_target": float(ratio),
                "ratio": statistics.fmean(s["ratio"] for s in st if s["ratio"]),
                "ratio_before_entropy": statistics.fmean(
                    s["ratio_before_entropy"] for s in st if s.get("ratio_before_entropy")
                ),
                "ratio_with_window": statistics.fmean(s["ratio_with_window"] for s in st),
                "encode_s": te,
                "decode_s": td,
                "encode_GBps": raw_bytes / te / 1e9,
                "decode_GBps": raw_bytes / td / 1e9,
                "stages_s": stage_med,
                "rel_error_k": ek,
                "rel_error_v": ev,
                "blob_bytes": sum(s["blob_bytes"] for s in st),
                "plan": st[0].get("plan"),
            }
        )
    out = {
        "benchmark": "codec",
        "command": " ".join(["dynamo-kvtc", *sys.argv[1:]]),
        "device": dev,
        "tag": args.tag,
        "machine": machine(),
        "source": source,
        "raw_bytes": raw_bytes,
        "results": results,
    }
    print(f"{'ratio':>6} {'measured':>9} {'w/ window':>9} {'enc GB/s':>9} {'dec GB/s':>9} {'err K':>7} {'err V':>7}")
    for r in results:
        print(
            f"{r['ratio_target']:>6g} {r['ratio']:>9.2f} {r['ratio_with_window']:>9.2f} {r['encode_GBps']:>9.3f} "
            f"{r['decode_GBps']:>9.3f} {r['rel_error_k']:>7.4f} {r['rel_error_v']:>7.4f}"
        )
    write_json(args.json_path, out)
    return 0


def run_bench_tiers(args) -> int:
    """Offload/onboard throughput and time to first layer vs all layers, for host and disk hits."""
    import asyncio
    import tempfile
    from pathlib import Path

    from ..tiers import KvtcStore, TierConfig

    dev = args.device
    if torch.device(dev).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but CUDA is not available")
    cal, spans, source = _synthetic_inputs(args) if args.synthetic else _real_inputs(args)
    k, v, _ = spans[0]
    k, v = k.to(dev), v.to(dev)
    L, T, H, D = k.shape
    raw = k.numel() * k.element_size() * 2
    tokens = list(range(T))
    ratio = (args.ratios or (16,))[0]
    out_k = torch.empty_like(k)
    out_v = torch.empty_like(v)

    def sink(layer, start, kk, vv):
        out_k[layer, start : start + kk.shape[0]] = kk
        out_v[layer, start : start + vv.shape[0]] = vv

    async def measure(store, label):
        res: dict[str, Any] = {}
        times, first, total = [], [], []
        for rep in range(max(1, args.repeat)):
            fresh = store
            if rep:  # a fresh store (and disk directory) each time: every repetition stores from scratch
                cfg = store.cfg
                if cfg.disk_bytes:
                    cfg = cfg.with_(disk_dir=Path(tempfile.mkdtemp(dir=store.cfg.disk_dir)))
                fresh = KvtcStore(cal, cfg, device=dev, block_size=args.block_size, span_tokens=args.span_tokens)
            _sync(dev)
            t0 = time.perf_counter()
            r = await fresh.offload(tokens, k, v)
            _sync(dev)
            times.append(time.perf_counter() - t0)
            if label == "disk":  # push every blob out of memory
                for blob_id in fresh.host.ids():
                    data, meta = fresh.host.pop(blob_id)
                    fresh._demote(blob_id, data, meta)
            hashes = fresh.hashes(tokens)
            n = fresh.match(hashes)
            t0 = time.perf_counter()
            h = await fresh.onboard(hashes[:n], sink=sink)
            h.wait_layer(0)
            _sync(dev)
            first.append(time.perf_counter() - t0)
            ok = h.wait()
            _sync(dev)
            total.append(time.perf_counter() - t0)
            if not ok:
                raise RuntimeError(f"onboard failed: {h.error}")
            if r.stored_blocks == 0:
                raise RuntimeError(f"offload stored nothing ({r.skipped})")
            res.update(blocks=n, stored_bytes=r.stored_bytes, ratio_with_window=raw / r.stored_bytes)
            if rep:
                fresh.close()
        res.update(
            offload_s=statistics.median(times),
            offload_GBps=raw / statistics.median(times) / 1e9,
            onboard_first_layer_s=statistics.median(first),
            onboard_all_layers_s=statistics.median(total),
            onboard_GBps=raw / statistics.median(total) / 1e9,
        )
        return res

    async def main():
        out = {}
        with tempfile.TemporaryDirectory(dir=args.disk_dir) as d:
            base = TierConfig(host_bytes=max(64 << 20, 4 * raw), ratio=ratio, min_tokens=0, window=args.window)
            store = KvtcStore(cal, base, device=dev, block_size=args.block_size, span_tokens=args.span_tokens)
            out["host"] = await measure(store, "host")
            store.close()
            cfg = base.with_(disk_bytes=8 * raw + (64 << 20), disk_dir=d)
            store = KvtcStore(cal, cfg, device=dev, block_size=args.block_size, span_tokens=args.span_tokens)
            out["disk"] = await measure(store, "disk")
            store.close()
        # reference: a raw restore of the same bytes from host memory (what an uncompressed tier copies)
        host_k = k.cpu().pin_memory() if torch.device(dev).type == "cuda" else k.clone()
        host_v = v.cpu().pin_memory() if torch.device(dev).type == "cuda" else v.clone()
        _sync(dev)
        t0 = time.perf_counter()
        out_k.copy_(host_k, non_blocking=True)
        out_v.copy_(host_v, non_blocking=True)
        _sync(dev)
        out["raw_copy_from_host_s"] = time.perf_counter() - t0
        return out

    results = asyncio.run(main())
    data = {
        "benchmark": "tiers",
        "command": " ".join(["dynamo-kvtc", *sys.argv[1:]]),
        "device": dev,
        "ratio": ratio,
        "tokens": T,
        "raw_bytes": raw,
        "block_size": args.block_size,
        "span_tokens": args.span_tokens,
        "window": args.window,
        "machine": machine(),
        "source": source,
        "results": results,
    }
    for tier in ("host", "disk"):
        r = results[tier]
        print(
            f"{tier:>5}: offload {r['offload_s'] * 1e3:8.1f} ms ({r['offload_GBps']:.3f} GB/s)  onboard first layer "
            f"{r['onboard_first_layer_s'] * 1e3:7.1f} ms, all {r['onboard_all_layers_s'] * 1e3:7.1f} ms "
            f"({r['onboard_GBps']:.3f} GB/s)  ratio incl. window {r['ratio_with_window']:.1f}"
        )
    print(f"  raw copy of the same KV from host memory: {results['raw_copy_from_host_s'] * 1e3:.1f} ms")
    write_json(args.json_path, data)
    return 0


def run_bench_gpu(args) -> int:
    """``dynamo-kvtc bench gpu`` (see :mod:`dynamo_kvtc.cli.bench_gpu`)."""
    from .bench_gpu import run_bench_gpu as run

    return run(args)
