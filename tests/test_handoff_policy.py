"""The link-aware raw-vs-compressed choice of the hand-off (connector/handoff/link_choice.py), with the sizes and rates
measured on H200s (docs/performance.md, docs/results/history-performance.md): NeMo-12B 8K = 1280 MiB of raw KV,
90.6 MiB of KVTC blobs; Llama-3.1-8B 32K = 4096 MiB raw, 236 MiB of blobs; raw GPU->GPU over NVLink at 270-360 GB/s."""

from __future__ import annotations

import logging
import math

import pytest

from dynamo_kvtc.connector.handoff.link_choice import COMPRESSED, RAW, LinkPolicy
from dynamo_kvtc.errors import ConfigError

MiB = 1 << 20
NEMO_8K = (1280 * MiB, int(90.6 * MiB))
LLAMA_32K = (4096 * MiB, int(236.1 * MiB))
H200_RESTORE_GBS = 10 * (1 << 30) / 0.124 / 1e9  # 8 x 8K NeMo restored in 124 ms


@pytest.mark.parametrize("raw,comp", [NEMO_8K, LLAMA_32K])
def test_nvlink_picks_raw_and_200_gbps_or_less_picks_compressed(raw, comp):
    nvlink = LinkPolicy(270 * 8, H200_RESTORE_GBS)  # 270 GB/s, the slowest raw READ measured over NVLink
    assert nvlink.choose("p", raw, comp).choice == RAW
    for gbps in (100, 200):
        c = LinkPolicy(gbps, H200_RESTORE_GBS).choose("p", raw, comp)
        assert c.choice == COMPRESSED
        assert c.raw_s == pytest.approx(raw / (gbps * 1e9 / 8))
        assert c.compressed_s == pytest.approx(comp / (gbps * 1e9 / 8) + raw / (H200_RESTORE_GBS * 1e9))
        assert c.link_source == "setting" and c.link_gbps == pytest.approx(gbps)


def test_the_link_is_learned_from_reads_and_a_setting_overrides_it():
    p = LinkPolicy(restore_gbs=H200_RESTORE_GBS)
    raw, comp = NEMO_8K
    unknown = p.choose("a:1", raw, comp)
    assert unknown.choice == COMPRESSED and unknown.link_source == "unknown" and math.isinf(unknown.raw_s)
    p.observe("a:1", raw, raw / 300e9)  # a raw READ over NVLink at 300 GB/s
    learned = p.choose("a:1", raw, comp)
    assert learned.choice == RAW and learned.link_source == "learned"
    assert learned.link_gbps == pytest.approx(2400)
    for _ in range(20):  # the link slows to 100 Gb/s: the EWMA follows it
        p.observe("a:1", comp, comp / 12.5e9)
    assert p.choose("a:1", raw, comp).choice == COMPRESSED
    assert p.link("a:1")[0] == pytest.approx(12.5e9, rel=0.03)  # 0.7**20 of the old rate is left
    assert p.link("b:2") == (0.0, "unknown")  # per peer
    fixed = LinkPolicy(400, H200_RESTORE_GBS)
    fixed.observe("a:1", raw, raw / 300e9)
    assert fixed.link("a:1") == (50e9, "setting")


def test_restore_rate_is_learned_and_a_slow_restore_makes_raw_win():
    p = LinkPolicy(100)
    raw, comp = NEMO_8K
    assert p.choose("x", raw, comp).choice == COMPRESSED  # the GPU guess: 80 GB/s of raw KV restored
    p.observe_restore(raw, 2.0)  # a restore as slow as a CPU's: 0.67 GB/s
    c = p.choose("x", raw, comp)
    assert c.choice == RAW and c.compressed_s > c.raw_s
    assert LinkPolicy(100, gpu=False).restore_rate == pytest.approx(0.04e9)


def test_choices_are_counted_and_logged_once_per_peer_and_change(caplog):
    p = LinkPolicy(100, H200_RESTORE_GBS)
    raw, comp = NEMO_8K
    with caplog.at_level(logging.INFO, logger="dynamo_kvtc.connector.handoff.link_choice"):
        for _ in range(5):
            p.choose("a", raw, comp)
        p.choose("b", raw, comp)
        p.choose("a", 10 * MiB, 9 * MiB)  # a short prompt that hardly compresses: raw
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "a: compressed" in lines[0] and "b: compressed" in lines[1] and "a: raw" in lines[2]
    snap = p.snapshot()
    assert snap["a"]["choices"] == {RAW: 1, COMPRESSED: 5} and snap["b"]["choices"][COMPRESSED] == 1
    assert snap["a"]["last"]["choice"] == RAW and snap["a"]["link_gbps"] == pytest.approx(100)


