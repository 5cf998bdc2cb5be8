"""``dynamo-kvtc bench pool``: the pool tier (tiers/pool.py) on a real Mooncake master over TCP loopback.

In one run and on the same history of real KV (``--model``'s captured K/V and its calibration, as ``bench tiers``):
put and get throughput of the kvtc blobs sealed (what the pool tier stores), the same blobs unsealed, and the raw
K/V of the same blocks (one object per blob's span, uncompressed), as stored bytes per second; the latency of one
conversation's restore by a second store (discovery, sealed get, open, decode into the sink; and its get + open
alone) against fetching its raw K/V; bytes per token stored; and AES-GCM seal/open throughput. A master is started
on free loopback ports unless ``--master`` names one. With ``--device cuda`` both stores encode and restore on the GPU
(restores timed to the device's completion) and the raw baseline lands its K/V in GPU memory; the pool, the sealing
and the network stay on the host, as in a cluster.

The pool streams a blob part by part (one sealed part per layer group): for each restore, the time until the first
blob's first part (layer group 0) landed and opened (what the fused GPU restore waits for before decoding layer 0)
beside the time until every part of every blob did (what the CPU reference restore waits for). The model's
calibration has the layer groups it was made with (the shipped ones: one, so the first part is the whole blob); the
``streamed_groups`` section repeats it on a synthetic calibration of the same shape with ``--layer-groups`` groups
(synthetic KV: the times, not the ratio, are meaningful).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from .inputs import load_inputs
from .output import machine, write_json


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _put_all(client: Any, keys: list[str], objs: list[bytes]) -> None:
    for key, obj in zip(keys, objs):
        if client.put(key, obj) != 0:
            raise RuntimeError(f"pool put of {key} failed")


def _get_all(client: Any, keys: list[str]) -> None:
    for key in keys:
        if not client.get(key):
            raise RuntimeError(f"pool get of {key} failed")


def _stats(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"mean": statistics.fmean(s), "p50": statistics.median(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))]}


def _sink(layer, start, kk, vv) -> None:
    pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _streamed(b: Any, hashes: list[int]) -> tuple[float, float]:
    """B's pool tier reads one conversation's blobs, all started at once as a restore starts them: ms until the first
    blob's first part (layer group 0) landed and opened, and until every part of every blob did."""
    pool = b.placement.tier("pool")
    t0 = time.perf_counter()
    views = [pool.read(i) for i in _ids(b, hashes)]
    if not views or any(x is None for x in views):
        raise RuntimeError("a pool read found nothing")
    first = views[0]
    first.wait_for(first.ends[0] if first.arriving else len(first))
    t1 = time.perf_counter()
    for x in views:
        x.host()
    return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3


def _ids(b: Any, hashes: list[int]) -> list[str]:
    return [r.blob_id for r in b.index.plan(hashes)]


def _one_by_one(b: Any, hashes: list[int]) -> float:
    """The same objects as :func:`_streamed`, fetched whole by B's own client one after another and each part opened
    in this thread (ms): the tier's read beside plain sequential gets of the same objects by the same worker."""
    from ..tiers.seal import associated

    pool = b.placement.tier("pool")
    t0 = time.perf_counter()
    for i in _ids(b, hashes):
        obj, parts = memoryview(pool._client.get(pool.object_key(i))), pool.parts(i)
        aad, n = associated("blob", pool.cal, pool.salt, pool.meta(i)["hashes"]), len(parts.plain)
        for k in range(n):
            off, size, _, _ = parts.span(k)
            pool.sealer.open_part(obj[off : off + size], aad, k, n)
    return (time.perf_counter() - t0) * 1e3


