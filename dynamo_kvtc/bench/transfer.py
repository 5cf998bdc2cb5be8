"""``dynamo-kvtc bench transfer``: prefill→decode hand-off of a prompt's KV, compressed (KVTC blobs) vs raw vs the
link-aware policy, over NIXL, at emulated link rates.

Two processes, as in disaggregated serving: a *prefill* process (a child, :mod:`.transfer_prefill`) holds the prompt's
KV on its device, encoded into its host tier and also raw in device memory; the *decode* process (this one) pulls it
with NIXL READs — the compressed blobs through the connector's hand-off client (staged by the prefill side in a
registered arena, device memory on a GPU, READ into a registered receive buffer, device memory on a GPU, one READ per
layer group), then restored layer group by layer group from the receive buffer into a paged cache on its device,
each group as soon as its READ landed; or the raw K/V straight into its device memory (what vLLM's NixlConnector
does: every layer's K and V, layer 0 usable only when the whole READ is done).

Link emulation (``--link-gbps 0,100,200,400``; 0 = uncapped): a token bucket in this process paces both paths' READs
the same way (:class:`~dynamo_kvtc.transport.nixl_io.TokenBucket`): a READ goes out in chunks of ``--chunk-mb`` (larger
where that would make more than 16), each
posted no earlier than ``start + bytes before it / rate``, done no earlier than ``start + bytes / rate``. The compressed
path's per-group READs share one bucket (one paced transfer). It emulates a link's rate, not its latency. Per row
(shape, prompt, link): bytes moved, READ time, time until layer 0 is usable (on a GPU: its writes finished on the
device) and until all layers are, for raw, compressed and the policy's choice (:class:`~dynamo_kvtc.connector.
handoff.linkpolicy.LinkPolicy`, learning the link from this row's READs of both paths and the restore rate from its
compressed restores, no setting), its estimates, the measured time of the path it chose, and whether that is within
10% of the better fixed choice; the reconstruction error of the compressed path.

On two GPUs of one host: ``--prefill-device cuda:0 --decode-device cuda:1``; on one GPU both ``cuda:0`` (two
processes sharing it). On one machine without GPUs both default to ``cpu`` and UCX runs over loopback (what the test
suite does). KV and calibrations are synthetic (random orthonormal basis, power-law spectrum;
``calibration/synthetic.py``; with ``--layer-groups`` > 1 (default 4, the layout of ``calibrate --layer-groups``)
``bench gpu``'s per-group calibration, min(p_g, 10240) components per group, ``--rank`` then unused): the numbers
are about bytes and time, not accuracy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..calibration.artifact import Calibration
from ..connector.config import ConnectorConfig, handoff_settings
from ..connector.handoff.client import HandoffClient
from ..connector.handoff.link_choice import RAW, LinkPolicy
from ..errors import InputError, TransferError
from ..tiers.config import TierConfig, process_settings
from ..tiers.keys import sequence_hashes
from ..tiers.layout import PagedKV
from ..tiers.store import KvtcStore
from ..transport.arriving import GroupArrival
from ..transport.channel import ReqClient
from ..transport.nixl_io import PeerAgent, Quarantine, TokenBucket, read_descs
from .output import machine, write_json
from .shapes import SHAPES
from .transfer_prefill import BS, RAW_LIMITS, grouped_calibration, grouped_kv, prompt_tokens, raw_descs

log = logging.getLogger(__name__)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---------------------------------------------------------------------------------------------- decode side
class RawPeer:
    """The raw path's decode side: one NIXL agent and registered destination K/V, READ per layer like NixlConnector."""

    def __init__(
        self, backend: str, port: int, dst_k: torch.Tensor, dst_v: torch.Tensor, timeout_s: float, progress_us: int = 0
    ) -> None:
        self.agent = PeerAgent(backend, "kvtc-bench-raw-decode", progress_us=progress_us)
        self.dst_k, self.dst_v, self.timeout_s = dst_k, dst_v, timeout_s
        ch = ReqClient(f"tcp://127.0.0.1:{port}", RAW_LIMITS, timeout_s, name="raw prefill peer")
        try:
            self.reply = ch.ask({"op": "descs", "agent": self.agent.name, "agent_md": self.agent.metadata()})
        finally:
            ch.close()
        self.agent.add_remote(self.reply["agent"], self.reply["agent_md"])
        self.regs = [self.agent.agent.register_memory(dst_k), self.agent.agent.register_memory(dst_v)]
        self.quarantine = Quarantine()

    def pull(self, pace: TokenBucket | None) -> float:
        """One READ of every layer's K and V; its seconds (= time until layer 0, and every layer, is usable)."""
        local = [tuple(d) for d in raw_descs(self.dst_k, self.dst_v)]
        remote = [tuple(d) for d in self.reply["descs"]]
        mem = "VRAM" if self.dst_k.is_cuda else "DRAM"
        with self.agent.lock:
            return read_descs(
                self.agent, local, mem, remote, self.reply["mem"], self.reply["agent"], self.timeout_s,
                buf=self.dst_k, quarantine=self.quarantine, pace=pace,
            )  # fmt: skip

    def close(self) -> None:
        for r in self.regs:
            self.agent.agent.deregister_memory(r)