def test_settings_feed_the_policy_and_bad_values_are_refused():
    from dynamo_kvtc.connector.config import ConnectorConfig

    env = {"DYN_KVTC_LINK_GBPS": "200", "DYN_KVTC_HANDOFF_RESTORE_GBS": "50"}
    p = LinkPolicy.from_config(ConnectorConfig.from_sources(None, env), gpu=True)  # parsed once, at start-up
    assert p.link("z") == (25e9, "setting") and p.restore_rate == pytest.approx(50e9)
    learn = LinkPolicy.from_config(ConnectorConfig.from_sources(None, {}), gpu=False)
    assert learn.link("z") == (0.0, "unknown") and learn.restore_rate == pytest.approx(0.04e9)
    with pytest.raises(ConfigError, match="LINK_GBPS"):
        ConnectorConfig.from_sources(None, {"DYN_KVTC_LINK_GBPS": "-1"})
    with pytest.raises(ConfigError, match="link_gbps=-1 is invalid"):
        ConnectorConfig(link_gbps=-1)
    with pytest.raises(ValueError):
        LinkPolicy(0)


# ---------------------------------------------------------------------------------------------- in the scheduler
NEMO_KV_PER_TOKEN = 40 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16


def _request(params, tokens=8193):
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id="r1", kv_transfer_params=params, prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens
    )


def _remote(side, link=None, mode="policy", monkeypatch=None):
    from dynamo_kvtc.connector.config import ConnectorConfig
    from dynamo_kvtc.connector.vllm.remote_prefill import RemotePrefill

    monkeypatch.setenv("DYN_KVTC_HANDOFF_CHOICE", "compressed")  # the config holds the choice; nothing reads this
    cfg = ConnectorConfig(transfer=side, transfer_port=5555, handoff_choice=mode, transfer_peers="10.0.0.2")
    return RemotePrefill(cfg, "engine-a", 16, lambda: 5555, link=link, kv_bytes_per_token=NEMO_KV_PER_TOKEN)


def _offer(**extra):
    nixl = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
            "remote_engine_id": "prefill-0", "remote_host": "10.0.0.2", "remote_port": 7000}  # fmt: skip
    return {**nixl, "kvtc_host": "10.0.0.2", "kvtc_port": 5555, "kvtc_blocks": 512, **extra}


def test_decode_side_declines_to_nixl_on_nvlink_and_fetches_compressed_on_a_slow_link(monkeypatch):
    fast = _remote("decode", LinkPolicy(2400, H200_RESTORE_GBS), monkeypatch=monkeypatch)
    req = _request(_offer())
    assert fast.applies(req) is False and req.kv_transfer_params["kvtc_choice"] == RAW and fast.declined(req)
    assert req.kv_transfer_params["do_remote_prefill"] is True  # left for NixlConnector to READ raw
    slow = _remote("decode", LinkPolicy(100, H200_RESTORE_GBS), monkeypatch=monkeypatch)
    req = _request(_offer())
    assert slow.applies(req) is True and req.kv_transfer_params["kvtc_choice"] == COMPRESSED
    assert not slow.declined(req)
    assert slow.matched(req, 0) == (512 * 16, True)
    op = slow.load(req, list(range(512)), list(range(512)))
    assert op.remote == ("10.0.0.2", 5555) and req.kv_transfer_params["do_remote_prefill"] is False
    assert slow.link.snapshot()["10.0.0.2:5555"]["choices"] == {RAW: 0, COMPRESSED: 1}  # decided once per request


def test_without_a_raw_offer_or_the_policy_every_offer_is_fetched_compressed(monkeypatch):
    fast = LinkPolicy(2400, H200_RESTORE_GBS)
    only_kvtc = _offer()
    del only_kvtc["remote_block_ids"]
    assert _remote("decode", fast, monkeypatch=monkeypatch).applies(_request(only_kvtc)) is True
    assert _remote("decode", fast, mode="compressed", monkeypatch=monkeypatch).applies(_request(_offer())) is True
    assert _remote("decode", None, monkeypatch=monkeypatch).applies(_request(_offer())) is True


