"""Run the row-sharded joint-basis codec on ``--tp`` CPU processes (torch.distributed, gloo); save what each rank got.

The parent starts one process per TP rank (this file with ``--rank``); they meet through a file store in ``--out``.
Each rank loads the JOINT calibration and the full KV (``--kv``: safetensors with ``k``, ``v`` ``[L, T, H, D]`` and
``pos`` ``[T]``), keeps only its heads (vLLM's split), encodes them with
:class:`~dynamo_kvtc.codec.sharded.ShardedKvtcCodec` (one all-reduce of partial coefficients per layer group, sinks and
window all-gathered), decodes its heads back from the blob, and writes ``rank<r>.safetensors`` (``k``, ``v``: its
decoded heads; ``blob``: the bytes, uint8) and ``rank<r>.json`` (timings, blob size, all-reduced bytes).
Used by tests/test_tp_shard.py and integration/tp/shard_accuracy.py; nothing here needs a GPU.

    python integration/tp/sharded_roundtrip.py --tp 3 --calibration calibrations/smollm2-135m-instruct \
        --kv kv.safetensors --out /tmp/tp3 [--ratio 16] [--window 0] [--reduce-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def launch(
    tp: int,
    calibration: str,
    kv: str,
    out: str,
    ratio: float = 16,
    window: int = 0,
    reduce_dtype: str = "float32",
    timeout: float = 600,
) -> list[dict]:
    """Run ``tp`` rank processes to completion; raises if any fails. Returns the per-rank JSON records."""
    Path(out).mkdir(parents=True, exist_ok=True)
    store = Path(out) / "store"
    store.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    base = [sys.executable, __file__, "--tp", str(tp), "--calibration", calibration, "--kv", kv, "--out", out]
    base += ["--ratio", str(ratio), "--window", str(window), "--reduce-dtype", reduce_dtype]
    procs = [subprocess.Popen([*base, "--rank", str(r)], env=env) for r in range(tp)]
    deadline = time.time() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(f"sharded round trip failed: rank exit codes {codes}")
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(tp)]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from dynamo_kvtc.calibration import Calibration
    from dynamo_kvtc.calibration.tensor_parallel import sharded_codec
    from dynamo_kvtc.codec.sharded import allreduce_bytes_per_token

    torch.set_num_threads(1)
    store = Path(args.out) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=args.rank, world_size=args.tp)
    try:
        cal = Calibration.load(args.calibration)
        kv = load_file(args.kv)
        rd = getattr(torch, args.reduce_dtype)
        codec = sharded_codec(cal, args.rank, args.tp, ratio=args.ratio, window=args.window, reduce_dtype=rd)
        k, v = kv["k"][:, :, codec.heads].contiguous(), kv["v"][:, :, codec.heads].contiguous()
        dist.barrier()
        t0 = time.perf_counter()
        blob = codec.encode(k, v, kv["pos"])
        t1 = time.perf_counter()
        k2, v2 = codec.decode(blob)
        t2 = time.perf_counter()
        blob_t = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        save_file({"k": k2, "v": v2, "blob": blob_t}, str(Path(args.out) / f"rank{args.rank}.safetensors"))
        nc = codec.base.config.segments(kv["pos"].to(torch.int64), args.window)[3]
        rec = {
            "rank": args.rank,
            "heads": [codec.heads.start, codec.heads.stop],
            "contributes": codec.contributes,
            "encode_s": t1 - t0,
            "decode_s": t2 - t1,
            "blob_bytes": len(blob),
            "coded_tokens": nc,
            "allreduce_bytes": nc * allreduce_bytes_per_token(cal, args.ratio, rd),
        }
        (Path(args.out) / f"rank{args.rank}.json").write_text(json.dumps(rec))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--calibration", required=True, help="the joint calibration's directory")
    ap.add_argument("--kv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ratio", type=float, default=16.0)
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--reduce-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rank", type=int, help="(internal) run as this rank")
    args = ap.parse_args()
    if args.rank is None:
        print(
            json.dumps(
                launch(args.tp, args.calibration, args.kv, args.out, args.ratio, args.window, args.reduce_dtype),
                indent=1,
            )
        )
    else:
        worker(args)


if __name__ == "__main__":
    main()