def _start_prefill(shape: str, tokens: int, args, cal_path: Path, work: Path) -> tuple[subprocess.Popen, dict]:
    """Start the prefill process and wait for what it reports (ports, encode time, bytes)."""
    port_file = work / f"prefill-{shape}-{tokens}.json"
    child = subprocess.Popen(
        [sys.executable, "-m", "dynamo_kvtc.bench.transfer_prefill", str(cal_path), str(tokens)]
        + [args.prefill_device, str(args.ratio), str(port_file)],
        stdin=subprocess.PIPE,
        env={**os.environ},
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


def _layer0_probe(h, dev: torch.device, t0: float, box: dict) -> threading.Thread:
    """A thread that records when layer 0 of the restore ``h`` is usable: its writes queued and, on a GPU, finished
    on the device (waited on a stream of its own)."""

    def probe() -> None:
        try:
            if dev.type == "cuda":
                s = torch.cuda.Stream(dev)
                with torch.cuda.stream(s):
                    h.wait_layer(0)
                s.synchronize()
            else:
                h.wait_layer(0)
            box["s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - the restore's own error is reported by its handle
            box["error"] = e

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    return t


def _timed_restore(store: KvtcStore, hashes: list[int], dst: list[int], source, timeout: float, what: str):
    """Restore ``hashes`` into blocks ``dst`` from ``source``: (seconds until all layers are usable — on a GPU
    finished on the device — and until layer 0 is)."""
    dev = store.device
    layer0: dict[str, Any] = {}
    t0 = time.perf_counter()
    h = store.start_onboard(hashes, dst, source=source)
    probe = _layer0_probe(h, dev, t0, layer0)
    if not h.wait(timeout):
        raise TransferError(f"{what} restore failed: {h.error}")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    total = time.perf_counter() - t0
    probe.join(timeout)
    return total, layer0.get("s", total)


def _compressed_runs(store: KvtcStore, client: HandoffClient, pre: dict, tokens: int, args) -> list[dict]:
    """Fetch the blobs over NIXL (one READ per layer group) and restore them group by group as they land,
    ``args.repeat`` times after one warm-up."""
    hashes = sequence_hashes(prompt_tokens(tokens), BS)
    dst = list(range(1, tokens // BS + 1))
    runs = []
    for i in range(args.repeat + 1):
        fetch: dict[str, float] = {}

        def source(fetch=fetch):
            t = time.perf_counter()
            got = client.fetch("127.0.0.1", pre["port"], hashes)
            fetch["s"] = time.perf_counter() - t
            return got

        total, first = _timed_restore(store, hashes, dst, source, args.timeout, "compressed")
        client.flush()  # the READs' numbers are in place
        client.link.observe_restore(pre["raw_bytes"], max(total - client.last["read_s"], 1e-6))
        if i:  # the first round warms up connections and kernels
            runs.append(
                {
                    "fetch_s": fetch["s"],  # control round trip + the prefill side's staging + posting the READs
                    "ask_s": client.last["ask_s"],  # control round trip + the prefill side's staging
                    "transfer_s": client.last["read_s"],  # first READ posted -> last READ done
                    "first_range_s": client.last["first_range_s"],  # first READ posted -> group 0 landed
                    "ranges": int(client.last["ranges"]),
                    "first_layer_s": first,
                    "all_layers_s": total,
                    "bytes": int(client.last["bytes"]),
                }
            )
    return runs


def _replayed(store: KvtcStore, client: HandoffClient, pre: dict, tokens: int, args, gbps: float) -> list[dict]:
    """The compressed path on an emulated link faster than the real one (``--replay-gbps``): one real fetch lands
    the blobs in the receive buffer; each timed round then restores them from there in place, its source waiting
    the real fetch's ``ask_s`` (control round trip + prefill staging, measured) and byte range g released to the
    restore at ``bytes of ranges 0..g / rate`` after that — the arrival schedule of one READ per group, in order, on
    a link of ``gbps``. The decode side's work (waits, kernels, the paged writes) is real; the link is a schedule."""
    dev = store.device
    hashes = sequence_hashes(prompt_tokens(tokens), BS)
    dst = list(range(1, tokens // BS + 1))
    runs0 = client.fetch("127.0.0.1", pre["port"], hashes)
    client.flush()  # every READ over: the bytes are in the receive buffer
    client.link = LinkPolicy(gpu=dev.type == "cuda")  # that fetch's rate is the real path's, not this row's link
    arrival0 = runs0[0].blob.arrival
    if arrival0.error is not None or None in arrival0.landed_s:
        raise TransferError(f"replay: the real fetch failed: {arrival0.error}")
    ask_s, n, rate = client.last["ask_s"], arrival0.ranges, gbps * 1e9 / 8
    ends = [sum(r.blob.ends[g] for r in runs0) for g in range(n)]  # bytes landed once READ g is done
    out = []
    try:
        for i in range(args.repeat + 1):
            arr = GroupArrival(n, len(runs0), args.timeout)
            runs = [dataclasses.replace(r, blob=r.blob.again(arr)) for r in runs0]

            def link(arr=arr) -> None:
                arr.started = t = time.perf_counter()
                for g in range(n):
                    time.sleep(max(0.0, t + ends[g] / rate - time.perf_counter()))
                    arr.landed(g)
                arr.finished.set()

            def source(runs=runs, link=link):
                time.sleep(ask_s)
                threading.Thread(target=link, daemon=True).start()
                return runs

            total, first = _timed_restore(store, hashes, dst, source, args.timeout, "replayed")
            client.link.observe_restore(pre["raw_bytes"], max(total - ask_s - ends[-1] / rate, 1e-6))
            if i:
                out.append(
                    {
                        "fetch_s": ask_s,
                        "ask_s": ask_s,
                        "transfer_s": ends[-1] / rate,
                        "first_range_s": ends[0] / rate,
                        "ranges": n,
                        "first_layer_s": first,
                        "all_layers_s": total,
                        "bytes": ends[-1],
                    }
                )
    finally:
        for r in runs0:  # read out: the receive buffer may take the next fetch
            r.blob.consumed()
    return out


def _replay_rows(shape: str, tokens: int, args, pre: dict, store, client, err: dict) -> list[dict[str, Any]]:
    """One row per ``--replay-gbps`` rate: raw = its bytes at the rate (a NixlConnector READ does nothing else),
    compressed = :func:`_replayed`, and the policy choosing from what it learned of both."""
    rows = []
    for gbps in args.replay_gbps:
        peer = f"127.0.0.1:{pre['port']}"
        raw_s = pre["raw_bytes"] * 8 / (gbps * 1e9)
        raw = {"bytes": pre["raw_bytes"], "transfer_s": raw_s, "first_layer_s": raw_s, "all_layers_s": raw_s}
        comp = _med(_replayed(store, client, pre, tokens, args, gbps))  # leaves a policy that knows only restores
        client.link.observe(peer, pre["raw_bytes"], raw_s)  # the policy learns the emulated link from both paths
        client.link.observe(peer, int(comp["bytes"]), comp["transfer_s"])
        client.link.observe_staging(int(comp["bytes"]), comp["ask_s"])
        rows.append(_row(shape, tokens, gbps, store, client, pre, raw, comp, err, emulation="replay"))
    return rows


def _row(shape: str, tokens: int, gbps: float, store, client, pre: dict, raw: dict, comp: dict, err: dict, **extra):
    """One printed result row: both paths' medians, the policy's choice and the reconstruction error."""
    comp["ranges"] = int(comp["ranges"])
    comp["first_layer_share"] = comp["first_layer_s"] / comp["all_layers_s"]
    comp["read_gbps"] = 8 * comp["bytes"] / comp["transfer_s"] / 1e9
    if gbps:
        comp["read_share_of_link"] = comp["read_gbps"] / gbps
    row = {
        "shape": shape,
        "tokens": tokens,
        "link_gbps": gbps,
        **extra,
        "layers": store.cal.fingerprint.num_layers,
        "layer_groups": len(store.cal.groups),
        "raw_bytes": pre["raw_bytes"],
        "compressed_bytes": comp["bytes"],
        "bytes_ratio": pre["raw_bytes"] / comp["bytes"],
        "prefill_encode_s": pre["encode_s"],
        "staging": pre.get("staging"),
        "compressed": comp,
        "raw": raw,
        "policy": _policy(client, pre, raw, comp),
        **err,
    }
    _print_row(row)
    return row


def _med(runs: list[dict]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def _policy(client: HandoffClient, pre: dict, raw: dict, comp: dict) -> dict[str, Any]:
    """The policy's choice from what it learned in this row, and how it fared against the better fixed choice."""
    c = client.choose("127.0.0.1", pre["port"], pre["raw_bytes"], comp["bytes"])
    chosen = raw if c.choice == RAW else comp
    got = chosen["all_layers_s"]
    best = min(raw["all_layers_s"], comp["all_layers_s"])
    return {
        "choice": c.choice,
        "est_raw_s": c.raw_s,
        "est_compressed_s": c.compressed_s,
        "link_gbps_learned": c.link_gbps,
        "bytes": chosen["bytes"],
        "transfer_s": chosen["transfer_s"],
        "first_layer_s": chosen["first_layer_s"],
        "all_layers_s": got,
        "better_fixed": "raw" if raw["all_layers_s"] <= comp["all_layers_s"] else "compressed",
        "within_10pct": bool(got <= 1.1 * best),
    }


def _print_row(row: dict[str, Any]) -> None:
    comp, raw, pol = row["compressed"], row["raw"], row["policy"]
    link = f"{row['link_gbps']:g} Gb/s" if row["link_gbps"] else "uncapped"
    link += " replay" if row.get("emulation") == "replay" else ""
    print(
        f"{row['shape']:>18} {row['tokens']:>6} {link:>11} | raw {row['raw_bytes'] / 2**20:8.1f} MiB"
        f" {1000 * raw['all_layers_s']:8.1f} ms | kvtc {comp['bytes'] / 2**20:7.2f} MiB ({row['bytes_ratio']:4.1f}x)"
        f" read {1000 * comp['transfer_s']:7.1f} ms ({comp['ranges']} READs, group 0 landed"
        f" {1000 * comp['first_range_s']:7.1f} ms) layer 0 {1000 * comp['first_layer_s']:7.1f} ms"
        f" all {1000 * comp['all_layers_s']:7.1f} ms"
        f" | policy {pol['choice']:>10} layer 0 {1000 * pol['first_layer_s']:7.1f} ms all"
        f" {1000 * pol['all_layers_s']:7.1f} ms"
        f" {'ok' if pol['within_10pct'] else 'SLOW'} | err K {row['rel_err_k']:.3f} V {row['rel_err_v']:.3f}",
        flush=True,
    )


def _link_rows(shape: str, tokens: int, args, pre: dict, store, client, raw_peer, err: dict) -> list[dict[str, Any]]:
    """One row per emulated link rate (0 = uncapped): raw, compressed and the policy, each path paced the same."""
    rows = []
    for gbps in args.link_gbps:
        pace = TokenBucket(gbps, int(args.chunk_mb * (1 << 20))) if gbps else None
        client.pace, client.link = pace, LinkPolicy(gpu=store.device.type == "cuda")  # learns this link afresh
        raw_runs = [raw_peer.pull(pace) for _ in range(args.repeat + 1)]
        for s in raw_runs:
            client.link.observe(f"127.0.0.1:{pre['port']}", pre["raw_bytes"], s)
        raw_s = statistics.median(raw_runs[1:])
        raw = {"bytes": pre["raw_bytes"], "transfer_s": raw_s, "first_layer_s": raw_s, "all_layers_s": raw_s}
        comp = _med(_compressed_runs(store, client, pre, tokens, args))
        rows.append(_row(shape, tokens, gbps, store, client, pre, raw, comp, err))
    return rows


def _one(shape: str, tokens: int, args, cal_path: Path, work: Path) -> list[dict[str, Any]]:
    dev = torch.device(args.decode_device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
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
            tiers=TierConfig(host_bytes=pre["stored_bytes"] * 2 + (64 << 20), min_tokens=0, **process_settings()),
            transfer="decode",
            transfer_timeout_s=args.timeout,
            **handoff_settings(),  # DYN_KVTC_HANDOFF_MEMORY=host measures the host path
        )
        store = KvtcStore(cal, cfg.tiers, device=dev, block_size=BS, kv=PagedKV(caches, "flash", BS))
        client = HandoffClient(cfg, dev)
        _compressed_runs(store, client, pre, tokens, args)  # one round to measure the error
        k_ref, v_ref = grouped_kv(cal, tokens, device=str(dev))
        k_got, v_got = store.kv.gather(list(range(1, n + 1)))
        err = {"rel_err_k": _rel(k_got, k_ref), "rel_err_v": _rel(v_got, v_ref)}
        del k_got, v_got
        raw_peer = RawPeer(cfg.nixl_backend, pre["raw_port"], torch.empty_like(k_ref), torch.empty_like(v_ref),
                           args.timeout, cfg.nixl_progress_us)  # fmt: skip
        raw_peer.pull(None)
        err["raw_bit_exact"] = bool(torch.equal(raw_peer.dst_k, k_ref) and torch.equal(raw_peer.dst_v, v_ref))
        del k_ref, v_ref
        rows = _link_rows(shape, tokens, args, pre, store, client, raw_peer, err)
        rows += _replay_rows(shape, tokens, args, pre, store, client, err)
        for row in rows:
            row["raw"]["bit_exact"] = err["raw_bit_exact"]
        raw_peer.close()
        client.close()
        store.close()
        return rows
    finally:
        _stop(child)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as the table of docs/performance.md (times in ms; raw's layer 0 = its READ = all layers; the
    policy's times are the path it chose)."""
    head = (
        "| shape | prompt | link | raw KV | raw READ = layer 0 = all | KVTC bytes | KVTC READ (share of link) | "
        "group 0 landed | layer 0 | all layers | layer 0 / all | all / raw | policy: layer 0, all | "
        "policy vs better |\n" + "|---" * 14 + "|\n"
    )
    out = []
    for r in rows:
        c, raw, pol = r["compressed"], r["raw"], r["policy"]
        share = f" ({100 * c['read_share_of_link']:.0f}%)" if "read_share_of_link" in c else ""
        best = min(raw["all_layers_s"], c["all_layers_s"])
        link = f"{r['link_gbps']:g} Gb/s" if r["link_gbps"] else "uncapped"
        link += " (replay)" if r.get("emulation") == "replay" else ""
        out.append(
            f"| {r['shape']} | {r['tokens'] // 1024}K | {link} "
            f"| {r['raw_bytes'] / 2**20:.0f} MiB | {1e3 * raw['all_layers_s']:.1f} | {c['bytes'] / 2**20:.1f} MiB "
            f"({r['bytes_ratio']:.1f}x) | {1e3 * c['transfer_s']:.1f}{share} | {1e3 * c['first_range_s']:.1f} "
            f"| {1e3 * c['first_layer_s']:.1f} | {1e3 * c['all_layers_s']:.1f} "
            f"| {c['first_layer_s'] / c['all_layers_s']:.2f} | {c['all_layers_s'] / raw['all_layers_s']:.2f} "
            f"| {pol['choice']} {1e3 * pol['first_layer_s']:.1f}, {1e3 * pol['all_layers_s']:.1f} "
            f"| {pol['all_layers_s'] / best:.2f}{'' if pol['within_10pct'] else ' (>10%)'} |"
        )
    return head + "\n".join(out) + "\n"


def run_bench_transfer(args) -> int:
    args.link_gbps = list(getattr(args, "link_gbps", None) or [0.0])
    args.chunk_mb = getattr(args, "chunk_mb", 4.0)
    args.layer_groups = getattr(args, "layer_groups", 4)
    args.replay_gbps = list(getattr(args, "replay_gbps", None) or [])
    if any(not g > 0 for g in args.replay_gbps):
        raise InputError(f"--replay-gbps rates must be > 0 Gb/s (a replayed link needs a rate), got {args.replay_gbps}")
    shapes = args.shapes.split(",") if isinstance(args.shapes, str) else list(args.shapes)
    lengths = [int(x) for x in args.tokens.split(",")] if isinstance(args.tokens, str) else list(args.tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtc-transfer-") as tmp:
        work = Path(tmp)
        print(
            f"prefill on {args.prefill_device}, decode on {args.decode_device}, NIXL UCX, ratio {args.ratio:g}, "
            f"{args.layer_groups} layer groups (one READ each), links "
            + ", ".join(f"{g:g} Gb/s" if g else "uncapped" for g in args.link_gbps)
        )
        for shape in shapes:
            sh = SHAPES[shape]
            cal_path = work / f"cal-{shape}"
            grouped_calibration(
                sh, min(args.layer_groups, sh.layers), ratio=args.ratio, rank=args.rank, device=args.decode_device,
                name=shape,
            ).save(cal_path)  # fmt: skip
            for tokens in lengths:
                try:
                    rows.extend(_one(shape, tokens, args, cal_path, work))
                except (TransferError, RuntimeError, OSError) as e:  # the next prompt length may still work
                    log.exception("bench transfer %s %d failed", shape, tokens)
                    print(f"{shape:>18} {tokens:>6} | FAILED: {type(e).__name__}: {e}", flush=True)
                    rows.append({"shape": shape, "tokens": tokens, "error": f"{type(e).__name__}: {e}"})
                write_json(  # after every row: a run cut short keeps what it measured
                    args.json_path,
                    {
                        "bench": "transfer",
                        "prefill_device": args.prefill_device,
                        "decode_device": args.decode_device,
                        "ratio": args.ratio,
                        "rank": args.rank,
                        "layer_groups": args.layer_groups,
                        "link_emulation": "token bucket pacing both paths' NIXL READs in chunks of at least "
                        f"{args.chunk_mb:g} MiB, at most 16 per READ (rate only, no added latency); 0 = uncapped",
                        "replay_emulation": "rows with emulation=replay: the compressed blobs landed by one real "
                        "fetch, then restored from the receive buffer with byte range g released at ask_s + bytes "
                        "of ranges 0..g / rate; raw = raw bytes / rate",
                        "rows": rows,
                        "machine": machine(),
                        "synthetic": True,
                    },
                )
    print(markdown_table([r for r in rows if "error" not in r]))
    return 1 if any("error" in r for r in rows) else 0
