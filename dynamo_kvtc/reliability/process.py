"""Child processes of the harness (one ``python -m dynamo_kvtc.reliability _child ROLE`` entry point) and the
kill -9 scenario: a writing process killed at random, its directory recovered by the next one."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .ledger import Ledger
from .nixl_faults import FaultyAgent
from .testbed import BS, Expect, World, check_blobs, close_store, committed_blobs, make_store, offload


# ====================================================================================================== kill -9
def child_cmd(role: str, **kw: Any) -> list[str]:
    return [sys.executable, "-m", "dynamo_kvtc.reliability", "_child", role, json.dumps(kw)]


def wait_marker(proc: subprocess.Popen, marker: str, timeout: float) -> str | None:
    """Read the child's stdout until a line starting with ``marker`` (NIXL logs to stdout too)."""
    deadline = time.monotonic() + timeout
    box: list[str] = []

    def reader() -> None:
        for line in proc.stdout:
            if line.startswith(marker):
                box.append(line.strip())
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(max(0.0, deadline - time.monotonic()))
    return box[0] if box else None


def drain(proc: subprocess.Popen) -> None:
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()


def child_kill9(world: World, args: dict) -> None:
    """Writer child: recover the directory, verify everything earlier generations committed, report, then write blobs
    until killed, appending one line per committed blob."""
    d = Path(args["dir"])
    gen = args["gen"]
    tmp_found = sum(1 for n in os.listdir(d) if n.endswith(".tmp")) if d.exists() else 0
    store = make_store(world, True, host=0, disk=1 << 30, disk_dir=d)
    log_path = Path(args["log"])
    committed: dict[str, tuple[list[int], int]] = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "C":
                committed[parts[1]] = ([int(x, 16) for x in parts[3].split(",")], int(parts[2]))
    ledger = Ledger()
    expect = Expect(world, True)
    check_blobs(ledger, "kill9_write", world, store, expect, committed, set())
    unreported = [b for b in store.disk.ids() if b not in committed]  # committed but killed before the report line
    check_blobs(ledger, "kill9_write", world, store, expect, committed_blobs(store, unreported), set(unreported))
    verdict = {
        "gen": gen,
        "tmp_found": tmp_found,
        "tmp_removed": store.disk.tmp_removed,
        "dropped": store.disk.dropped,
        "recovered": store.disk.recovered,
        "checked": len(committed),
        "unreported": len(unreported),
        **ledger.kinds.get("kill9_write", {}),
        "problems": ledger.problems,
    }
    Path(args["verdict"]).write_text(json.dumps(verdict))
    print("WRITING", flush=True)
    if args.get("verify_only"):
        close_store(store)
        return
    rng = random.Random(f"{world.seed}/kill9/{gen}")
    slow = FaultyAgent(store.disk.io.agent)  # nothing armed: a pass-through that makes writes slow, so that
    slow.write_delay_s = 0.03  # a random kill lands inside a write (fallocate .. rename) much of the time
    store.disk.io.agent = slow
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    for s in range(10_000):
        toks = world.tokens(("kill9", gen, s), rng.randint(16, 48) * BS)
        _, res = offload(world, store, toks)
        for bid, (hashes, first) in committed_blobs(store, res.blobs).items():
            os.write(fd, f"C {bid} {first} {','.join(f'{h:x}' for h in hashes)}\n".encode())


def scenario_kill9(world: World, ledger: Ledger, kills: int) -> None:
    """``kill -9`` of a process in the middle of disk writes, then a restart: the next process recovers the
    directory, every blob the killed process reported committed must restore bit for bit, torn ``.tmp`` files must be
    gone and never served."""
    kind = "kill9_write"
    rng = random.Random(f"{world.seed}/kill9")
    d = world.fresh_dir("kill9")
    log_path = d.with_name(d.name + ".log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        for gen in range(kills + 1):
            final = gen == kills
            verdict = d.with_name(f"{d.name}.verdict-{gen}.json")
            args = {"dir": str(d), "log": str(log_path), "gen": gen, "verdict": str(verdict), "verify_only": final}
            proc = subprocess.Popen(
                child_cmd("kill9", workdir=str(world.workdir), seed=world.seed, **args),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            try:
                if wait_marker(proc, "WRITING", 120) is None:
                    ledger.add(kind, crashes=1)
                    ledger.problem(kind, f"generation {gen} never reached its write loop (rc {proc.poll()})")
                    continue
                drain(proc)
                if final:
                    rc = proc.wait(60)
                    if rc != 0:
                        ledger.add(kind, crashes=1)
                        ledger.problem(kind, f"final verification exited {rc}")
                else:
                    size0 = log_path.stat().st_size if log_path.exists() else 0
                    deadline = time.monotonic() + 60  # let it commit something, then kill it at a random moment
                    while time.monotonic() < deadline and proc.poll() is None:
                        if log_path.exists() and log_path.stat().st_size > size0:
                            break
                        time.sleep(0.01)
                    time.sleep(rng.uniform(0.0, 0.6))
                    if proc.poll() is not None:
                        ledger.add(kind, crashes=1)
                        ledger.problem(kind, f"writer generation {gen} died by itself (rc {proc.returncode})")
                    else:
                        os.kill(proc.pid, signal.SIGKILL)
                        proc.wait(30)
                        ledger.add(kind, faults_injected=1)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
            if verdict.exists():
                v = json.loads(verdict.read_text())
                if gen:  # this generation recovered what the killed one left
                    ledger.add(kind, faults_detected=1, recomputes=int(v["tmp_found"] > 0))
                    ledger.detail(kind, killed_mid_write=int(v["tmp_found"] > 0), tmp_removed=v["tmp_removed"])
                ledger.add(kind, **{k: v.get(k, 0) for k in ("wrong_kv_served", "committed_blocks_lost", "crashes")})
                ledger.detail(kind, committed_checked=v["checked"], unreported_checked=v["unreported"])
                for p in v["problems"]:
                    ledger.problem(kind, f"gen {gen}: {p}")
            elif not final or proc.returncode:
                ledger.add(kind, crashes=1)
                ledger.problem(kind, f"generation {gen} wrote no verdict")
    finally:
        shutil.rmtree(d, ignore_errors=True)
        for p in d.parent.glob(d.name + ".*"):
            p.unlink(missing_ok=True)
