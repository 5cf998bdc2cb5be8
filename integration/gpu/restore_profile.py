"""Where a single offload and restore of one long sequence spends its time, per bench-serve system (issue 15).

One sequence of ``--tokens`` tokens of the model's KV shape is written into the engine pool of ``bench serve``
(vLLM's flash layout), offloaded through each system's store and restored in place into another slot, ``--repeat``
times after one untimed round. Per system it prints the offload time (submit -> future done), the restore's time to
layer 0 and to all layers, and for the kvtc store the fused codec's own stage timings (``last_timings``: h2d, crc,
entropy, dequantize, project; encode stages). Also the device CRC's throughput on one large buffer. Speed only
(random KV, synthetic calibration). Usage (on the GPU host):

    python integration/gpu/restore_profile.py --model llama-3.1-8b --tokens 9104 --json $OUT/restore-profile.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dynamo_kvtc.bench.serve import workloads as wl
from dynamo_kvtc.bench.serve.engine import EngineConfig, ServeEngine
from dynamo_kvtc.bench.serve.run import ServeBench, close
from dynamo_kvtc.tiers.keys import sequence_hashes


def _crc_rate(dev: torch.device, nbytes: int) -> dict:
    from dynamo_kvtc.codec.gpu.ops import get_ops

    ops = get_ops("auto")
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    ops.crc_check(buf, [0], [nbytes], [0])  # compile
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(3):
        ops.crc_check(buf, [0], [nbytes], [0])
    torch.cuda.synchronize(dev)
    s = (time.perf_counter() - t) / 3
    return {"ops": type(ops).__name__, "bytes": nbytes, "seconds": s, "gb_s": nbytes / s / 1e9}


def _trace(store, eng, n: int, bs: int, device: str, system: str, prefix: str) -> None:
    """One more offload and restore under torch.profiler: per-kernel device times of each (``<prefix>-<system>-
    {offload,restore}.txt``, the top 40 by device time), and the host time the restore's calls took."""
    from torch.profiler import ProfilerActivity, profile

    toks = [(99991 + i) % 32000 for i in range(n * bs)]
    hashes = sequence_hashes(toks, bs)
    k, v = eng.kview[:, 0, 0, : n * bs], eng.kview[:, 1, 0, : n * bs]
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    for what in ("offload", "restore"):
        _sync(device)
        with profile(activities=acts) as prof:
            if what == "offload":
                store.submit_offload(hashes, toks, keys=k, values=v).result()
            else:
                h = store.start_onboard(hashes, eng.slot_blocks(1, n))
                h.wait()
            _sync(device)
        ka = prof.key_averages()
        table = ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70)
        total = sum(e.self_device_time_total for e in ka) / 1e3
        launches = sum(e.count for e in ka if e.device_type.name == "CUDA")
        head = f"{system} {what}: {total:.2f} ms of device time in {launches} kernel/copy calls\n"
        with open(f"{prefix}-{system}-{what}.txt", "w") as f:
            f.write(head + table)
        print(head + table, flush=True)


def _one(bench: ServeBench, system: str, tokens: int, repeat: int, trace: str | None = None) -> dict:
    w = wl.Workload("profile", 0, {}, [wl.Request(0, 0.0, "s0", [("p", tokens)], ("a", 1))])
    eng = ServeEngine(bench.decoder, None, bench.cfg, bench.device)
    kv = eng.alloc(w)
    store = bench.store(system, 3 * tokens * bench.bytes_per_token, None, kv)  # room for every round, raw
    bs = bench.cfg.block_size
    n = tokens // bs
    eng.pool.normal_()
    rows = []
    try:
        for r in range(repeat + 1):
            toks = [(r * 7919 + i) % 32000 for i in range(n * bs)]
            hashes = sequence_hashes(toks, bs)
            k, v = eng.kview[:, 0, 0, : n * bs], eng.kview[:, 1, 0, : n * bs]
            _sync(bench.device)
            t = time.perf_counter()
            store.submit_offload(hashes, toks, keys=k, values=v).result()
            off_s = time.perf_counter() - t
            enc = dict(getattr(_codec(store), "last_timings", {}) or {})
            _sync(bench.device)
            t = time.perf_counter()
            h = store.start_onboard(hashes, eng.slot_blocks(1, n))
            h.wait_layer(0)
            first = time.perf_counter() - t
            h.wait()
            _sync(bench.device)
            all_s = time.perf_counter() - t
            dec = dict(getattr(_codec(store), "last_timings", {}) or {})
            ok = bool(torch.equal(eng.kview[:, :, 1, : n * bs], eng.kview[:, :, 0, : n * bs]))
            if r:
                rows.append({"offload_s": off_s, "restore_first_s": first, "restore_all_s": all_s,
                             "bit_exact": ok, "encode": enc, "decode": dec})  # fmt: skip
        if trace and torch.device(bench.device).type == "cuda":
            _trace(store, eng, n, bs, bench.device, system, trace)
        snap = {k: v for k, v in store.snapshot().items() if isinstance(v, (int, float))}
    finally:
        close(store)
    return {"system": system, "tokens": n * bs, "rows": rows, "store": snap}


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _codec(store):
    """The fused codec of the store's codec (its ``last_timings``: the last encode's or restore's stages), if any."""
    for c in getattr(store, "_codecs", {}).values():
        fc = getattr(c, "_fused", None)
        if fc is not None:
            return fc
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=9104)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--systems", default="raw,raw_blob,kvtc16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default=None, help="path prefix: per-kernel tables of one more offload and restore")
    a = ap.parse_args()
    cfg = EngineConfig(max_seqs=2)
    w = wl.Workload("profile", 0, {}, [])
    bench = ServeBench(a.model, w, cfg, a.device)
    out = {"model": a.model, "systems": []}
    if a.device.startswith("cuda"):
        out["crc"] = _crc_rate(torch.device(a.device), 1 << 30)
        print(json.dumps(out["crc"]), flush=True)
    for s in a.systems.split(","):
        trace = a.trace or (a.json[: -len(".json")] if a.json and a.json.endswith(".json") else None)
        res = _one(bench, s, a.tokens, a.repeat, trace if s.startswith("kvtc") else None)
        out["systems"].append(res)
        for row in res["rows"]:
            print(s, json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
