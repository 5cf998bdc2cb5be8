"""What the row-sharded joint basis costs under TP on a GPU: bytes all-reduced per token and the partial GEMMs' time.

For each shape (synthetic calibrations: the retained ranks follow what the DP does on a power-law spectrum; nothing
here says anything about accuracy) and ratio: K's and V's retained ranks, the bytes one rank all-reduces per coded
token (float32 and bfloat16), and, for TP sizes 1/2/4/8 on ONE GPU, the time of one rank's encode GEMMs
``(x_t - mean_t) @ V_t`` and decode GEMMs ``c @ V_t^T`` for ``--tokens`` tokens (K and V, all layers), in fp16
(tensor cores, as the fused path) and float32 (the reference path). The all-reduce itself needs several GPUs: its
time is estimated from the bytes and an NVLink bus bandwidth (``--busbw-gbs``), and reported as an estimate. Also
checks that on this device a one-rank sharded codec writes the reference codec's blob byte for byte.

    python integration/tp/collective_cost.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dynamo_kvtc.bench.shapes import SHAPES
from dynamo_kvtc.calibration.synthetic import synthetic_calibration, synthetic_kv
from dynamo_kvtc.calibration.tensor_parallel import sharded_codec
from dynamo_kvtc.codec.kvtc import KvtcCodec
from dynamo_kvtc.codec.sharded import allreduce_bytes_per_token


class Solo:
    def all_reduce_sum(self, t):
        return t

    def all_gather(self, t):
        return [t]


def timed(fn, reps: int = 10) -> float:
    """Median seconds of ``fn`` on the current CUDA stream (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def gemm_times(cal, ratio: float, tokens: int, tp: int, dtype: torch.dtype) -> dict:
    """One rank's encode and decode GEMMs (K and V) at ``tp`` ranks: rows p/tp of the basis."""
    g = cal.groups[0]
    p = g.k_basis.shape[0]
    rows = p // tp
    dev = "cuda"
    ops = []
    for basis, plans in ((g.k_basis, g.k_plans), (g.v_basis, g.v_plans)):
        r = plans[float(ratio)].rank
        vt = basis[:rows, :r].to(dev, dtype).contiguous()
        x = torch.randn(tokens, rows, device=dev, dtype=dtype)
        mean = torch.randn(rows, device=dev, dtype=dtype)
        c = torch.randn(tokens, r, device=dev, dtype=dtype)
        ops.append((x, mean, vt, c))
    enc = timed(lambda: [(x - m) @ vt for x, m, vt, _ in ops])
    dec = timed(lambda: [c @ vt.t() for _, _, vt, c in ops])
    return {"tp": tp, "rows_per_rank": rows, "encode_gemm_s": enc, "decode_gemm_s": dec}


def blob_check(cal, tokens: int) -> dict:
    k, v, pos = synthetic_kv(cal, tokens, device="cuda")
    ref = KvtcCodec(cal, 16, "cuda", fused=False, projection="fp16")
    codec = sharded_codec(cal, 0, 1, Solo(), ratio=16, device="cuda")
    t0 = time.perf_counter()
    blob = codec.encode(k, v, pos)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    return {"tokens": tokens, "same_blob_as_reference": blob == ref.encode(k, v, pos), "encode_s": t1 - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.1-8b,mistral-nemo-12b")
    ap.add_argument("--ratios", default="16,32")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dp-rows", type=int, default=1024)
    ap.add_argument("--busbw-gbs", type=float, default=360.0, help="assumed NCCL all-reduce bus bandwidth (NVLink)")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    ratios = [float(r) for r in args.ratios.split(",")]
    out = {"device": torch.cuda.get_device_name(), "tokens": args.tokens, "busbw_gbs_assumed": args.busbw_gbs}
    for name in args.shapes.split(","):
        s = SHAPES[name]
        t0 = time.time()
        cal = synthetic_calibration(
            s.layers, s.kv_heads, s.head_dim, s.theta, ratios=ratios, dp_rows=args.dp_rows, device="cuda", name=name
        )
        rec = {"calibration_s": time.time() - t0, "features": cal.fingerprint.features, "ratios": {}}
        raw_per_token = 2 * cal.fingerprint.features * 2
        for ratio in ratios:
            g = cal.groups[0]
            b32 = allreduce_bytes_per_token(cal, ratio, torch.float32)
            r = {
                "k_rank": g.k_plans[ratio].rank,
                "v_rank": g.v_plans[ratio].rank,
                "allreduce_bytes_per_token_fp32": b32,
                "allreduce_bytes_per_token_bf16": allreduce_bytes_per_token(cal, ratio, torch.bfloat16),
                "raw_kv_bytes_per_token_bf16": raw_per_token,
                "tp": [],
            }
            for tp in (1, 2, 4, 8):
                row = {
                    **gemm_times(cal, ratio, args.tokens, tp, torch.float16),
                    "fp32": gemm_times(cal, ratio, args.tokens, tp, torch.float32),
                }
                n = tp
                row["allreduce_est_s_fp32"] = (
                    0.0 if n == 1 else 2 * (n - 1) / n * args.tokens * b32 / (args.busbw_gbs * 1e9)
                )
                r["tp"].append(row)
                print(name, ratio, json.dumps(row), flush=True)
            rec["ratios"][str(ratio)] = r
        rec["blob_check"] = blob_check(cal, 1024)
        out[name] = rec
        print(name, json.dumps({k: v for k, v in rec.items() if k != "ratios"}), flush=True)
    print(json.dumps(out, indent=1))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
