"""Issue 13's connector contracts that need no engine: TP sizing, the host-memory warning, FP8 refused at start-up,
metrics of a disabled worker, the failure policy (set on the engine's config alone; inside MultiConnector the worker
restores nothing unless the top-level config recomputes), vLLM's stats round trip.
"""

from __future__ import annotations

import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dynamo_kvtc.connector.config import ConnectorConfig
from dynamo_kvtc.connector.host_memory import host_memory_limit, host_memory_warning
from dynamo_kvtc.connector.vllm.worker import KvtcWorker, rank_tiers
from dynamo_kvtc.tiers.config import TierConfig

GiB = 1 << 30


# ---------------------------------------------------------------------------------------------- TP sizing
def test_sizes_are_totals_across_the_tp_group(tmp_path):
    tiers = TierConfig(host_bytes=8 * GiB, disk_bytes=64 * GiB, disk_dir=tmp_path)
    assert rank_tiers(tiers, 0, 1) == tiers  # one rank: the whole size, the directory as given
    for rank in range(4):
        r = rank_tiers(tiers, rank, 4)
        assert r.host_bytes == 2 * GiB and r.disk_bytes == 16 * GiB
        assert r.disk_dir == tmp_path / f"rank{rank}"  # each rank its own head shard
    r = rank_tiers(TierConfig(host_bytes=3 * GiB + 1), 7, 8)
    assert r.host_bytes == (3 * GiB + 1) // 8 and r.disk_bytes == 0 and r.disk_dir is None
    assert sum(rank_tiers(tiers, i, 3).host_bytes for i in range(3)) <= tiers.host_bytes  # never more than asked


def test_host_memory_limit_reads_this_machine():
    limit = host_memory_limit()  # the real /proc and /sys of this machine or pod
    assert limit is not None
    nbytes, where = limit
    assert nbytes > 64 << 20 and where.startswith("/")
    assert host_memory_warning(1 << 20, limit) is None  # 1 MiB always fits
    msg = host_memory_warning(nbytes + GiB, limit)
    assert msg is not None and "cpu_cache_gb" in msg and where in msg and "TP group" in msg


def _root(tmp_path: Path, memory_max: str | None, meminfo_kb: int = 16 << 20) -> Path:
    (tmp_path / "proc").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal:       {meminfo_kb} kB\nMemFree:  1 kB\n")
    if memory_max is not None:
        (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
        (tmp_path / "sys/fs/cgroup/memory.max").write_text(memory_max + "\n")
    return tmp_path


def test_host_memory_limit_prefers_the_pod_limit(tmp_path):
    assert host_memory_limit(_root(tmp_path / "a", str(4 * GiB))) == (4 * GiB, "/sys/fs/cgroup/memory.max")
    # "max" (no pod limit) and no cgroup at all fall back to the machine's MemTotal
    assert host_memory_limit(_root(tmp_path / "b", "max")) == (16 * GiB, "/proc/meminfo MemTotal")
    assert host_memory_limit(_root(tmp_path / "c", None)) == (16 * GiB, "/proc/meminfo MemTotal")
    assert host_memory_limit(tmp_path / "nothing") is None
    pod = host_memory_limit(_root(tmp_path / "d", str(4 * GiB)))
    assert host_memory_warning(8 * GiB, pod) is not None and host_memory_warning(2 * GiB, pod) is None
    assert host_memory_warning(8 * GiB, None) is None  # nothing known: no warning


# ---------------------------------------------------------------------------------------------- 8-bit caches refused
def _fp8_cpu_caches(dtype: torch.dtype, layers: int = 2, blocks: int = 8, heads: int = 3, bs: int = 32, hd: int = 64):
    """What vLLM's CPU backend allocates with --kv-cache-dtype fp8 (uint8 storage; GPU backends use float8 dtypes):
    per layer [blocks, heads, bs, 2*head_dim]."""
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(blocks, heads, bs, 2 * hd, dtype=dtype) for i in range(layers)
    }


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("kvtc_")}


