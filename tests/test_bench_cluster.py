"""bench cluster: the simulator on small clusters, with the measured cost files of docs/results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo_kvtc.bench.cluster.costs import load_costs
from dynamo_kvtc.bench.cluster.loopback import measure_loopback
from dynamo_kvtc.bench.cluster.routers import KvAware, RoundRobin
from dynamo_kvtc.bench.cluster.sim import simulate
from dynamo_kvtc.bench.cluster.systems import SYSTEMS, Layout, Memory
from dynamo_kvtc.bench.cluster.workloads import SimRequest, build
from dynamo_kvtc.cli.main import main
from dynamo_kvtc.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
GPU_JSON = ROOT / "docs/results/bench-gpu-h200.json"
POOL_JSON = ROOT / "docs/results/bench-cluster-cpu/pool-costs-tcp-loopback.json"
SMALL_QA = {"users_per_worker": 6, "rounds": 6, "history": 6000}


@pytest.fixture(scope="module")
def costs():
    return load_costs(GPU_JSON, POOL_JSON)


def _run(reqs, system, router, costs, workers, memory):
    layout = Layout(SYSTEMS[system], memory, costs, workers)
    return simulate(reqs, layout, router, costs).summary(layout)


def test_kvtc_tier_holds_more_conversations_than_raw_at_equal_memory(costs):
    reqs, _ = build("qa", 4, seed=1, **SMALL_QA)
    # per worker: 6 users x ~7K tokens x 160 KB = ~7 GB raw; 2 GB of host memory holds 2 raw conversations, all kvtc
    mem = Memory(gpu_kv_gb=1.0, host_gb=2.0)
    raw = _run(reqs, "node-raw", KvAware(), costs, 4, mem)
    kvtc = _run(reqs, "node-kvtc", KvAware(), costs, 4, mem)
    assert costs.kvtc_ratio > 10
    assert kvtc["hit_by_source"]["local"] > raw["hit_by_source"]["local"] + 0.3
    assert kvtc["hit_rate"] > raw["hit_rate"] + 0.3
    assert kvtc["ttft_s"]["mean"] < raw["ttft_s"]["mean"]


def test_pool_serves_a_worker_that_never_saw_the_conversation(costs):
    # one conversation, two turns; round-robin on 2 workers sends turn 2 to worker 1, which never saw it
    turn1 = SimRequest(0.0, "c", [("c", 8192)], 8192, 64, -1)
    turn2 = SimRequest(100.0, "c", [("c", 8192 + 64 + 512)], 8192 + 64 + 512, 64, 0)
    mem = Memory(gpu_kv_gb=8.0, host_gb=8.0)
    out = {s: _run([turn1, turn2], s, RoundRobin(), costs, 2, mem) for s in SYSTEMS}
    for s in ("node-raw", "node-kvtc"):
        assert out[s]["hit_rate"] == 0.0, s
    for s in ("pool-raw", "pool-kvtc"):
        assert out[s]["hit_by_source"]["pool"] > 0.45, s  # turn 2 finds turn 1's 8,192 + 64 tokens (32 blocks)
        assert out[s]["moved_turns"] == 1
    raw_bpt = out["pool-raw"]["network"]["bytes_per_restored_token"]
    kvtc_bpt = out["pool-kvtc"]["network"]["bytes_per_restored_token"]
    assert raw_bpt == pytest.approx(costs.pool_bytes["raw"])
    assert kvtc_bpt == pytest.approx(costs.pool_bytes["kvtc"])
    assert kvtc_bpt < raw_bpt / 12


def test_kv_aware_routing_beats_round_robin_for_per_node_tiers(costs):
    reqs, _ = build("qa", 8, seed=2, **SMALL_QA)
    mem = Memory(gpu_kv_gb=2.0, host_gb=8.0)
    for system in ("node-raw", "node-kvtc"):
        rr = _run(reqs, system, RoundRobin(), costs, 8, mem)
        kv = _run(reqs, system, KvAware(), costs, 8, mem)
        assert kv["hit_rate"] > rr["hit_rate"] + 0.2, system
        assert kv["moved_turns"] < rr["moved_turns"]


def test_a_missing_cost_field_is_an_error_naming_it(tmp_path):
    g = json.loads(GPU_JSON.read_text())
    for c in g["configs"]:
        del c["recompute"]["ttft_ms"]
    bad = tmp_path / "gpu.json"
    bad.write_text(json.dumps(g))
    with pytest.raises(ConfigError, match=r"recompute\.ttft_ms"):
        load_costs(bad, POOL_JSON)
    p = json.loads(POOL_JSON.read_text())
    del p["results"]["get_gbps"]["kvtc_sealed"]
    bad_pool = tmp_path / "pool.json"
    bad_pool.write_text(json.dumps(p))
    with pytest.raises(ConfigError, match=r"results\.get_gbps\.kvtc_sealed"):
        load_costs(GPU_JSON, bad_pool)
    with pytest.raises(ConfigError, match="nowhere.json"):
        load_costs(GPU_JSON, tmp_path / "nowhere.json")


def test_loopback_measurement_is_a_usable_pool_file(tmp_path):
    data = measure_loopback(163840.0, 10000.0, tokens=32, repeat=2)
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(data))
    c = load_costs(GPU_JSON, path)
    assert data["source"] == "tcp-loopback"
    assert c.pool_bytes["kvtc"] == pytest.approx(10000.0 + 28 / 32)
    assert c.pool_get_gbps["raw"] > 0 and c.pool_get_gbps["kvtc"] > 0


def test_cli_writes_runs_targets_and_cost_files(tmp_path):
    out = tmp_path / "cluster.json"
    rc = main(["bench", "cluster", "--workloads", "qa", "--workers", "2", "--no-progress", "--pool-json",
               str(POOL_JSON), "--gpu-json", str(GPU_JSON), "--json", str(out)]
              + [f"--param={k}={v}" for k, v in {**SMALL_QA, "users_per_worker": 3}.items()])  # fmt: skip
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["bench"] == "cluster" and "machine" in d and d["command"].startswith("dynamo-kvtc")
    assert d["cost_files"]["pool_json"] == str(POOL_JSON)
    assert len(d["runs"]) == 2 * 4
    assert d["targets"] == []  # the targets are at 64 workers
    assert main(["bench", "cluster", "--workloads", "qa", "--workers", "2", "--no-progress"]) == 2  # no pool file


def test_help_documents_workloads_systems_and_costs_without_torch():
    from .test_cli import cli

    p, heavy = cli("bench", "cluster", "--help")
    assert p.returncode == 0 and heavy == []
    text = p.stdout.replace("\n", " ")
    for name in ["qa", "mooncake", *SYSTEMS, "round-robin", "kv-aware", "--pool-json", "--measure-loopback"]:
        assert name in text, name


@pytest.mark.parametrize(
    "args", [["--systems", "node-raw,zip"], ["--routers", "random"], ["--workers", "0"], ["--gpu-config", "2x"],
             ["--workloads", "qa", "--param", "users=3"]],
)  # fmt: skip
def test_bad_arguments_are_refused(args):
    argv = ["bench", "cluster", "--no-progress", "--pool-json", str(POOL_JSON), *args]
    with pytest.raises((SystemExit, ValueError)):
        if main(argv) != 0:
            raise SystemExit(2)


def test_targets_compare_the_kvtc_pool_at_64_workers():
    from dynamo_kvtc.bench.cluster.run import targets

    def run(system, hit, bpt):
        return {"workload": "qa", "workers": 64, "router": "kv-aware", "system": system, "hit_rate": hit,
                "network": {"bytes_per_restored_token": bpt}}  # fmt: skip

    rows = targets([run("pool-kvtc", 0.9, 10.0), run("node-kvtc", 0.7, None), run("pool-raw", 0.3, 160.0)])
    got = {r["goal"]: (round(r["measured"], 4), r["met"]) for r in rows}
    assert got == {1.5: (1.2857, False), 2.0: (3.0, True), 1 / 12: (0.0625, True)}
    rows = targets([run("pool-kvtc", 0.9, 10.0), run("pool-raw", 0.0, None)])
    assert [r["met"] for r in rows] == [True, None]  # the raw pool restored nothing: no ratio to judge
    assert targets([run("pool-kvtc", 0.9, 10.0)], workers=8) == []


def test_the_bench_pool_file_maps_to_the_simulated_model():
    """bench pool's file (a real Mooncake pool, another model): its rates with the seal/open added in series, the
    simulated model's bytes per token from the bench gpu file."""
    path = ROOT / "docs/results/bench-pool-cpu.json"
    p = json.loads(path.read_text())["results"]
    c = load_costs(GPU_JSON, path)
    assert p["raw_bytes_per_token"] != c.raw_bytes and c.pool_bytes["raw"] == c.raw_bytes
    assert c.pool_bytes["kvtc"] == pytest.approx(c.raw_bytes / c.kvtc_ratio)
    assert c.pool_get_gbps["raw"] == p["get_gbps"]["raw"]
    assert c.pool_get_gbps["kvtc"] == pytest.approx(1 / (1 / p["get_gbps"]["kvtc_sealed"] + 1 / p["open_gbps"]))
    assert c.pool_put_gbps["kvtc"] == pytest.approx(1 / (1 / p["put_gbps"]["kvtc_sealed"] + 1 / p["seal_gbps"]))
    assert c.sources["pool_bytes"].startswith("gpu_json")
