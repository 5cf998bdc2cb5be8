"""``dynamo-kvtc bench transfer``: prefill→decode hand-off of a prompt's KV, compressed (KVTC blobs) vs raw, over NIXL.

Two processes, as in disaggregated serving: a *prefill* process (a child) holds the prompt's KV on its device, encoded
into its host tier and also raw in device memory; the *decode* process (this one) pulls it with NIXL READs — the
compressed blobs through the connector's transfer client, then decoded layer by layer into a paged cache on its
device; or the raw K/V straight into its device memory (what vLLM's NixlConnector does, all layers in one READ).
Reported per shape and prompt length: bytes moved, transfer time, time until layer 0 is usable and until all layers
are, and the reconstruction error of the compressed path.

On two GPUs of one host: ``--prefill-device cuda:0 --decode-device cuda:1``. On one machine without GPUs both default
to ``cpu`` and UCX runs over loopback (what the test suite does). KV and calibrations are synthetic (random
orthonormal basis, power-law spectrum; ``calibration/synthetic.py``): the numbers are about bytes and time, not
accuracy.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..calibration.artifact import Calibration
from ..calibration.synthetic import synthetic_calibration, synthetic_kv
from ..connector.config import ConnectorConfig
from ..connector.handoff.client import HandoffClient
from ..connector.handoff.server import HandoffServer
from ..errors import TransferError
from ..tiers.channel import Limits, RepServer, ReqClient
from ..tiers.config import TierConfig
from ..tiers.keys import sequence_hashes
from ..tiers.layout import PagedKV
from ..tiers.nixl_io import PeerAgent, Quarantine, transfer
from ..tiers.store import KvtcStore
from .output import machine, write_json
from .shapes import SHAPES

BS = 32


RAW_LIMITS = Limits(max_message=1 << 24, max_str=1 << 16, max_bin=1 << 22, max_array=1 << 20, max_map=16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _tokens(n: int) -> list[int]:
    return [(i * 7919) % 32000 for i in range(n)]


def _raw_descs(k: torch.Tensor, v: torch.Tensor) -> list[list[int]]:
    dev = k.device.index or 0 if k.is_cuda else 0
    out = []
    for t in (k, v):
        per = t[0].numel() * t.element_size()
        out += [[t.data_ptr() + i * per, per, dev] for i in range(t.shape[0])]
    return out


# ---------------------------------------------------------------------------------------------- prefill side
def serve(cal_path: str, tokens: int, device: str, ratio: float, port_file: str) -> None:
    """The prefill process: encode the prompt into the host tier, serve blobs and raw KV until stdin closes."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cal = Calibration.load(cal_path)
    k, v, _ = synthetic_kv(cal, tokens, device=device)
    raw_bytes = 2 * k.numel() * k.element_size()
    cfg = ConnectorConfig(
        tiers=TierConfig(host_bytes=raw_bytes // 2 + (64 << 20), ratio=ratio, min_tokens=0), transfer="prefill"
    )
    store = KvtcStore(cal, cfg.tiers, device=dev, block_size=BS)
    ids = _tokens(tokens)
    t = time.perf_counter()
    res = store.submit_offload(sequence_hashes(ids, BS), ids, keys=k, values=v, tail=True).result()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    encode_s = time.perf_counter() - t
    if res.stored_blocks != tokens // BS:
        raise TransferError(f"prefill side stored {res.stored_blocks} of {tokens // BS} blocks: {res.skipped}")
    server = HandoffServer(cfg, store)
    raw_agent = PeerAgent(cfg.nixl_backend, "kvtc-bench-raw")
    regs = [raw_agent.agent.register_memory(k), raw_agent.agent.register_memory(v)]
    mem = "VRAM" if dev.type == "cuda" else "DRAM"

    def raw_descs(msg: dict) -> dict:  # NixlConnector-style: the peer reads K and V in place
        with raw_agent.lock:
            raw_agent.add_remote(msg["agent"], msg["agent_md"])
        return {"agent": raw_agent.name, "agent_md": raw_agent.metadata(), "mem": mem, "descs": _raw_descs(k, v)}

    raw = RepServer("tcp://127.0.0.1", raw_descs, RAW_LIMITS, name="kvtc-bench-raw")
    Path(port_file).write_text(
        json.dumps(
            {
                "port": server.port,
                "raw_port": raw.port,
                "encode_s": encode_s,
                "stored_bytes": res.stored_bytes,
                "raw_bytes": raw_bytes,
            }
        )
    )
    sys.stdin.read()  # the decode side closes our stdin when done
    raw.close()
    server.close()
    for r in regs:
        raw_agent.agent.deregister_memory(r)


# ---------------------------------------------------------------------------------------------- decode side
def _raw_pull(agent: PeerAgent, port: int, dst_k: torch.Tensor, dst_v: torch.Tensor, timeout_s: float) -> float:
    ch = ReqClient(f"tcp://127.0.0.1:{port}", RAW_LIMITS, timeout_s, name="raw prefill peer")
    try:
        reply = ch.ask({"op": "descs", "agent": agent.name, "agent_md": agent.metadata()})
    finally:
        ch.close()
    a = agent.agent
    with agent.lock:
        agent.add_remote(reply["agent"], reply["agent_md"])
        local_mem = "VRAM" if dst_k.is_cuda else "DRAM"
        regs = [a.register_memory(dst_k), a.register_memory(dst_v)]
        local = a.get_xfer_descs([tuple(d) for d in _raw_descs(dst_k, dst_v)], local_mem)
        remote = a.get_xfer_descs([tuple(d) for d in reply["descs"]], reply["mem"])
        t = time.perf_counter()
        transfer(
            a, agent.errors, "READ", local, remote, reply["agent"], timeout_s,
            buf=dst_k, quarantine=Quarantine(), registrations=regs, poll_s=0.0,
        )  # fmt: skip
        return time.perf_counter() - t


def _start_prefill(shape: str, tokens: int, args, cal_path: Path, work: Path) -> tuple[subprocess.Popen, dict]:
    """Start the prefill process and wait for what it reports (ports, encode time, bytes)."""
    port_file = work / f"prefill-{shape}-{tokens}.json"
    env = {**os.environ}
    child = subprocess.Popen(
        [sys.executable, "-m", "dynamo_kvtc.bench.transfer", "serve", str(cal_path), str(tokens)]
        + [args.prefill_device, str(args.ratio), str(port_file)],
        stdin=subprocess.PIPE,
        env=env,
        text=True,
    )
    deadline = time.monotonic() + args.timeout
    while not port_file.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            _stop(child)
            raise TransferError(f"prefill process did not come up (exit {child.returncode})")
        time.sleep(0.1)
    time.sleep(0.2)
    return child, json.loads(port_file.read_text())


def _stop(child: subprocess.Popen) -> None:
    if child.stdin:
        child.stdin.close()
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()


def _compressed_runs(store: KvtcStore, client: HandoffClient, pre: dict, tokens: int, args, dev) -> list[dict]:
    """Fetch the blobs over NIXL and restore them layer by layer, ``args.repeat`` times after one warm-up."""
    hashes = sequence_hashes(_tokens(tokens), BS)
    dst = list(range(1, tokens // BS + 1))
    runs = []
    for i in range(args.repeat + 1):
        fetch = {}

        def source(fetch=fetch):
            t = time.perf_counter()
            got = client.fetch("127.0.0.1", pre["port"], hashes)
            fetch["s"] = time.perf_counter() - t
            fetch["bytes"] = sum(len(r.blob) for r in got)
            return got

        t0 = time.perf_counter()
        h = store.start_onboard(hashes, dst, source=source)
        if not h.wait(args.timeout):
            raise TransferError(f"compressed restore failed: {h.error}")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        total = time.perf_counter() - t0
        if i:  # the first round warms up connections and kernels
            runs.append(
                {
                    "transfer_s": fetch["s"],
                    "first_layer_s": h.ready_times[0],
                    "all_layers_s": total,
                    "bytes": fetch["bytes"],
                }
            )
    return runs


def _print_row(row: dict[str, Any]) -> None:
    comp, raw_s = row["compressed"], row["raw"]["transfer_s"]
    print(
        f"{row['shape']:>18} {row['tokens']:>6} | raw {row['raw_bytes'] / 2**20:8.1f} MiB {1000 * raw_s:8.1f} ms"
        f" | kvtc "
        f"{comp['bytes'] / 2**20:7.2f} MiB ({row['bytes_ratio']:4.1f}x) "
        f"transfer {1000 * comp['transfer_s']:7.1f} ms"
        f" layer 0 {1000 * comp['first_layer_s']:7.1f} ms all {1000 * comp['all_layers_s']:7.1f} ms"
        f" | err K {row['rel_err_k']:.3f} V {row['rel_err_v']:.3f}",
        flush=True,
    )


def _one(shape: str, tokens: int, args, cal_path: Path, work: Path) -> dict[str, Any]:
    dev = torch.device(args.decode_device)
    cal = Calibration.load(cal_path)
    fp = cal.fingerprint
    child, pre = _start_prefill(shape, tokens, args, cal_path, work)
    try:
        n = tokens // BS
        caches = [
            torch.zeros(2, n + 1, BS, fp.num_kv_heads, fp.head_dim, dtype=torch.bfloat16, device=dev)
            for _ in range(fp.num_layers)
        ]
        cfg = ConnectorConfig(
            tiers=TierConfig(host_bytes=pre["stored_bytes"] * 2 + (64 << 20), min_tokens=0),
            transfer="decode",
            transfer_timeout_s=args.timeout,
        )
        store = KvtcStore(cal, cfg.tiers, device=dev, block_size=BS, kv=PagedKV(caches, "flash", BS))
        runs = _compressed_runs(store, HandoffClient(cfg), pre, tokens, args, dev)
        k_ref, v_ref, _ = synthetic_kv(cal, tokens, device=str(dev))
        k_got, v_got = store.kv.gather(list(range(1, n + 1)))
        err = {"rel_err_k": _rel(k_got, k_ref), "rel_err_v": _rel(v_got, v_ref)}
        del k_got, v_got
        dst_k, dst_v = torch.empty_like(k_ref), torch.empty_like(v_ref)
        raw_agent = PeerAgent(cfg.nixl_backend, "kvtc-bench-raw-decode")
        raw_runs = [_raw_pull(raw_agent, pre["raw_port"], dst_k, dst_v, args.timeout) for _ in range(args.repeat + 1)]
        raw_ok = bool(torch.equal(dst_k, k_ref) and torch.equal(dst_v, v_ref))
        comp = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        raw_s = statistics.median(raw_runs[1:])
        row = {
            "shape": shape,
            "tokens": tokens,
            "layers": fp.num_layers,
            "raw_bytes": pre["raw_bytes"],
            "compressed_bytes": comp["bytes"],
            "bytes_ratio": pre["raw_bytes"] / comp["bytes"],
            "prefill_encode_s": pre["encode_s"],
            "compressed": comp,
            "raw": {"transfer_s": raw_s, "first_layer_s": raw_s, "all_layers_s": raw_s, "bit_exact": raw_ok},
            **err,
        }
        _print_row(row)
        return row
    finally:
        _stop(child)


def run_bench_transfer(args) -> int:
    shapes = args.shapes.split(",") if isinstance(args.shapes, str) else list(args.shapes)
    lengths = [int(x) for x in args.tokens.split(",")] if isinstance(args.tokens, str) else list(args.tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtc-transfer-") as tmp:
        work = Path(tmp)
        print(f"prefill on {args.prefill_device}, decode on {args.decode_device}, NIXL UCX, ratio {args.ratio:g}")
        for shape in shapes:
            sh = SHAPES[shape]
            cal_path = work / f"cal-{shape}"
            synthetic_calibration(
                sh.layers,
                sh.kv_heads,
                sh.head_dim,
                sh.theta,
                ratios=(args.ratio,),
                rank=args.rank,
                dp_rows=2048,
                device=args.decode_device,
                name=shape,
            ).save(cal_path)
            for tokens in lengths:
                rows.append(_one(shape, tokens, args, cal_path, work))
                write_json(  # after every row: a run cut short keeps what it measured
                    args.json_path,
                    {
                        "bench": "transfer",
                        "prefill_device": args.prefill_device,
                        "decode_device": args.decode_device,
                        "ratio": args.ratio,
                        "rank": args.rank,
                        "rows": rows,
                        "machine": machine(),
                        "synthetic": True,
                    },
                )
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "serve":
    logging.basicConfig(level=logging.WARNING)
    serve(sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5]), sys.argv[6])