def test_prefill_side_offers_only_its_own_keys_beside_nixl(monkeypatch):
    req = _request({"do_remote_decode": True})
    beside = _remote("prefill", monkeypatch=monkeypatch).handoff_params(req)
    assert beside == {"kvtc_host": "127.0.0.1", "kvtc_port": 5555, "kvtc_blocks": 512}
    alone = _remote("prefill", mode="compressed", monkeypatch=monkeypatch).handoff_params(req)
    assert (
        alone["do_remote_prefill"] is True and alone["remote_engine_id"] == "engine-a" and alone["kvtc_blocks"] == 512
    )


def test_link_estimates_and_choices_are_prometheus_metrics():
    prometheus_client = pytest.importorskip("prometheus_client")
    from dynamo_kvtc.connector.metrics import handoff_families

    p = LinkPolicy(restore_gbs=H200_RESTORE_GBS)
    p.observe("10.0.0.2:5555", NEMO_8K[0], NEMO_8K[0] / 12.5e9)  # 100 Gb/s learned
    p.choose("10.0.0.2:5555", *NEMO_8K)
    p.choose("10.0.0.3:5555", *NEMO_8K)  # nothing known of this peer yet

    class Collector:
        def collect(self):
            yield from handoff_families(p.snapshot())

    reg = prometheus_client.CollectorRegistry()
    reg.register(Collector())
    text = prometheus_client.generate_latest(reg).decode()
    assert 'kvtc_handoff_link_gbps{peer="10.0.0.2:5555"} 100.0' in text
    assert 'kvtc_handoff_choices_total{choice="compressed",peer="10.0.0.2:5555"} 1.0' in text
    assert 'kvtc_handoff_choices_total{choice="raw",peer="10.0.0.2:5555"} 0.0' in text
    raw_s = NEMO_8K[0] / 12.5e9
    line = next(x for x in text.splitlines() if x.startswith('kvtc_handoff_estimate_seconds{path="raw",peer="10.0.0.2'))
    assert float(line.split()[-1]) == pytest.approx(raw_s)
    assert 'kvtc_handoff_estimate_seconds{path="raw",peer="10.0.0.3:5555"} NaN' in text  # unknown link


def test_a_fetchs_work_besides_the_read_counts_against_compressed():
    raw, comp = NEMO_8K
    p = LinkPolicy(400, H200_RESTORE_GBS)
    assert p.choose("x", raw, comp).choice == COMPRESSED  # 27 ms raw vs 2 + 16 ms
    p.observe_staging(comp, 0.030)  # 30 ms of staging and copies per 90 MiB fetch
    c = p.choose("x", raw, comp)
    assert c.compressed_s == pytest.approx(comp / 50e9 + 0.030 + raw / (H200_RESTORE_GBS * 1e9))
    assert c.choice == RAW


def test_scheduler_claims_no_local_prefix_of_a_request_left_to_nixl(monkeypatch):
    """A declined offer (raw over NVLink) must not be claimed from the local tiers either: MultiConnector gives a
    request to the first connector that claims tokens, and NixlConnector is to READ it raw."""
    from dynamo_kvtc.connector.vllm.scheduler import KvtcScheduler

    class Lookup:  # holds every block of every prompt
        asked = 0

        def match(self, hashes):
            self.asked += 1
            return len(hashes), len(hashes)

        def handoff_port(self):
            return 5555

    fast = _remote("decode", LinkPolicy(2400, H200_RESTORE_GBS), monkeypatch=monkeypatch)
    lookup = Lookup()
    sched = KvtcScheduler(fast.cfg, 16, lookup, fast)
    req = _request(_offer(), tokens=1024)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False) and lookup.asked == 0
    plain = _request({}, tokens=1024)  # no offer: the local tiers answer as before
    plain.request_id = "r2"
    assert sched.get_num_new_matched_tokens(plain, 0)[0] > 0 and lookup.asked == 1


def test_the_scheduler_policy_takes_its_link_settings_from_the_config():
    from dynamo_kvtc.connector.config import ConnectorConfig
    from dynamo_kvtc.connector.vllm.remote_prefill import RemotePrefill

    cfg = ConnectorConfig.from_sources(
        {"transfer": "decode"}, {"DYN_KVTC_HANDOFF_CHOICE": "policy", "DYN_KVTC_LINK_GBPS": "100"}
    )
    rp = RemotePrefill(cfg, "engine-a", 16, lambda: None, kv_bytes_per_token=NEMO_KV_PER_TOKEN)
    assert rp.choice_mode == "policy" and rp.link.link("any") == (12.5e9, "setting")
    assert RemotePrefill(ConnectorConfig(transfer="decode"), "e", 16, lambda: None).link is None  # compressed: none
