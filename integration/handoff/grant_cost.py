"""What per-lease NIXL registration adds to one hand-off fetch, measured in one process over UCX loopback.

Two ways of serving the same fetch, interleaved (so the machine's load falls on both alike), each iteration: the
prefill side makes the metadata the reply carries, the decode side loads it and READs the blobs (one NIXL READ of
``--mib`` MiB, the compressed size of an 8K-token SmolLM2 prompt by default), then the lease ends.

- ``arena``: the whole staging arena registered once, the agent's full metadata in every reply, loaded once.
- ``lease``: the lease's extent registered for it (``StagingArena.take``), its grant (``StagingArena.grant``) loaded
  by the decode side every fetch (``PeerAgent.add_remote(..., grant=True)``), zeroed and deregistered at the end
  (``StagingArena.give``) — what the hand-off did before its arena registered extents ahead of use
  (``--ready-slots 0``, the default here; ``--ready-slots 2`` measures the rotator, whose release work is then
  asynchronous).

Both ways zero the extent at the end (the old arena zeroed a released extent too). Prints and writes JSON: medians
and quartiles in ms per way of the whole fetch, of its latency (metadata and READ: what the decode side waits for),
of the release after it (zeroing, and for ``lease`` the deregistration), of making and loading the metadata
(``metadata_ms``: for ``lease`` the extent's registration, its grant and the decode side's load of it) and of the
READ, and the median cost of registering and deregistering one extent of the fetch's size.

    python integration/handoff/grant_cost.py --iters 200 --json docs/results/handoff-grant-cost-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from dynamo_kvtc.transport.nixl_io import PeerAgent, Quarantine, read_descs
from dynamo_kvtc.transport.staging import StagingArena


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--mib", type=float, default=12.77)
    p.add_argument("--arena-mib", type=int, default=256)
    p.add_argument("--json", default=None)
    p.add_argument("--ready-slots", type=int, default=0, help="the arena's extents registered ahead (0: per lease, "
                   "on the path, as this measured first; the hand-off's default is 2)")  # fmt: skip
    a = p.parse_args()
    n = int(a.mib * (1 << 20))
    prefill = PeerAgent("UCX", "grant-prefill")
    decoders = {"arena": PeerAgent("UCX", "grant-decode-a"), "lease": PeerAgent("UCX", "grant-decode-l")}
    arena = StagingArena(prefill, a.arena_mib << 20, torch.device("cpu"), ready_slots=a.ready_slots)
    whole = prefill.agent.register_memory(arena.buf)  # the old way: one registration of the whole arena
    recv = torch.zeros(n, dtype=torch.uint8)
    for d in decoders.values():  # one decode agent per way: what one has loaded does not help the other
        with d.lock:
            d.agent.register_memory(recv)
    q = Quarantine()
    times: dict[str, list[float]] = {"arena": [], "lease": []}
    setup: dict[str, list[float]] = {"arena": [], "lease": []}
    reads: dict[str, list[float]] = {"arena": [], "lease": []}
    latency: dict[str, list[float]] = {"arena": [], "lease": []}  # metadata + READ: what the decode side waits for
    release: dict[str, list[float]] = {"arena": [], "lease": []}  # after it, on the prefill's serving thread

    def read(decode: PeerAgent, addr: int) -> None:
        with decode.lock:
            read_descs(decode, [(recv.data_ptr(), n, 0)], "DRAM", [(addr, n, 0)], "DRAM", prefill.name, 30.0,
                       buf=recv, quarantine=q, poll_s=0.0)  # fmt: skip

    def arena_way(i: int) -> None:
        t = time.perf_counter()
        off = (i * (n + 4096)) % (arena.capacity - n) // 256 * 256
        md, decode = prefill.metadata(), decoders["arena"]
        with decode.lock:
            decode.add_remote(prefill.name, md)  # loaded once; known afterwards
        setup["arena"].append(time.perf_counter() - t)
        r = time.perf_counter()
        read(decode, arena.base + off)
        reads["arena"].append(time.perf_counter() - r)
        latency["arena"].append(time.perf_counter() - t)
        r = time.perf_counter()
        arena.buf[off : off + n].zero_()
        release["arena"].append(time.perf_counter() - r)
        times["arena"].append(time.perf_counter() - t)

    def lease_way(i: int) -> None:
        t = time.perf_counter()
        key = f"lease-{i}"
        off = arena.take(key, n)
        md, decode = arena.grant(key), decoders["lease"]
        with decode.lock:
            decode.add_remote(prefill.name, md, grant=True)
        setup["lease"].append(time.perf_counter() - t)
        r = time.perf_counter()
        read(decode, arena.base + off)
        reads["lease"].append(time.perf_counter() - r)
        latency["lease"].append(time.perf_counter() - t)
        r = time.perf_counter()
        arena.give(key)
        release["lease"].append(time.perf_counter() - r)
        times["lease"].append(time.perf_counter() - t)

    for i in range(a.iters + 10):
        for way in (arena_way, lease_way) if i % 2 else (lease_way, arena_way):
            way(i)
    out = {"bench": "handoff grant cost", "iters": a.iters, "read_bytes": n, "arena_bytes": arena.capacity,
           "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads()}}  # fmt: skip
    for way in times:
        for what, xs in (
            ("fetch_ms", times[way][10:]),
            ("latency_ms", latency[way][10:]),
            ("metadata_ms", setup[way][10:]),
            ("read_ms", reads[way][10:]),
            ("release_ms", release[way][10:]),
        ):
            qs = statistics.quantiles([x * 1e3 for x in xs], n=4)
            out[f"{way}_{what}"] = {"median": round(qs[1], 3), "q1": round(qs[0], 3), "q3": round(qs[2], 3)}
    regs, deregs = [], []
    for i in range(40):  # the registration alone: one extent of the fetch's size, registered and deregistered
        off = (i * (n + 4096)) % (arena.capacity - n) // 256 * 256
        t = time.perf_counter()
        with prefill.lock:
            reg = prefill.agent.register_memory(arena.buf[off : off + n])
        regs.append(time.perf_counter() - t)
        t = time.perf_counter()
        with prefill.lock:
            prefill.agent.deregister_memory(reg)
        deregs.append(time.perf_counter() - t)
    out["register_ms"] = round(statistics.median(regs) * 1e3, 3)
    out["deregister_ms"] = round(statistics.median(deregs) * 1e3, 3)
    for what in ("latency", "fetch"):
        m = out[f"lease_{what}_ms"]["median"] / out[f"arena_{what}_ms"]["median"]
        out[f"lease_over_arena_{what}"] = round(m, 3)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    prefill.agent.deregister_memory(whole)
    arena.close()


if __name__ == "__main__":
    main()
