"""Tensor-parallel calibration shards vs one joint calibration, on the same data (the TP part of the two-GPU issue).

A TP worker holds only its rank's KV heads, so each rank needs a calibration of its own head shard (heads split as
vLLM splits them: ``calibration.shard_heads``). This script calibrates the joint basis (all heads) and one basis per
rank on the same captured KV, compresses the same held-out context both ways (per rank, then heads put back
together), and compares reconstruction error, bytes, and what the model predicts from each (next-token KL and ΔNLL
against the uncompressed cache). Nothing here needs a GPU; on a multi-GPU host the per-rank calibrations are what
each rank's worker loads (``<calibration>/rank<r>/``).

    python integration/tp/shard_accuracy.py --tp 3 --tokens 16384 --json out.json     # SmolLM2: 3 KV heads
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dynamo_kvtc.calibration.calibrate import calibrate, shard_heads
from dynamo_kvtc.calibration.data import calibration_texts, heldout_texts
from dynamo_kvtc.calibration.models import capture_kv, fingerprint_of, iter_model_kv, load_model
from dynamo_kvtc.codec.kvtc import KvtcCodec
from dynamo_kvtc.evaluation.harness import score


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16384, help="calibration tokens (same data for joint and shards)")
    ap.add_argument("--context", type=int, default=2048, help="held-out context compressed")
    ap.add_argument("--ratio", type=float, default=16.0)
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    t0 = time.time()
    model, tok = load_model(args.model)
    fp = fingerprint_of(model, tok)
    samples = list(iter_model_kv(model, tok, calibration_texts(), seq_len=2048, max_tokens=args.tokens))
    kw = {"ratios": (args.ratio,), "dp_tokens": 8192, "progress": False, "seed": 0}
    joint = calibrate(samples, fp, **kw)
    shards = [calibrate(samples, fp, tp_rank=r, tp_size=args.tp, **kw) for r in range(args.tp)]
    ids = tok("\n\n".join(heldout_texts()), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    ctx, cont = ids[: args.context], ids[args.context : args.context + 128]
    k, v, pos = capture_kv(model, ctx)

    def roundtrip(cal, kk, vv):
        codec = KvtcCodec(cal, ratio=args.ratio)
        blob = codec.encode(kk, vv, pos, window=0)
        k2, v2 = codec.decode(blob)
        return k2, v2, len(blob)

    kj, vj, nj = roundtrip(joint, k, v)
    parts = [
        roundtrip(
            s, k[:, :, shard_heads(fp.num_kv_heads, r, args.tp)], v[:, :, shard_heads(fp.num_kv_heads, r, args.tp)]
        )
        for r, s in enumerate(shards)
    ]
    ks, vs = torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)
    ns = sum(p[2] for p in parts)
    raw = 2 * k.numel() * k.element_size()
    ref = score(model, cont, k, v, len(ctx))
    tgt = cont[1:]

    def metrics(kk, vv, nbytes):
        lp = score(model, cont, kk, vv, len(ctx))
        kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
        nll = float(-lp[:-1].gather(1, tgt[:, None]).mean())
        ref_nll = float(-ref[:-1].gather(1, tgt[:, None]).mean())
        rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
        return {
            "bytes": nbytes,
            "ratio": raw / nbytes,
            "rel_err_k": rel(kk, k),
            "rel_err_v": rel(vv, v),
            "next_token_kl": kl,
            "delta_nll_pct": 100 * (nll - ref_nll) / ref_nll,
        }

    out = {
        "model": args.model,
        "tp": args.tp,
        "calibration_tokens": args.tokens,
        "context": args.context,
        "ratio_plan": args.ratio,
        "joint": metrics(kj, vj, nj),
        "shards": metrics(ks, vs, ns),
        "seconds": time.time() - t0,
    }
    print(json.dumps(out, indent=1))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