@pytest.mark.parametrize(
    "cache_dtype, storage",
    [("fp8_per_token_head", torch.uint8), ("fp8_inc", torch.float8_e4m3fn), ("auto", torch.uint8)],
)
def test_unreadable_8bit_kv_cache_is_refused_at_start_up_and_metrics_still_served(cache_dtype, storage, caplog):
    cfg = ConnectorConfig.from_sources({"metrics_port": 0}, env={})
    w = KvtcWorker(
        cfg, engine_id=f"t-{uuid.uuid4().hex[:8]}", model="m", hf_config=None, block_size=32, kv_cache_dtype=cache_dtype
    )
    try:
        with caplog.at_level("WARNING", logger="dynamo_kvtc"):
            w.register_kv_caches(_fp8_cpu_caches(storage))  # an 8-bit cache: refused even when the flag says "auto"
        assert w.store is None and w.disabled_reason == "kv_cache_dtype"
        assert "not supported" in w.disabled and cache_dtype in w.disabled
        # a runtime limitation (the start-up rule): served without the tier, one WARNING line, nothing worse
        errors = [r for r in caplog.records if r.levelno >= 30]
        assert len(errors) == 1 and errors[0].levelname == "WARNING" and "kv_cache_dtype" in errors[0].getMessage()
        assert w.match([1, 2, 3]) == (0, 0)  # every lookup a miss: every request recomputes
        m = _scrape(w.metrics_port)  # a disabled worker still serves its metrics
        assert m['kvtc_enabled{reason="kv_cache_dtype"}'] == 0.0
        assert m['kvtc_fallbacks_total{reason="disabled"}'] == 1.0
        assert m["kvtc_lookup_tokens_total"] == 0.0 and "kvtc_tier_blocks" not in str(m)
    finally:
        w.shutdown()


