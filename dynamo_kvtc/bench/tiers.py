"""``dynamo-kvtc bench tiers``: offload/onboard throughput, time to first layer vs all layers, host and disk hits.

In one run and on the same KV: the kvtc host tier, the kvtc disk tier, and their uncompressed baselines — a raw host
tier (a pinned copy of the K/V, copied back) and a raw disk tier (the same bytes written and read through the same
NIXL POSIX path). Before every disk read the files' pages are written back and dropped from the page cache
(``posix_fadvise(DONTNEED)``), so the disk is measured, not RAM; the JSON names the file system. Each tier is warmed up
once (codec set-up, kernel compilation, NIXL agents) before the timed repetitions.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .inputs import load_inputs, sync
from .output import machine, write_json


@dataclass
class TierBench:
    """One span of KV stored and restored through ``KvtcStore`` tiers; owns the output buffers the restores fill.
    Never keeps a store open past a measurement."""

    cal: Any
    k: torch.Tensor
    v: torch.Tensor
    args: Any
    out_k: torch.Tensor = field(init=False)
    out_v: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.out_k = torch.empty_like(self.k)
        self.out_v = torch.empty_like(self.v)
        self.dev = self.args.device
        self.raw = self.k.numel() * self.k.element_size() * 2
        self.tokens = list(range(self.k.shape[1]))

    def sink(self, layer, start, kk, vv) -> None:
        self.out_k[layer, start : start + kk.shape[0]] = kk
        self.out_v[layer, start : start + vv.shape[0]] = vv

    def store(self, cfg):
        from ..tiers import KvtcStore

        a = self.args
        return KvtcStore(self.cal, cfg, device=self.dev, block_size=a.block_size, span_tokens=a.span_tokens)

    def _once(self, store, label: str, rep: int) -> tuple[float, float, float, Any, int]:
        """Offload then onboard once: (offload s, first layer s, all layers s, offload result, blocks matched).
        Every repetition uses its own token ids (same K/V), so it stores and restores new blobs."""
        tokens = [(rep + 1) * len(self.tokens) + t for t in self.tokens]  # rep -1: the warm-up round
        sync(self.dev)
        t0 = time.perf_counter()
        r = store.submit_offload(store.hashes(tokens), tokens, keys=self.k, values=self.v).result()
        sync(self.dev)
        offload_s = time.perf_counter() - t0
        if label == "disk":  # push every blob out of memory, and out of the page cache
            for blob_id in store.host.ids():
                store.placement.demote(blob_id)
            drop_page_cache(store.cfg.disk_dir)
        hashes = store.hashes(tokens)
        n = store.match(hashes)
        t0 = time.perf_counter()
        h = store.start_onboard(hashes[:n], sink=self.sink)
        h.wait_layer(0)
        sync(self.dev)
        first = time.perf_counter() - t0
        ok = h.wait()
        sync(self.dev)
        total = time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"onboard failed: {h.error}")
        if r.stored_blocks == 0:
            raise RuntimeError(f"offload stored nothing ({r.skipped})")
        self.last_hashes = hashes[:n]
        return offload_s, first, total, r, n

    def measure(self, store, label: str) -> dict[str, Any]:
        """One store for the whole measurement: warmed up at start (as the engine's worker does), one untimed round,
        then ``repeat`` timed rounds, each on new blobs."""
        res: dict[str, Any] = {"warm_up_s": store.warm_up()}
        times, first, total = [], [], []
        self._once(store, label, -1)  # warm-up round, not timed
        for i in range(max(1, self.args.repeat)):
            t_off, t_first, t_all, r, n = self._once(store, label, i)
            times.append(t_off)
            first.append(t_first)
            total.append(t_all)
            res.update(blocks=n, stored_bytes=r.stored_bytes, ratio_with_window=self.raw / r.stored_bytes)
        res.update(
            offload_s=statistics.median(times),
            offload_GBps=self.raw / statistics.median(times) / 1e9,
            onboard_first_layer_s=statistics.median(first),
            onboard_all_layers_s=statistics.median(total),
            onboard_GBps=self.raw / statistics.median(total) / 1e9,
        )
        if label == "host":
            res["codec_restore_s"] = self.codec_restore_s(store)
            res["tier_vs_codec"] = res["onboard_all_layers_s"] / res["codec_restore_s"]
        return res

    def codec_restore_s(self, store) -> float:
        """Reference for the tier path: the codec's own restore of the same blobs (the last repetition's), handed
        over in pinned host memory, through the same sink; median of ``repeat`` after a warm-up."""
        from ..codec.base import RestoreRun
        from ..codec.blob import BlobView

        runs, _ = store.export(self.last_hashes)
        cuda = torch.device(self.dev).type == "cuda"
        buf = torch.empty(sum(len(r.blob) for r in runs), dtype=torch.uint8, pin_memory=cuda)
        specs, at = [], 0
        bs = self.args.block_size
        for r in runs:
            buf[at : at + len(r.blob)] = torch.frombuffer(bytearray(r.blob.host()), dtype=torch.uint8)
            specs.append((RestoreRun(BlobView(buf, at, len(r.blob)), r.first * bs, r.count * bs), r.at * bs))
            at += len(r.blob)
        codec = store.default_codec()
        times = []
        for _ in range(max(1, self.args.repeat) + 1):
            sync(self.dev)
            t0 = time.perf_counter()
            for layer, parts in codec.restore([run for run, _ in specs]):
                for (kk, vv), (_, start) in zip(parts, specs):
                    self.sink(layer, start, kk, vv)
            sync(self.dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def raw_disk_s(self, directory: str) -> tuple[float, float]:
        """Reference: the same K/V bytes uncompressed through the same NIXL POSIX path — (write s, read + copy-back
        s), the read from a file whose pages were dropped from the page cache. Median of ``repeat`` after a warm-up."""
        from ..transport.nixl_io import NixlFiles

        io = NixlFiles(timeout_s=600)
        data = [t.detach().contiguous().cpu().view(torch.uint8).reshape(-1) for t in (self.k, self.v)]
        path = Path(directory) / "raw.kv"
        writes, reads = [], []
        for _ in range(max(1, self.args.repeat) + 1):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                t0 = time.perf_counter()
                io.write(fd, data[0], 0)
                io.write(fd, data[1], data[0].numel())
                os.fsync(fd)
                writes.append(time.perf_counter() - t0)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                sync(self.dev)
                t0 = time.perf_counter()
                got_k = io.read(fd, data[0].numel(), 0)
                got_v = io.read(fd, data[1].numel(), data[0].numel())
                self.out_k.copy_(got_k.view(self.k.dtype).view(self.k.shape))
                self.out_v.copy_(got_v.view(self.v.dtype).view(self.v.shape))
                sync(self.dev)
                reads.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
        if not (torch.equal(self.out_k, self.k) and torch.equal(self.out_v, self.v)):
            raise RuntimeError("the raw disk tier read back other bytes")
        return statistics.median(writes[1:]), statistics.median(reads[1:])

    def raw_copy_s(self) -> float:
        """Reference: a raw restore of the same bytes from host memory (what an uncompressed tier copies)."""
        cuda = torch.device(self.dev).type == "cuda"
        host_k = self.k.cpu().pin_memory() if cuda else self.k.clone()
        host_v = self.v.cpu().pin_memory() if cuda else self.v.clone()
        sync(self.dev)
        t0 = time.perf_counter()
        self.out_k.copy_(host_k, non_blocking=True)
        self.out_v.copy_(host_v, non_blocking=True)
        sync(self.dev)
        return time.perf_counter() - t0

    def run(self, ratio: float) -> dict[str, Any]:
        from ..tiers import TierConfig
        from ..tiers.config import process_settings

        out = {}
        with tempfile.TemporaryDirectory(dir=self.args.disk_dir) as d:
            raw = self.raw
            base = TierConfig(host_bytes=max(64 << 20, 4 * raw), ratio=ratio, min_tokens=0, window=self.args.window,
                              **process_settings())  # fmt: skip
            store = self.store(base)
            out["host"] = self.measure(store, "host")
            store.close()
            store = self.store(base.with_(disk_bytes=8 * raw + (64 << 20), disk_dir=d))
            out["disk"] = self.measure(store, "disk")
            store.close()
            raw_write, raw_read = self.raw_disk_s(d)
            out["raw_disk"] = {"offload_s": raw_write, "onboard_all_layers_s": raw_read, "file_system": _fs_type(d)}
        self.raw_copy_s()  # warm-up
        out["raw_copy_from_host_s"] = statistics.median(self.raw_copy_s() for _ in range(max(1, self.args.repeat)))
        out["raw_host"] = {"onboard_all_layers_s": out["raw_copy_from_host_s"]}
        out["kvtc_vs_raw"] = {  # < 1: the compressed tier restores faster than the raw one
            "host": out["host"]["onboard_all_layers_s"] / out["raw_copy_from_host_s"],
            "disk": out["disk"]["onboard_all_layers_s"] / raw_read,
        }
        return out


def drop_page_cache(directory: Path | str | None) -> None:
    """Write back and drop the page-cache pages of every file under ``directory`` (a disk read then hits the disk)."""
    if directory is None:
        return
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def _fs_type(path: str) -> str:
    """The file system ``path`` lives on (from /proc/mounts; tmpfs would mean RAM, not a disk)."""
    best, fs = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and os.path.realpath(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, fs = parts[1], parts[2]
    except OSError:
        pass
    return fs


def _print_results(results: dict[str, Any]) -> None:
    for tier in ("host", "disk"):
        r = results[tier]
        print(
            f"{tier:>5}: offload {r['offload_s'] * 1e3:8.1f} ms ({r['offload_GBps']:.3f} GB/s)  onboard first layer "
            f"{r['onboard_first_layer_s'] * 1e3:7.1f} ms, all {r['onboard_all_layers_s'] * 1e3:7.1f} ms "
            f"({r['onboard_GBps']:.3f} GB/s)  ratio incl. window {r['ratio_with_window']:.1f}"
        )
    h = results["host"]
    print(
        f"  codec's own restore of the same blobs (pinned): {h['codec_restore_s'] * 1e3:.1f} ms; "
        f"host tier / codec {h['tier_vs_codec']:.2f}x"
    )
    print(f"  raw host tier (pinned copy of the same KV): {results['raw_copy_from_host_s'] * 1e3:.1f} ms")
    rd = results["raw_disk"]
    print(
        f"  raw disk tier ({rd['file_system']}, page cache dropped): write {rd['offload_s'] * 1e3:.1f} ms, "
        f"read + copy {rd['onboard_all_layers_s'] * 1e3:.1f} ms"
    )
    kv = results["kvtc_vs_raw"]
    print(f"  kvtc restore / raw restore: host {kv['host']:.2f}x, disk {kv['disk']:.2f}x (< 1: kvtc faster)")


def run_bench_tiers(args) -> int:
    """Offload/onboard throughput and time to first layer vs all layers, for host and disk hits."""
    dev = args.device
    cal, spans, source = load_inputs(args)
    k, v, _ = spans[0]
    bench = TierBench(cal, k.to(dev), v.to(dev), args)
    ratio = (args.ratios or (16,))[0]
    results = {} if args.conversations_only else bench.run(ratio)
    names = [n for n in (args.conversations or "").split(",") if n]
    if names:
        from .conversation import run_workloads

        results["conversations"] = run_workloads(cal, bench.k, bench.v, names, args, bench.store)
    data = {
        "benchmark": "tiers",
        "command": " ".join(["dynamo-kvtc", *sys.argv[1:]]),
        "device": dev,
        "ratio": ratio,
        "tokens": bench.k.shape[1],
        "raw_bytes": bench.raw,
        "block_size": args.block_size,
        "span_tokens": args.span_tokens,
        "window": args.window,
        "machine": machine(),
        "source": source,
        "results": results,
    }
    if not args.conversations_only:
        _print_results(results)
    for name, r in results.get("conversations", {}).items():
        print(
            f"  {name}: {r['tokens']} tokens, {r['turns']} turns: effective {r['effective_ratio']:.2f}x "
            f"(bound {r['bound']:.2f}x, codec {r['codec_ratio']:.2f}x; window per offload: "
            f"{r['window_per_offload']['effective_ratio']:.2f}x), extra encode "
            f"{r['extra_encode_ms_per_turn']['mean']:.0f} ms/turn"
        )
    write_json(args.json_path, data)
    return 0
