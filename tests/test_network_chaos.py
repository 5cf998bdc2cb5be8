"""The shared-network chaos kinds (``dynamo-kvtc bench chaos --kinds metadata_holder,multipart_flood,dead_peer_stall,
cancel_timeout``) against the real store, sockets and NIXL UCX agents: every injected fault detected, no wrong KV
served, no crash, no block lost, and each kind's measured bound."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu13")

from dynamo_kvtc.reliability.chaos import Plan, run_chaos  # noqa: E402
from dynamo_kvtc.reliability.testbed import World  # noqa: E402


@pytest.fixture
def world(tmp_path, synth_cal):
    return World(tmp_path, seed=0, cal=synth_cal)


@pytest.mark.parametrize("kind", ["metadata_holder", "multipart_flood", "dead_peer_stall", "cancel_timeout"])
def test_network_chaos_kinds(world, kind):
    ledger = run_chaos(world, Plan(kinds=(kind,), transfer_rounds=8, host_rounds=4))
    c = ledger.kinds[kind]
    assert ledger.problems == []
    assert c["wrong_kv_served"] == 0 and c["crashes"] == 0 and c["committed_blocks_lost"] == 0
    assert c["faults_injected"] > 0 and c["faults_detected"] == c["faults_injected"]
    d = ledger.details.get(kind, {})
    if kind == "multipart_flood":
        assert d["max_growth_mib"] <= 8
    if kind == "dead_peer_stall":
        assert d["dead_fetches_s"] < 2 * 1.0 + 2.0  # two 1 s handshake deadlines (port 1, silent), not 3 x 2 s
        assert d["refused_at_once"] >= 1
    if kind == "metadata_holder":
        assert d["receive_buffer_writes"] > 0  # the holder did write into the receive buffer while fetches landed
