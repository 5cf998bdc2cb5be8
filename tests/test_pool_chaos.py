"""The pool's cheapest chaos kinds (``dynamo-kvtc bench chaos --kinds pool_corrupt,pool_forged,pool_worker_leaves``)
through the real chaos runner, on a real Mooncake master: a bit-flipped object, objects sealed under another secret
and the objects of a worker that left are all misses (recomputes), never served; no crash."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake")

from dynamo_kvtc.reliability.chaos import Plan, run_chaos  # noqa: E402
from dynamo_kvtc.reliability.testbed import World  # noqa: E402


@pytest.fixture
def world(tmp_path, synth_cal):
    return World(tmp_path, seed=0, cal=synth_cal)


def test_pool_chaos_cheap_kinds(world):
    kinds = ("pool_corrupt", "pool_forged", "pool_worker_leaves")
    ledger = run_chaos(world, Plan(kinds=kinds, host_rounds=4))
    assert ledger.problems == []
    for kind in kinds:
        c = ledger.kinds[kind]
        assert c["wrong_kv_served"] == 0 and c["crashes"] == 0 and c["committed_blocks_lost"] == 0
        assert c["faults_injected"] >= 2 and c["faults_detected"] == c["faults_injected"], (kind, dict(c))
    assert ledger.details["pool_corrupt"]["refused"] == ledger.kinds["pool_corrupt"]["faults_injected"]
    assert ledger.details["pool_forged"]["refused"] == ledger.kinds["pool_forged"]["faults_injected"]
    assert ledger.details["pool_worker_leaves"]["misses"] == 2