def _restores(a: Any, b: Any, k: torch.Tensor, v: torch.Tensor, repeat: int) -> tuple[list[float], list, list]:
    """Store A saves the history under new token ids each round; store B (never saw it) restores it from the pool:
    B's restore times (ms, after a warm-up round), the first timed round's blobs as (bytes, block keys), and per
    round B's streamed reads (first part ms, every part ms, the same objects one by one ms; the two reads alternate
    which goes first)."""
    T = k.shape[1]
    pool = a.placement.tier("pool")
    restore, blobs, streamed = [], [], []
    for rep in range(repeat + 1):  # rep 0: warm-up
        tokens = [(rep + 1) * T + t for t in range(T)]
        r = a.submit_offload(a.hashes(tokens), tokens, keys=k, values=v).result()
        if not pool.wait_idle(120):
            raise RuntimeError("the pool's write-through did not finish")
        hashes = b.hashes(tokens)[: r.stored_blocks]
        t0 = time.perf_counter()
        n = b.match(hashes)
        ok = b.start_onboard(hashes[:n], sink=_sink).wait()
        _sync(k.device)
        dt = time.perf_counter() - t0
        if not ok or n != len(hashes):
            raise RuntimeError(f"pool restore failed ({n}/{len(hashes)} blocks)")
        if rep:
            restore.append(dt * 1e3)
            if rep % 2:
                first, every = _streamed(b, hashes)
                one = _one_by_one(b, hashes)
            else:
                one = _one_by_one(b, hashes)
                first, every = _streamed(b, hashes)
            streamed.append((first, every, one))
        if rep == 1:
            blobs = [(a.placement.fetch(i), a.index.meta(i).hashes) for i in a.index.blob_ids()
                     if a.index.meta(i).hashes[0] in set(hashes)]  # fmt: skip
    return restore, blobs, streamed


def _seal_cost(sealer: Any, blobs: list, aads: list[bytes], repeat: int) -> tuple[list[bytes], float, float]:
    """The sealed blobs and the median seal / open seconds of all of them (the first pass warms the AEAD up)."""
    seal_t, open_t = [], []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        sealed = [sealer.seal(d, aad) for (d, _), aad in zip(blobs, aads)]
        seal_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for obj, aad in zip(sealed, aads):
            sealer.open(obj, aad)
        open_t.append(time.perf_counter() - t0)
    return sealed, statistics.median(seal_t[1:]), statistics.median(open_t[1:])


def _put_get(client: Any, kinds: dict[str, list[bytes]], sealer: Any, aads: list[bytes], repeat: int):
    """Put/get GB/s (stored bytes) of each kind of object, and the sealed blobs' get + open times (ms)."""
    put, get, fetch_open = {}, {}, []
    for name, objs in kinds.items():
        nbytes = sum(map(len, objs))
        pt, gt = [], []
        for rep in range(repeat + 1):  # rep 0: warm-up, not timed
            keys = [f"bench/{name}/{rep}/{i}" for i in range(len(objs))]
            p_s, g_s = _timed(_put_all, client, keys, objs), _timed(_get_all, client, keys)
            if rep:
                pt.append(p_s)
                gt.append(g_s)
            if name == "kvtc_sealed" and rep:  # the restore's network and unseal part alone (no decode)
                t0 = time.perf_counter()
                for key, aad in zip(keys, aads):
                    sealer.open(client.get(key), aad)
                fetch_open.append((time.perf_counter() - t0) * 1e3)
            for key in keys:
                client.remove(key, True)
        put[name], get[name] = _gbps(nbytes, statistics.median(pt)), _gbps(nbytes, statistics.median(gt))
    return put, get, fetch_open


def _raw_restores(client: Any, kv: torch.Tensor, raw_objs: list[bytes], repeat: int) -> list[float]:
    """Fetching the raw K/V of the same history back into one tensor (ms per restore)."""
    times = []
    for rep in range(repeat):
        keys = [f"bench/rawrestore/{rep}/{i}" for i in range(len(raw_objs))]
        _put_all(client, keys, raw_objs)
        out = torch.empty_like(kv)
        t0 = time.perf_counter()
        at = 0
        for key in keys:
            got = client.get(key)
            out[at : at + len(got)] = torch.frombuffer(bytearray(got), dtype=torch.uint8)
            at += len(got)
        _sync(out.device)
        times.append((time.perf_counter() - t0) * 1e3)
        for key in keys:
            client.remove(key, True)
    return times


def _grouped(args: Any, store: Any, T: int, ratio: float) -> dict[str, Any]:
    """The streamed restore on a synthetic calibration of ``--shape`` with ``--layer-groups`` groups (one part each)."""
    from ..tiers.pool_parts import Parts
    from .shapes import SHAPES
    from .transfer_prefill import grouped_calibration, grouped_kv

    sh = SHAPES[args.shape]
    groups = min(args.layer_groups, sh.layers)
    cal = grouped_calibration(sh, groups, ratio=ratio, rank=None, device=args.device, name=args.shape)
    k, v = grouped_kv(cal, T, device=args.device)
    a, b = store(cal), store(cal)
    try:
        restore, _, streamed = _restores(a, b, k, v, args.repeat)
        pool = b.placement.tier("pool")
        parts: list[Parts] = [p for p in map(pool.parts, b.index.blob_ids()) if p is not None]
    finally:
        a.close()
        b.close()
    return {
        "shape": args.shape, "layer_groups": groups, "kv": "synthetic", "tokens_per_restore": T,
        "parts_per_object": sorted({len(p.plain) for p in parts}),
        "restore_ms": _stats(restore), "first_group_ms": _stats([f for f, _, _ in streamed]),
        "get_and_open_ms": _stats([w for _, w, _ in streamed]),
        "one_by_one_get_and_open_ms": _stats([o for _, _, o in streamed]),
    }  # fmt: skip


