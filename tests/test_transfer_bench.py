"""`dynamo-kvtc bench transfer` on this machine: two real processes, NIXL UCX over loopback, compressed (4 layer
groups: one READ each, each group restored as it lands) vs raw vs the link-aware policy, uncapped and at an emulated
link rate, and at an emulated rate by replay (the compressed bytes of one real fetch released to the restore
group by group on the emulated link's schedule).

The same command measures the two-GPU hand-off (``--prefill-device cuda:0 --decode-device cuda:1``); here it checks
that both paths move the right bytes, that the token bucket holds both paths to the emulated rate, and that the policy
reports a choice consistent with its own estimates."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_transfer_moves_compressed_and_raw_kv_between_processes(tmp_path):
    out = tmp_path / "transfer.json"
    p = subprocess.run(
        [sys.executable, "-m", "dynamo_kvtc.cli.main", "bench", "transfer", "--tokens", "1024", "--repeat", "1"]
        + ["--rank", "256", "--link-gbps", "0,2", "--chunk-mb", "1", "--replay-gbps", "1", "--json", str(out)],
        env={**os.environ, "UCX_NET_DEVICES": "lo"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads(out.read_text())
    uncapped, capped, replay = data["rows"]
    assert (uncapped["link_gbps"], capped["link_gbps"], replay["link_gbps"]) == (0, 2, 1)
    assert "emulation" not in capped and replay["emulation"] == "replay" and "ask_s" in data["replay_emulation"]
    assert "token bucket" in data["link_emulation"] and data["layer_groups"] == 4
    for row in (uncapped, capped, replay):
        assert row["raw_bytes"] == 2 * 30 * 1024 * 3 * 64 * 2  # smollm2 shape, bf16 K and V
        assert row["raw"]["bit_exact"] is True and row["staging"] == "DRAM"  # replay: checked on its real fetch
        assert row["compressed_bytes"] * 3 < row["raw_bytes"]  # window of 128 raw tokens included
        assert row["rel_err_k"] < 0.1 and row["rel_err_v"] < 0.1
        c, pol = row["compressed"], row["policy"]
        assert c["bytes"] == row["compressed_bytes"] and 0 < c["first_layer_s"] <= c["all_layers_s"]
        assert row["layer_groups"] == 4 and c["ranges"] == 4  # one READ per layer group
        assert 0 < c["ask_s"] <= c["fetch_s"] and 0 < c["first_range_s"] <= c["transfer_s"] <= c["all_layers_s"]
        assert row["raw"]["first_layer_s"] == row["raw"]["all_layers_s"]  # one READ: layer 0 waits for all of it
        assert pol["choice"] == ("raw" if pol["est_raw_s"] <= pol["est_compressed_s"] else "compressed")
        chosen = row["raw"] if pol["choice"] == "raw" else c
        assert (pol["all_layers_s"], pol["first_layer_s"]) == (chosen["all_layers_s"], chosen["first_layer_s"])
        assert pol["within_10pct"] == (pol["all_layers_s"] <= 1.1 * min(row["raw"]["all_layers_s"], c["all_layers_s"]))
    # paced: neither path beats 2 Gb/s (both READs are held to the emulated link)
    assert capped["raw"]["transfer_s"] >= capped["raw_bytes"] * 8 / 2e9
    assert capped["compressed"]["transfer_s"] >= capped["compressed_bytes"] * 8 / 2e9
    assert capped["compressed"]["read_share_of_link"] <= 1.0
    # paced per group: group 0 lands no earlier than its share of the bytes allows, and before the last byte
    assert capped["compressed"]["first_range_s"] < capped["compressed"]["transfer_s"]
    assert 1.0 < capped["policy"]["link_gbps_learned"] <= 2.0 + 1e-6  # learned from the paced READs
    # replay at 1 Gb/s: raw is its bytes at the rate; the compressed restore waited for each group's emulated
    # arrival (the real fetch's control round trip, then the bytes of groups 0..g at the rate), and read the same
    # bytes as the real fetches (same sizes and the same reconstruction error)
    r, c = replay["raw"], replay["compressed"]
    assert r["all_layers_s"] == r["first_layer_s"] == replay["raw_bytes"] * 8 / 1e9
    assert c["bytes"] == capped["compressed"]["bytes"] and c["transfer_s"] == c["bytes"] * 8 / 1e9
    assert c["ranges"] == 4 and 0 < c["first_range_s"] < c["transfer_s"]
    assert c["first_layer_s"] >= c["ask_s"] + c["first_range_s"] and c["all_layers_s"] >= c["ask_s"] + c["transfer_s"]
    assert abs(c["read_share_of_link"] - 1.0) < 1e-9
    assert abs(replay["policy"]["link_gbps_learned"] - 1.0) < 1e-6  # the emulated link only, not the real fetch's


def test_replay_needs_a_positive_rate():
    p = subprocess.run(
        [sys.executable, "-m", "dynamo_kvtc.cli.main", "bench", "transfer", "--tokens", "64", "--replay-gbps", "100,0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "--replay-gbps rates must be > 0" in p.stderr
