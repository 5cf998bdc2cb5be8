"""``dynamo-kvtc bench codec``: encode/decode throughput per stage, ratio by the paper's accounting, error."""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial

import torch

from ..codec.kvtc import KvtcCodec
from .inputs import load_inputs, sync
from .output import machine, write_json


def _timed(dev: str, codec: KvtcCodec, prefix: str, calls: list) -> tuple[list, float, dict[str, float]]:
    """Run the calls; return their results, the wall time, and the codec's stage timings summed over the calls."""
    stages: dict[str, float] = {}
    out = []
    sync(dev)
    t0 = time.perf_counter()
    for call in calls:
        out.append(call())
        for key, val in codec.last_timings.items():
            if key.startswith(prefix + "_"):
                stages[key] = stages.get(key, 0.0) + val
    sync(dev)
    return out, time.perf_counter() - t0, stages


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_bench_codec(args) -> int:
    dev = args.device
    cal, spans, source = load_inputs(args)
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
