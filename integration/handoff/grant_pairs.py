"""Hand-off latency of two trees, run alternately in pairs: one command for the before/after of a hand-off change.

Each pair runs the same ``dynamo-kvtc bench transfer`` on the old tree and on the new one (the order alternates from
pair to pair, so a drifting load falls on both alike), each in its own processes with ``PYTHONPATH`` set to its tree,
``DYN_KVTC_TRANSFER_SECRET`` set (the sealed, CURVE-encrypted control channel of a real cluster). Per run it takes
the bench's medians (of ``--repeat`` fetches after a warm-up) of the ask (control round trip + the prefill's staging)
and of the KVTC READ; the hand-off is their sum. Per pair it records the load average before and after each run and
the ratio new / old; at the end the median of the pair ratios and of each tree's hand-offs. Prints a table and
writes JSON to the path given (after every run: a run cut short keeps what it measured).

    git worktree add --detach /tmp/kvtc-old f754412
    python integration/handoff/grant_pairs.py --old /tmp/kvtc-old --pairs 5 \
        docs/results/bench-transfer-cpu-ready-grants.json

``--new`` defaults to this file's tree. The bench command is ``--shapes smollm2-135m --tokens 8192 --repeat 5
--timeout 300`` (12.8 MiB of blobs, the compressed 8K-token prompt); ``--bench-args`` replaces it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = "--shapes smollm2-135m --tokens 8192 --repeat 5 --timeout 300"
SECRET = "grant-pairs-cluster-secret-0123456789abcdef"


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return out.stdout.strip() + ("+dirty" if dirty else "")


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_once(tree: Path, bench_args: str, timeout_s: float) -> dict:
    """One bench run on ``tree``: the medians it reported, in ms, and the load around it."""
    with tempfile.TemporaryDirectory(prefix="kvtc-grant-pairs-") as tmp:
        out = Path(tmp) / "bench.json"
        path = os.pathsep.join(x for x in (str(tree), os.environ.get("PYTHONPATH", "")) if x)  # the tree first
        env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "DYN_KVTC_TRANSFER_SECRET": SECRET}
        cmd = [sys.executable, "-c", "import sys; from dynamo_kvtc.cli.main import main; sys.exit(main())",
               "bench", "transfer", *shlex.split(bench_args), "--json", str(out)]  # fmt: skip
        load0, t = _load(), time.monotonic()
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
        wall = time.monotonic() - t
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-2000:]
            return {"error": f"exit {proc.returncode}", "tail": tail, "load_before": load0, "load_after": _load()}
        row = next(r for r in json.loads(out.read_text())["rows"] if "error" not in r)
    c = row["compressed"]
    return {
        "ask_ms": round(1e3 * c["ask_s"], 2),
        "kvtc_read_ms": round(1e3 * c["transfer_s"], 2),
        "handoff_ms": round(1e3 * (c["ask_s"] + c["transfer_s"]), 2),
        "group0_landed_ms": round(1e3 * c["first_range_s"], 2),
        "raw_read_ms": round(1e3 * row["raw"]["transfer_s"], 2),
        "prefill_encode_s": round(row["prefill_encode_s"], 2),
        "compressed_bytes": row["compressed_bytes"],
        "load_before": load0,
        "load_after": _load(),
        "wall_s": round(wall, 1),
    }


def summary(pairs: list[dict]) -> dict:
    ok = [p for p in pairs if "handoff_ms" in p["old"] and "handoff_ms" in p["new"]]
    if not ok:
        return {}
    return {
        "pairs": len(ok),
        "median_pair_ratio": round(statistics.median(p["ratio"] for p in ok), 3),
        "pair_ratios": [p["ratio"] for p in ok],
        "median_old_handoff_ms": round(statistics.median(p["old"]["handoff_ms"] for p in ok), 2),
        "median_new_handoff_ms": round(statistics.median(p["new"]["handoff_ms"] for p in ok), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json_out", help="where the JSON goes")
    p.add_argument("--old", required=True, type=Path, help="the tree before (a git worktree of the old commit)")
    p.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[2], help="the tree after")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--bench-args", default=BENCH)
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one bench run may take")
    a = p.parse_args()
    trees = {"old": a.old.resolve(), "new": a.new.resolve()}
    doc = {
        "command": f"DYN_KVTC_TRANSFER_SECRET=... dynamo-kvtc bench transfer {a.bench_args} --json FILE "
        "(python -c 'from dynamo_kvtc.cli.main import main' with PYTHONPATH set to the tree)",
        "harness": "python integration/handoff/grant_pairs.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
        "trees": {k: {"path": str(v), "commit": _commit(v)} for k, v in trees.items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "note": "hand-off = ask + KVTC READ, medians of the bench's repeats; ratio = new / old per pair; the order "
        "in a pair alternates (odd pairs old first); load = /proc/loadavg's 1-minute average before/after each run",
        "pairs": [],
    }
    print("| pair | first | old ask | old READ | old hand-off | load | new ask | new READ | new hand-off | load "
          "| new/old |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i in range(1, a.pairs + 1):
        order = ["old", "new"] if i % 2 else ["new", "old"]
        pair: dict = {"pair": i, "first": order[0]}
        for k in order:
            pair[k] = run_once(trees[k], a.bench_args, a.run_timeout)
        o, n = pair["old"], pair["new"]
        if "handoff_ms" in o and "handoff_ms" in n:
            pair["ratio"] = round(n["handoff_ms"] / o["handoff_ms"], 3)
            print(f"| {i} | {order[0]} | {o['ask_ms']:.1f} | {o['kvtc_read_ms']:.1f} | {o['handoff_ms']:.1f} | "
                  f"{o['load_before']:.1f}-{o['load_after']:.1f} | {n['ask_ms']:.1f} | {n['kvtc_read_ms']:.1f} | "
                  f"{n['handoff_ms']:.1f} | {n['load_before']:.1f}-{n['load_after']:.1f} | {pair['ratio']:.2f} |",
                  flush=True)  # fmt: skip
        else:
            print(f"| {i} | failed: old {o.get('error', 'ok')}, new {n.get('error', 'ok')} |", flush=True)
        doc["pairs"].append(pair)
        doc["summary"] = summary(doc["pairs"])
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc.get("summary", {}), indent=1))


if __name__ == "__main__":
    main()
