"""Tensor-parallel calibration shards vs one joint calibration, on the same data (the TP part of the two-GPU issue).

A TP worker holds only its rank's KV heads, so each rank needs a calibration of its own head shard (heads split as
vLLM splits them: ``calibration.shard_heads``). This script calibrates the joint basis (all heads) and one basis per
rank on the same captured KV, compresses the same held-out context both ways (per rank, then heads put back
together), and compares reconstruction error, bytes, and what the model predicts from each (next-token KL and ΔNLL
against the uncompressed cache). Nothing here needs a GPU; on a multi-GPU host the per-rank calibrations are what
each rank's worker loads (``<calibration>/rank<r>/``).

The "joint, row-sharded" rows use the JOINT calibration under TP (:mod:`dynamo_kvtc.codec.sharded`): ``--tp`` CPU
processes (torch.distributed, gloo: integration/tp/sharded_roundtrip.py) each hold only their heads, project them on
their rows of the joint basis, all-reduce the partial coefficients and reconstruct their heads from the shared blob;
once with a float32 all-reduce and once with bfloat16 (half the bytes). Every row compresses the same context.

    python integration/tp/shard_accuracy.py --tp 3 --tokens 16384 --json out.json     # SmolLM2: 3 KV heads
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dynamo_kvtc.calibration import Calibration
from dynamo_kvtc.calibration.calibrate import calibrate, shard_heads
from dynamo_kvtc.calibration.data import calibration_texts, heldout_texts
from dynamo_kvtc.calibration.models import capture_kv, fingerprint_of, iter_model_kv, load_model
from dynamo_kvtc.codec.kvtc import KvtcCodec
from dynamo_kvtc.evaluation.harness import score

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharded_roundtrip import launch  # noqa: E402  (this folder's gloo launcher)


def row_sharded(cal: Calibration, k, v, pos, tp: int, ratio: float, reduce_dtype: str) -> tuple:
    """K, V (all heads, put back together), blob bytes and per-rank records of the joint calibration run row-sharded
    on ``tp`` gloo processes (window 0, as the other rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        cal_dir = cal.save(Path(tmp) / "joint")
        kv = Path(tmp) / "kv.safetensors"
        save_file({"k": k.contiguous(), "v": v.contiguous(), "pos": pos}, str(kv))
        recs = launch(tp, str(cal_dir), str(kv), str(Path(tmp) / "run"), ratio, 0, reduce_dtype)
        parts = [load_file(str(Path(tmp) / "run" / f"rank{r}.safetensors")) for r in range(tp)]
        lay_first = sorted({tuple(rec["heads"]): rec["rank"] for rec in reversed(recs)}.items())
        ks = torch.cat([parts[r]["k"] for _, r in lay_first], 2)
        vs = torch.cat([parts[r]["v"] for _, r in lay_first], 2)
        blobs = {parts[r]["blob"].numpy().tobytes() for r in range(tp)}
        assert len(blobs) == 1, "ranks disagree on the blob"
        return ks, vs, recs[0]["blob_bytes"], recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16384, help="calibration tokens (same data for joint and shards)")
    ap.add_argument("--context", type=int, default=2048, help="held-out context compressed")
    ap.add_argument("--ratio", type=float, default=16.0)
    ap.add_argument("--no-shards", dest="shards", action="store_false", help="skip the per-rank calibrations")
    ap.add_argument("--joint-cache", help="directory of the joint calibration: loaded if it exists, else saved there")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args()
    t0 = time.time()
    model, tok = load_model(args.model)
    fp = fingerprint_of(model, tok)
    samples = list(iter_model_kv(model, tok, calibration_texts(), seq_len=2048, max_tokens=args.tokens))
    kw = {"ratios": (args.ratio,), "dp_tokens": 8192, "progress": False, "seed": 0}
    wall = {}
    t1 = time.time()
    keep = tempfile.TemporaryDirectory()  # as deployed: the saved artifact (fp16 basis) is what every rank loads
    cache = Path(args.joint_cache) if args.joint_cache else Path(keep.name) / "joint"
    if not cache.exists():
        calibrate(samples, fp, **kw).save(cache)
    joint = Calibration.load(cache)
    wall["calibrate_joint_s"] = time.time() - t1
    t1 = time.time()
    shards = [calibrate(samples, fp, tp_rank=r, tp_size=args.tp, **kw) for r in range(args.tp)] if args.shards else []
    wall["calibrate_shards_s"] = time.time() - t1
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
    sharded = {}
    for rd in ("float32", "bfloat16"):
        t1 = time.time()
        sharded[rd] = row_sharded(joint, k, v, pos, args.tp, args.ratio, rd)
        wall[f"row_sharded_{rd}_s"] = time.time() - t1
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
        "shards": metrics(
            torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2), sum(p[2] for p in parts)
        )
        if parts
        else None,
        **{f"row_sharded_{rd}": {**metrics(*r[:3]), "ranks": r[3]} for rd, r in sharded.items()},
        "wall": wall,
        "seconds": time.time() - t0,
    }
    keep.cleanup()
    print(json.dumps(out, indent=1))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
