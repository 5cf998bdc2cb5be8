"""The ``kvtc_*`` Prometheus endpoint of the tiers (router events go through vLLM's KV event stream: the vLLM tests)."""

from __future__ import annotations

import random
import urllib.request

import pytest

from dynamo_kvtc.connector import KvtcMetrics
from dynamo_kvtc.tiers import KvtcStore, TierConfig

from .conftest import offload_seq


def _tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


async def test_metrics_scrape_matches_the_store(synth, synth_cal):
    prometheus_client = pytest.importorskip("prometheus_client")
    cfg = TierConfig(host_bytes=1 << 20, ratio=8, min_tokens=32, page_bytes=1024, window=32)
    store = KvtcStore(synth_cal, cfg, block_size=16, span_tokens=128)
    toks = _tokens(320, 1)
    offload_seq(store, toks, *synth.sample(320)[:2])
    h = store.start_onboard(store.hashes(toks), sink=lambda *a: None)
    assert await h.done()
    m = KvtcMetrics(store)
    text = prometheus_client.generate_latest(m.registry).decode()
    snap = store.snapshot()
    assert f'kvtc_tier_blocks{{tier="host"}} {float(snap["host_blocks"])}' in text
    assert "kvtc_restore_seconds_count 1.0" in text and "kvtc_time_to_first_layer_seconds_count 1.0" in text
    ratio = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvtc_effective_ratio "))
    assert ratio == pytest.approx(snap["host_raw_bytes"] / snap["host_stored_bytes"])
    port = m.serve(0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvtc_offload_blocks_total{tier="host"} 20.0' in body
    store.close()


@pytest.mark.parametrize("extra, bound", [({}, "127.0.0.1"), ({"metrics_host": "0.0.0.0"}, "0.0.0.0")])
def test_the_worker_endpoint_binds_loopback_unless_told(synth_cal, extra, bound):
    """metrics_port alone serves on loopback only (a pod's scraper needs metrics_host, as the manifests set)."""
    pytest.importorskip("prometheus_client")
    from collections import Counter

    from dynamo_kvtc.connector.config import ConnectorConfig
    from dynamo_kvtc.connector.vllm.services import WorkerServices

    store = KvtcStore(synth_cal, TierConfig(host_bytes=1 << 20, ratio=8), block_size=16, span_tokens=128)
    svc = WorkerServices(ConnectorConfig.from_sources({"metrics_port": 0, **extra}, env={}), "m", Counter())
    try:
        svc._start_metrics(None, store)
        assert svc._http.server_address[0] == bound
        body = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).read().decode()
        assert "kvtc_tier_blocks" in body
    finally:
        svc.stop()
        store.close()
