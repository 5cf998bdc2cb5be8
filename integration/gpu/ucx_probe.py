"""Which UCX transport moves a NIXL READ between two processes, and how fast: a diagnosis for the hand-off benchmark
(issue 17: two processes on one H200 read raw KV at 3.3 Gb/s, against 270-360 GB/s between two GPUs by CUDA IPC).

    python integration/gpu/ucx_probe.py OUT_DIR [DEVICE_A DEVICE_B] [--tls default,cuda_ipc+cuda_copy+tcp ...]

For each ``--tls`` entry ('+' joins transports; ``default`` leaves UCX_TLS unset; ``@VAR=VALUE`` suffixes set more
UCX variables, e.g. ``default@UCX_PROTO_ENABLE=n``) it starts a server and a client
process (UCX reads its environment once, at start), the server registers a 512 MiB buffer on DEVICE_A, the client
READs it into DEVICE_B in 64 MiB descriptors, five times after one warm-up READ, and checks the bytes. One JSON line
per entry on stdout (GB/s, ok); each pair's UCX log (UCX_PROTO_INFO, UCX_LOG_LEVEL=info) goes to OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

MB = 1 << 20
SIZE = 512 * MB
PIECE = 64 * MB


def _agent(name: str):
    from dynamo_kvtc.transport.nixl_io import import_nixl

    nixl_agent, nixl_agent_config, _ = import_nixl()
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _mem(t) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


def serve(work: Path, device: str) -> None:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    buf = torch.arange(SIZE // 4, dtype=torch.int32, device=dev).view(torch.uint8)
    agent = _agent("probe-server")
    agent.register_memory(buf)
    descs = [(buf.data_ptr() + o, PIECE, dev.index or 0) for o in range(0, SIZE, PIECE)]
    (work / "server.json").write_text(json.dumps({"descs": descs, "mem": _mem(buf)}))
    (work / "server.md.tmp").write_bytes(bytes(agent.get_agent_metadata()))
    (work / "server.md.tmp").rename(work / "server.md")  # last: the client starts when it appears
    while not (work / "done").exists():
        time.sleep(0.05)


def client(work: Path, device: str) -> dict:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dst = torch.zeros(SIZE, dtype=torch.uint8, device=dev)
    agent = _agent("probe-client")
    agent.register_memory(dst)
    deadline = time.monotonic() + 60
    while not (work / "server.md").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("server did not come up")
        time.sleep(0.05)
    time.sleep(0.2)
    info = json.loads((work / "server.json").read_text())
    agent.add_remote_agent((work / "server.md").read_bytes())
    local = agent.get_xfer_descs(
        [(dst.data_ptr() + o, PIECE, dev.index or 0) for o in range(0, SIZE, PIECE)], _mem(dst)
    )
    remote = agent.get_xfer_descs([tuple(d) for d in info["descs"]], info["mem"])
    times = []
    for i in range(6):
        h = agent.initialize_xfer("READ", local, remote, "probe-server")
        t = time.perf_counter()
        state = agent.transfer(h)
        while state != "DONE":
            if state == "ERR" or time.perf_counter() - t > 20:
                raise RuntimeError(f"READ {i}: {state}")
            state = agent.check_xfer_state(h)
        times.append(time.perf_counter() - t)
        agent.release_xfer_handle(h)
    want = torch.arange(SIZE // 4, dtype=torch.int32, device=dev).view(torch.uint8)
    ok = bool(torch.equal(dst, want))
    best = min(times[1:])
    return {
        "gbps_GBs": round(SIZE / best / 1e9, 2),
        "median_ms": round(sorted(times[1:])[2] * 1e3, 2),
        "first_ms": round(times[0] * 1e3, 1),
        "ok": ok,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("devices", nargs="*", default=["cuda:0", "cuda:0"])
    p.add_argument("--tls", default="default,cuda_ipc+cuda_copy+tcp,cuda_ipc+cuda_copy+sm+self,cuda_copy+tcp")
    p.add_argument("--client-timeout", type=float, default=120.0, help="seconds for one candidate's client process")
    p.add_argument("--role", choices=["server", "client"])
    p.add_argument("--work")
    a = p.parse_args()
    if a.role == "server":
        serve(Path(a.work), a.devices[0])
        return 0
    if a.role == "client":
        print("RESULT " + json.dumps(client(Path(a.work), a.devices[-1])), flush=True)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for entry in a.tls.split(","):
        tls, *extra = entry.split("@")
        label = re.sub(r"[^A-Za-z0-9_.-]", "_", entry)
        work = out / f"work-{label}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": os.environ.get("UCX_LOG_LEVEL", "info")}
        env.pop("UCX_TLS", None)
        if tls != "default":
            env["UCX_TLS"] = tls.replace("+", ",")
        env.update(kv.split("=", 1) for kv in extra)
        log = open(out / f"ucx-{label}.log", "w")
        args = [sys.executable, __file__, str(out), *a.devices, "--work", str(work)]
        srv = subprocess.Popen(args + ["--role", "server"], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            client_cmd = args + ["--role", "client"]
            r = subprocess.run(client_cmd, env=env, capture_output=True, text=True, timeout=a.client_timeout)
            log.write(r.stdout + r.stderr)
            res = [ln[7:] for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            row = json.loads(res[0]) if res else {"error": (r.stderr or r.stdout)[-400:]}
        except subprocess.TimeoutExpired:
            row = {"error": "client timed out"}
        finally:
            (work / "done").touch()
            try:
                srv.wait(timeout=20)
            except subprocess.TimeoutExpired:
                srv.kill()
            log.close()
        text = (out / f"ucx-{label}.log").read_text(errors="replace")
        row["transports_named"] = sorted(
            {
                t
                for t in ("cuda_ipc", "cuda_copy", "tcp", "sysv", "posix", "cma", "rc", "gdr_copy", "self")
                if f" {t}/" in text or f"{t}/" in text
            }
        )
        row["lanes"] = sorted(
            {ln.split("INFO", 1)[1].strip() for ln in text.splitlines() if " cfg#" in ln and "INFO" in ln}
        )
        print(json.dumps({"tls": entry, "devices": a.devices, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
