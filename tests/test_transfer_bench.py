"""`dynamo-kvtc bench transfer` on this machine: two real processes, NIXL UCX over loopback, compressed vs raw.

The same command measures the two-GPU hand-off (``--prefill-device cuda:0 --decode-device cuda:1``); here it checks
that both paths move the right bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_transfer_moves_compressed_and_raw_kv_between_processes(tmp_path):
    out = tmp_path / "transfer.json"
    p = subprocess.run(
        [sys.executable, "-m", "dynamo_kvtc.cli.main", "bench", "transfer", "--tokens", "1024", "--repeat", "1"]
        + ["--rank", "256", "--json", str(out)],
        env={**os.environ, "UCX_NET_DEVICES": "lo"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["raw_bytes"] == 2 * 30 * 1024 * 3 * 64 * 2  # smollm2 shape, bf16 K and V
    assert row["raw"]["bit_exact"] is True
    assert row["compressed_bytes"] * 3 < row["raw_bytes"]  # window of 128 raw tokens included
    assert row["rel_err_k"] < 0.1 and row["rel_err_v"] < 0.1
    c = row["compressed"]
    assert c["bytes"] == row["compressed_bytes"] and 0 < c["first_layer_s"] <= c["all_layers_s"]