def test_16bit_caches_pass_the_dtype_check():
    from dynamo_kvtc.connector.vllm.worker import check_kv_dtype
    from dynamo_kvtc.errors import TierError

    for dt in (torch.bfloat16, torch.float16, torch.float32):
        check_kv_dtype(torch.zeros(2, 2, dtype=dt), "auto")
    for name, dt in (("fp8", torch.uint8), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        check_kv_dtype(torch.zeros(2, 2, dtype=dt), name)  # FP8 caches are read through their scales
    with pytest.raises(TierError, match="not supported"):
        check_kv_dtype(torch.zeros(2, 2, dtype=torch.bfloat16), "fp8_e5m2")  # flag and tensors disagree
    with pytest.raises(TierError, match="not supported"):
        check_kv_dtype(torch.zeros(2, 2, dtype=torch.uint8), "int8_per_token_head")
    with pytest.raises(TierError, match="not supported"):
        check_kv_dtype(torch.zeros(2, 2, dtype=torch.uint8), "auto")


# ---------------------------------------------------------------------------------------------- vLLM's stats
def _worker_with_counts() -> KvtcWorker:
    cfg = ConnectorConfig.from_sources({}, env={})
    w = KvtcWorker(cfg, engine_id=f"t-{uuid.uuid4().hex[:8]}", model="m", hf_config=None, block_size=32)
    w.stats.update({"lookup_tokens": 1000, "hit_tokens": 640, "fallback_load_error": 2})
    return w


def test_stats_round_trip_through_vllms_connector_stats():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector, MultiKVConnectorStats

    from dynamo_kvtc.connector.vllm import KvtcConnector
    from dynamo_kvtc.connector.vllm.stats import KvtcConnectorStats, StatsReporter

    w = _worker_with_counts()
    rep = StatsReporter(w)
    first = rep.take()
    assert isinstance(first, KvtcConnectorStats)
    assert first.data["counters"]["lookup_tokens"] == 1000 and first.data["counters"]["fallbacks:load_error"] == 2
    assert first.data["gauges"] == {"enabled": 1.0}
    assert rep.take() is None  # nothing new: vLLM sends no connector output for the step
    w.stats["lookup_tokens"] += 200
    second = rep.take()
    assert second.data["counters"] == {"lookup_tokens": 200.0}  # deltas, not totals
    # what crosses processes is to_dict(); the front end rebuilds it through the class (alone, or by name in Multi)
    rebuilt = KvtcConnector.build_kv_connector_stats(first.to_dict())
    total = rebuilt.aggregate(KvtcConnector.build_kv_connector_stats(second.to_dict()))
    r = total.reduce()
    assert r["lookup_tokens"] == 1200 and r["matched_tokens"] == 640 and r["fallbacks_load_error"] == 2
    assert r["hit_rate"] == round(640 / 1200, 4) and r["enabled"] == 1.0
    multi = MultiConnector.build_kv_connector_stats({"KvtcConnector": second.to_dict()})
    assert isinstance(multi, MultiKVConnectorStats) and isinstance(multi["KvtcConnector"], KvtcConnectorStats)
    assert multi.reduce() == {"KvtcConnector": second.reduce()}
    empty = KvtcConnector.build_kv_connector_stats()
    assert empty.is_empty() and not total.is_empty()
    total.reset()
    assert total.is_empty()


def test_stats_reach_vllm_prometheus_series():
    pytest.importorskip("vllm")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from dynamo_kvtc.connector.vllm import KvtcConnector
    from dynamo_kvtc.connector.vllm.stats import StatsReporter

    reg = CollectorRegistry()  # vLLM passes its metric classes; these register on a registry of the test's own

    def bound(cls):
        return lambda *a, **kw: cls(*a, registry=reg, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    engine = SimpleNamespace(kv_transfer_config=None)  # the only part of the VllmConfig the base class reads
    prom = KvtcConnector.build_prom_metrics(engine, types, ["model_name", "engine"], {0: ["smol", "0"]})
    w = _worker_with_counts()
    prom.observe(StatsReporter(w).take().to_dict(), engine_idx=0)
    text = generate_latest(reg).decode()
    assert 'vllm:kvtc_lookup_tokens_total{engine="0",model_name="smol"} 1000.0' in text
    assert 'vllm:kvtc_matched_tokens_total{engine="0",model_name="smol"} 640.0' in text
    assert 'vllm:kvtc_fallbacks_total{engine="0",model_name="smol",reason="load_error"} 2.0' in text
    assert 'vllm:kvtc_enabled{engine="0",model_name="smol"} 1.0' in text


# ---------------------------------------------------------------------------------------------- failure policy
def _vllm_config(top: dict, engine: bool = True):
    """A real VllmConfig of SmolLM2 (its local config) with the --kv-transfer-config ``top``."""
    from vllm.config import KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    from dynamo_kvtc.calibration.models import resolve_model

    model = ModelConfig(model=str(resolve_model("smollm2-135m-instruct")))
    sched = SchedulerConfig(max_model_len=2048, is_encoder_decoder=False, disable_hybrid_kv_cache_manager=True)
    return VllmConfig(model_config=model, kv_transfer_config=KVTransferConfig(**top), scheduler_config=sched)


KVTC = {"kv_connector": "KvtcConnector", "kv_connector_module_path": "dynamo_kvtc.connector.vllm", "kv_role": "kv_both"}


def _multi(policy: str | None, tmp_path: Path) -> dict:
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")}}  # fmt: skip
    kvtc = {**KVTC, "kv_connector_extra_config": {"cpu_cache_gb": 0.01, "metrics_port": 0}}
    top = {"kv_connector": "MultiConnector", "kv_role": "kv_both"}
    top["kv_connector_extra_config"] = {"connectors": [kvtc, example]}
    return top | ({"kv_load_failure_policy": policy} if policy else {})


def test_failure_policy_is_set_on_the_engine_config_when_alone():
    """Alone, the config the connector is given is the engine's: its scheduler half sets recompute there, which
    is what vLLM's scheduler reads right after building the connector."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from dynamo_kvtc.connector.vllm import KvtcConnector

    vc = _vllm_config({**KVTC, "kv_connector_extra_config": {"cpu_cache_gb": 0.01}})
    assert vc.kv_transfer_config.kv_load_failure_policy == "fail"  # vLLM's default: a failed load fails the request
    c = KvtcConnector(vc, KVConnectorRole.SCHEDULER)
    try:
        assert vc.kv_transfer_config.kv_load_failure_policy == "recompute" and c.refuse_loads is False
    finally:
        c.shutdown()


@pytest.mark.parametrize("top_policy", [None, "recompute"])
def test_inside_multiconnector_the_top_level_policy_decides_whether_the_worker_restores(top_policy, tmp_path, caplog):
    """Inside vLLM's MultiConnector (beside ExampleConnector) the child's config is a copy vLLM's scheduler never
    reads. The worker half reads the engine's top-level config (vLLM's current config while it builds the workers'
    connectors) and, when its policy would fail a request on a failed restore, disables itself with one line naming
    the setting: every lookup a miss, so nothing is ever loaded. With recompute at the top level it serves."""
    pytest.importorskip("vllm")
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from dynamo_kvtc.calibration.catalog import find_calibration

    vc = _vllm_config(_multi(top_policy, tmp_path))
    with set_current_vllm_config(vc):  # as vLLM's worker does while it builds the connectors
        multi = MultiConnector(vc, KVConnectorRole.WORKER, None)
    child = next(c for c in multi._connectors if getattr(c, "worker", None) is not None)
    w = child.worker
    cal = find_calibration("smollm2-135m-instruct")
    w.cfg = ConnectorConfig.from_sources({"calibration": str(cal), "cpu_cache_gb": 0.01, "metrics_port": 0}, env={})
    bs = child.block_size  # CPU layout [blocks, KV heads, block size, 2 x head_dim]
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(8, 3, bs, 128, dtype=torch.bfloat16) for i in range(30)}
    try:
        with caplog.at_level("WARNING", logger="dynamo_kvtc.connector.vllm.worker"):
            w.register_kv_caches(caches)
        assert vc.kv_transfer_config.kv_load_failure_policy == (top_policy or "fail")  # the wrapper's, untouched
        if top_policy is None:
            assert w.store is None and w.disabled_reason == "failure_policy"
            errors = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "disabled" in r.msg]
            assert len(errors) == 1 and "MultiConnector" in errors[0] and "kv_load_failure_policy" in errors[0]
            assert "'fail'" in errors[0] and "top level" in errors[0]
            assert w.match([1, 2, 3]) == (0, 0)  # every lookup a miss: vLLM never plans a load that could fail
        else:
            assert w.disabled is None, w.disabled
            assert w.store is not None
    finally:
        multi.shutdown()


def test_failure_policy_that_cannot_be_set_is_reported():
    pytest.importorskip("vllm")
    from dynamo_kvtc.connector.vllm.connector import failure_policy_refusal, set_failure_policy

    class Frozen:  # a config that refuses changes (a frozen dataclass would)
        kv_connector = "KvtcConnector"
        kv_load_failure_policy = "fail"

        def __setattr__(self, name, value):
            raise AttributeError("frozen")

    assert set_failure_policy(Frozen(), "recompute") is False  # the scheduler half then restores nothing
    own = SimpleNamespace(kv_connector="KvtcConnector", kv_load_failure_policy="fail")
    assert set_failure_policy(own, "recompute") is True and own.kv_load_failure_policy == "recompute"
    assert failure_policy_refusal(own, own, "recompute") is None  # alone: the scheduler half set it
    assert failure_policy_refusal(own, None, "recompute") is None  # vLLM does not say: warned, served
    wrapper = SimpleNamespace(kv_connector="PdConnector", kv_load_failure_policy="fail")
    assert "PdConnector" in failure_policy_refusal(own, wrapper, "recompute")
    assert failure_policy_refusal(own, wrapper, "fail") is None  # load_failure_policy fail: the operator's choice