def run_bench_pool(args) -> int:
    from ..tiers import KvtcStore, TierConfig
    from ..tiers.mooncake_master import MooncakeMaster
    from ..tiers.seal import Sealer, associated

    cal, spans, source = load_inputs(args)
    k, v, _ = spans[0]
    T = k.shape[1]
    raw_bytes = 2 * k.numel() * k.element_size()
    master = None if args.master else MooncakeMaster().start()
    addr = args.master or master.master
    meta_url = args.metadata_server or (master.metadata_server if master else None)
    ratio = (args.ratios or (16,))[0]
    secret = b"bench pool: a cluster secret of 32B"

    def store(c: Any = cal) -> Any:
        cfg = TierConfig(host_bytes=1 << 30, ratio=ratio, window=args.window, pool_master=addr,
                         pool_metadata_server=meta_url, pool_segment_gb=args.segment_gb, pool_secret=secret,
                         pool_timeout_s=30.0, pool_queue_mb=4096)  # fmt: skip
        s = KvtcStore(c, cfg, device=args.device, block_size=args.block_size, span_tokens=args.span_tokens)
        if not s.placement.tier("pool").wait_idle(180):
            raise RuntimeError("the pool tier did not connect")
        return s

    try:
        a, b = store(), store()
        client = a.placement.tier("pool")._client
        restore, blobs, streamed = _restores(a, b, k, v, args.repeat)
        kv = torch.cat([k.contiguous().view(torch.uint8).reshape(-1), v.contiguous().view(torch.uint8).reshape(-1)])
        raw_objs = [p.cpu().numpy().tobytes() for p in torch.tensor_split(kv, len(blobs))]
        sealer = Sealer(secret)
        aads = [associated("blob", cal.id, "-", h) for _, h in blobs]
        sealed, seal_s, open_s = _seal_cost(sealer, blobs, aads, args.repeat)
        kinds = {"kvtc_sealed": sealed, "kvtc": [d for d, _ in blobs], "raw": raw_objs}
        put, get, fetch_open = _put_get(client, kinds, sealer, aads, args.repeat)
        raw_restore = _raw_restores(client, kv, raw_objs, args.repeat)
        stored = sum(map(len, sealed))
        results = {
            "put_gbps": put,
            "get_gbps": get,
            "restore_ms": {"kvtc_sealed": _stats(restore), "raw": _stats(raw_restore),
                           "kvtc_sealed_get_and_open": _stats(fetch_open),
                           "kvtc_sealed_streamed_first_group": _stats([f for f, _, _ in streamed]),
                           "kvtc_sealed_streamed_get_and_open": _stats([w for _, w, _ in streamed]),
                           "kvtc_sealed_one_by_one_by_the_reader": _stats([o for _, _, o in streamed])},  # fmt: skip
            "tokens_per_restore": T,
            "raw_bytes_per_token": raw_bytes / T,
            "stored_bytes_per_token": {"kvtc_sealed": stored / T, "raw": raw_bytes / T},
            "seal_gbps": _gbps(sum(len(d) for d, _ in blobs), seal_s),
            "open_gbps": _gbps(stored, open_s),
            "ratio": ratio,
            "objects_per_restore": len(blobs),
            "layer_groups": cal.layer_groups,
        }
        a.close()
        b.close()
        if args.layer_groups > 1:
            results["streamed_groups"] = _grouped(args, store, T, ratio)
    finally:
        if master is not None:
            master.stop()
    data = {"bench": "pool", "machine": machine(), "command": " ".join(["dynamo-kvtc", *sys.argv[1:]]),
            "source": source, "device": str(args.device), "transport": "tcp loopback", "results": results}  # fmt: skip
    for key, val in results.items():
        print(f"{key:>24}: {val}")
    write_json(args.json_path, data)
    return 0
