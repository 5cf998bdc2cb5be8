"""The connector's parts that need no engine: configuration, the lookup channel, layout detection, CPU block order."""

from __future__ import annotations

import os
import uuid

import msgpack
import pytest
import torch

from dynamo_kvtc.connector.config import ConnectorConfig
from dynamo_kvtc.connector.vllm.lookup import LookupClient, LookupServer, socket_path
from dynamo_kvtc.connector.vllm.worker import layer_index
from dynamo_kvtc.errors import ConfigError, TierError, TransferError
from dynamo_kvtc.tiers.layout import PagedKV
from dynamo_kvtc.tiers.layouts import LAYOUTS, detect_layout, layout_class
from dynamo_kvtc.tiers.layouts.cpu import probe_base, probe_cpu_offsets

from . import example_layout  # noqa: F401 - registers the tests' own layout, token_minor


# ---------------------------------------------------------------------------------------------- configuration
def test_extra_config_wins_over_environment_and_maps_to_tiers(tmp_path):
    env = {"DYN_KVTC_CPU_CACHE_GB": "2", "DYN_KVTC_RATIO": "32", "DYN_KVTC_METRICS_PORT": "6881"}
    cfg = ConnectorConfig.from_sources({"ratio": 16, "disk_cache_gb": 0.5, "disk_cache_dir": str(tmp_path)}, env)
    assert cfg.tiers.ratio == 16.0  # extra config beats the variable
    assert cfg.tiers.host_bytes == 2 << 30  # the variable still applies where the extra config is silent
    assert cfg.tiers.disk_bytes == 1 << 29 and cfg.tiers.disk_dir == tmp_path
    assert cfg.metrics_port == 6881 and cfg.publish_events is True and cfg.load_failure_policy == "recompute"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"cpu_cache_gigs": 1}, "unknown kv_connector_extra_config keys"),
        ({"ratio": "fast"}, "ratio='fast' is invalid"),
        ({"cpu_cache_gb": -1}, "must be >= 0"),
        ({"publish_events": "maybe"}, "expected true/false"),
        ({"min_tokens": 1.5}, "expected an integer"),
        ({"transfer": "sideways"}, "transfer must be one of"),
        ({"disk_cache_gb": 1}, r"disk_cache_dir is not .*\(from kv_connector_extra_config.disk_cache_gb\)$"),
        ({"ratio": 32, "max_ratio": 16}, "must be positive and <= max_ratio"),
        ({"metrics_port": 70000}, "not a port number"),
        ({"load_failure_policy": "ignore"}, "load_failure_policy"),
    ],
)
def test_bad_settings_are_refused_by_name(extra, message):
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_sources(extra, {})


def test_bad_environment_variable_names_the_variable():
    with pytest.raises(ConfigError, match="DYN_KVTC_FLUSH_TOKENS='lots'"):
        ConnectorConfig.from_sources({}, {"DYN_KVTC_FLUSH_TOKENS": "lots"})


# ---------------------------------------------------------------------------------------------- lookup channel
def test_lookup_channel_answers_over_a_real_socket_and_rejects_garbage():
    held = {11: "host", 12: "host", 13: "disk"}

    def match(hashes):
        n = n_host = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
            if n_host == n - 1 and held[h] == "host":
                n_host = n
        return n, n_host

    class Worker:  # what the lookup server reads: the worker's match and its hand-off port
        def match(self, hashes):
            return match(hashes)

        def handoff_port(self):
            return 45678

    engine = f"test-{uuid.uuid4()}"
    server = LookupServer(engine, Worker())
    client = LookupClient(engine, timeout_s=2)
    try:
        assert client.match([11, 12, 13, 99]) == (3, 2)
        assert client.match([99, 11]) == (0, 0)
        assert client.match([2**64 - 1]) == (0, 0)  # full unsigned range crosses msgpack intact
        assert client.handoff_port() == 45678
        import zmq

        raw = zmq.Context.instance().socket(zmq.REQ)
        raw.setsockopt(zmq.RCVTIMEO, 2000)
        raw.connect(f"ipc://{socket_path(engine)}")
        for bad in (b"\xc1not msgpack", msgpack.packb([1, 2]), msgpack.packb({"op": "match", "hashes": [-1]})):
            raw.send(bad)
            assert "error" in msgpack.unpackb(raw.recv())
        raw.close(0)
        assert client.match([11]) == (1, 1)  # the server survived the garbage
    finally:
        client.close()
        server.close()


def test_lookup_without_a_worker_times_out_as_an_error():
    client = LookupClient(f"nobody-{uuid.uuid4()}", timeout_s=0.3)
    with pytest.raises(TransferError, match="lookup .* did not answer"):
        client.match([1, 2, 3])
    client.close()


# ---------------------------------------------------------------------------------------------- layouts
def test_layer_names_and_layout_detection():
    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(TierError, match="layer index"):
        layer_index("lm_head")
    assert detect_layout(torch.zeros(10, 3, 32, 128), 10) == "cpu"
    assert detect_layout(torch.zeros(2, 10, 32, 3, 64), 10) == "flash"
    assert detect_layout(torch.zeros(10, 2, 32, 3, 64), 10) == "flashinfer"
    assert detect_layout(torch.zeros(2, 2, 32, 3, 64), 2) == "flashinfer"  # two blocks: the block count decides
    assert detect_layout(torch.zeros(2, 2, 32, 3, 64), None) == "flashinfer"
    assert detect_layout(torch.zeros(2, 10, 32, 3, 64), None) == "flash"
    with pytest.raises(TierError, match="unsupported KV cache layout"):
        detect_layout(torch.zeros(10, 32, 576), 10)  # MLA-style latent cache
    assert detect_layout(torch.zeros(10, 32, 576), 10, mla=True) == "mla"
    with pytest.raises(ConfigError, match="unknown KV layout"):
        layout_class("nchw")


def test_cpu_layout_with_the_kernel_element_order():
    """vLLM's AVX2 CPU kernel stores a block's K half transposed ([D, block]); offsets describe it exactly."""
    L, nb, H, bs, D = 2, 6, 3, 4, 8
    caches = [torch.zeros(nb, H, bs, 2 * D) for _ in range(L)]
    k_order = torch.arange(bs * D).view(bs, D).t().reshape(-1)  # physical position p holds logical k_order[p]
    k_off = torch.empty_like(k_order)
    k_off[k_order] = torch.arange(bs * D)
    kv = PagedKV(caches, "cpu", bs, k_offsets=k_off)
    k, v = torch.randn(L, 2 * bs, H, D), torch.randn(L, 2 * bs, H, D)
    for layer in range(L):
        kv.scatter_layer(layer, [4, 1], k[layer], v[layer])
    k2, v2 = kv.gather([4, 1])
    assert torch.equal(k2, k) and torch.equal(v2, v)
    slab = caches[0][4, 2].view(2 * bs * D)  # block 4 (the first written), head 2
    assert torch.equal(slab[: bs * D].view(D, bs), k[0, :bs, 2].t())  # K transposed
    assert torch.equal(slab[bs * D :].view(bs, D), v[0, :bs, 2])  # V row-major
    with pytest.raises(ConfigError, match="permutation"):
        PagedKV(caches, "cpu", bs, k_offsets=torch.zeros(bs * D, dtype=torch.int64))


@pytest.mark.parametrize("H,bs,D", [(3, 32, 64), (1, 32, 256), (2, 16, 128)])
def test_probe_learns_the_kernel_element_order_for_every_head_size(H, bs, D):
    """vLLM's own CPU cache kernel writes random K/V into a paged cache; the probed offsets read them back exactly,
    head_dim 256 (Gemma-3) included: read as the plain layout, its keys would come out transposed per block."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache = torch.zeros(3, H, bs, 2 * D, dtype=torch.bfloat16)
    offsets = probe_cpu_offsets(cache, bs)
    assert offsets is not None
    k = torch.randn(2 * bs, H, D).to(torch.bfloat16)
    v = torch.randn(2 * bs, H, D).to(torch.bfloat16)
    kc, vc = cache.view(3, H, 2 * bs, D).chunk(2, dim=2)
    slots = torch.cat([torch.arange(2 * bs, 3 * bs), torch.arange(0, bs)])  # blocks 2, then 0
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, _get_attn_isa(torch.bfloat16, bs, D, "auto"))
    got_k, got_v = PagedKV([cache], "cpu", bs, k_offsets=offsets[0], v_offsets=offsets[1]).gather([2, 0])
    assert torch.equal(got_k[0], k) and torch.equal(got_v[0], v)


# ---------------------------------------------------------------------------------------------- the FP8 probe
def test_probe_digits_are_the_ones_each_cache_dtype_holds_exactly():
    """float8_e5m2 has two mantissa bits: 9 rounds to 8, so its probe counts in base 8 (base 16 would read token 9 as
    token 8 and refuse the cache as no permutation); bf16, fp16 and e4m3 hold 1..16 exactly."""
    assert [probe_base(d) for d in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)] == [16, 16, 16]
    assert probe_base(torch.float8_e5m2) == 8
    assert torch.tensor(9.0).to(torch.float8_e5m2).float() == 8.0  # why


def _fp8_writer(fmt: torch.dtype, bs: int, D: int):
    """vLLM's FP8 cache write as far as this AVX2 machine runs it: the real CPU kernel's element order (its bf16
    path: the FP8 path refuses to run without AVX-512/AMX), then each value cast to ``fmt`` at scale 1 into the uint8
    cache, as vLLM's FP8 path stores it."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from dynamo_kvtc.codec import fp8

    isa = _get_attn_isa(torch.bfloat16, bs, D, "auto")

    def write(key, value, key_cache, value_cache, slots):
        assert key_cache.dtype == value_cache.dtype == torch.uint8  # what vLLM's FP8 path requires
        nb, H = key_cache.shape[:2]
        tk, tv = torch.zeros(nb, H, 2 * bs, D, dtype=torch.bfloat16).chunk(2, dim=2)  # as vLLM views its cache
        ops.cpu_attn_reshape_and_cache(key, value, tk, tv, slots, isa)
        written = torch.unique(slots // bs)
        key_cache[written] = fp8.quantize(tk[written], fmt, 1.0, torch.uint8)
        value_cache[written] = fp8.quantize(tv[written], fmt, 1.0, torch.uint8)

    return write


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_probe_reads_an_fp8_cache_through_its_cast(cache_dtype):
    """The probe's digits go through the FP8 cast and come back exact: it learns the kernel's element order of a
    uint8 FP8 cache (the same as the bf16 probe's for the same kernel), and a paged FP8 cache written through that
    kernel gathers back as the FP8-rounded values."""
    pytest.importorskip("vllm")
    from dynamo_kvtc.codec import fp8

    fmt = fp8.kv_format(cache_dtype)
    H, bs, D = 2, 32, 64
    write = _fp8_writer(fmt, bs, D)
    cache = torch.zeros(3, H, bs, 2 * D, dtype=torch.uint8)
    offsets = probe_cpu_offsets(cache, bs, cache_dtype, model_dtype=torch.bfloat16, write=write)
    plain = probe_cpu_offsets(torch.zeros(1, H, bs, 2 * D, dtype=torch.bfloat16), bs)
    assert torch.equal(offsets[0], plain[0]) and torch.equal(offsets[1], plain[1])
    assert not torch.equal(offsets[0], torch.arange(bs * D))  # this kernel's K half is not the plain order
    k = torch.randn(2 * bs, H, D).to(torch.bfloat16)
    v = torch.randn(2 * bs, H, D).to(torch.bfloat16)
    kc, vc = cache.view(3, H, 2 * bs, D).chunk(2, dim=2)
    write(k, v, kc, vc, torch.cat([torch.arange(2 * bs, 3 * bs), torch.arange(0, bs)]))  # blocks 2, then 0
    kv = PagedKV([cache], "cpu", bs, k_offsets=offsets[0], v_offsets=offsets[1], cache_dtype=cache_dtype)
    got_k, got_v = kv.gather([2, 0])
    assert torch.equal(got_k[0], fp8.round_fp8(k, fmt, 1.0)) and torch.equal(got_v[0], fp8.round_fp8(v, fmt, 1.0))


def test_probe_through_vllms_own_fp8_cache_kernel():
    """Where vLLM's CPU backend runs FP8 KV caches (x86 with AVX-512 or AMX), its own FP8 write kernel is probed."""
    pytest.importorskip("vllm")
    from .conftest import cpu_avx512

    H, bs, D = 2, 32, 64
    cache = torch.zeros(3, H, bs, 2 * D, dtype=torch.uint8)
    if not cpu_avx512():
        with pytest.raises(NotImplementedError, match="AVX-512"):  # the connector then refuses the cache, by reason
            probe_cpu_offsets(cache, bs, "fp8", model_dtype=torch.bfloat16)
        pytest.skip("AVX2 CPU: vLLM's CPU cache-write kernel has no FP8 path without AVX-512/AMX")
    offsets = probe_cpu_offsets(cache, bs, "fp8", model_dtype=torch.bfloat16)
    assert offsets is not None and all(torch.equal(torch.sort(o).values, torch.arange(bs * D)) for o in offsets)


# ---------------------------------------------------------------------------------------------- every layout
def _engine_caches(name: str, L: int, nb: int, bs: int, H: int, D: int):
    """Zeroed engine caches of ``L`` layers in layout ``name``: a block-major tensor of pages per layer, unless the
    layout's engine tensor is another shape."""
    if name == "flash":
        return [torch.zeros(2, nb, bs, H, D) for _ in range(L)]
    if name == "trtllm":
        return torch.zeros(nb, L, 2, H, bs, D)
    form = layout_class(name)(bs, H if name != "mla" else 1, D)
    return [torch.zeros(nb, *form.page_shape) for _ in range(L)]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_registered_layout_round_trips(name):
    """The same checks for every registered layout, the tests' own ``token_minor`` included: scatter then gather
    gives the values back bit for bit, every element of the written blocks was written (no overlap, no hole), page
    is the exact inverse of unpage, and in-place views address the cache's own memory."""
    L, nb, bs, D = 2, 6, 4, 8
    H = 1 if name == "mla" else 3
    caches = _engine_caches(name, L, nb, bs, H, D)
    kv = PagedKV(caches, name, bs)
    assert (kv.num_layers, kv.num_blocks, kv.block_size, kv.num_heads, kv.head_dim) == (L, nb, bs, H, D)
    k, v = torch.randn(L, 2 * bs, H, D), torch.randn(L, 2 * bs, H, D)
    for layer in range(L):
        kv.scatter_layer(layer, [4, 1], k[layer], v[layer])
    k2, v2 = kv.gather([4, 1])
    assert torch.equal(k2, k) and torch.equal(v2, v)
    written = sum(int((c != 0).sum()) for c in kv.caches)
    assert written == 2 * k.numel()  # K and V landed on distinct elements (randn has no zeros)
    assert torch.equal(kv.gather([0])[0], torch.zeros(L, bs, H, D))  # other blocks untouched
    form = kv.form
    if form.has_pages():
        pages = torch.randn(5, *form.page_shape)
        assert torch.equal(form.page(*form.unpage(pages)), pages)
    if form.in_place:
        vk, _ = kv.layer_views(0)
        assert vk.untyped_storage().data_ptr() == kv.caches[0].untyped_storage().data_ptr()
        assert torch.equal(vk[4], k[0, :bs])


# ---------------------------------------------------------------------------------------------- services
def test_worker_services_start_what_the_config_asks_and_stop_all(caplog):
    import urllib.error
    import urllib.request
    from collections import Counter

    from dynamo_kvtc.connector.vllm.services import WorkerServices

    class Worker:  # what the lookup channel and the metrics read of a worker
        stats: Counter = Counter()
        disabled, disabled_reason, restores = "off", "calibration", []

        def match(self, hashes):
            return 0, 0

        def handoff_port(self):
            return None

    stats: Counter = Counter()
    engine = f"svc-{uuid.uuid4().hex[:8]}"
    svc = WorkerServices(ConnectorConfig(metrics_port=0, transfer="prefill"), engine, stats)
    with caplog.at_level("INFO", logger="dynamo_kvtc.connector.vllm.services"):
        svc.start(Worker(), None)  # a disabled worker: no store, so no hand-off server
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "lookup channel on ipc://" in lines[0] and "metrics on 127.0.0.1:" in lines[1]
    assert svc.handoff is None and svc.handoff_port is None and svc.metrics_port
    client = LookupClient(engine)
    assert client.match([1, 2]) == (0, 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10) as r:
        assert b"kvtc_enabled" in r.read()
    lookup = svc.lookup
    svc.start(Worker(), None)  # nothing runs twice
    assert svc.lookup is lookup
    svc.stop()
    svc.stop()  # idempotent
    assert svc.lookup is None and not os.path.exists(socket_path(engine))
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=2)
    client.close()


def test_a_handoff_server_that_cannot_start_is_counted_not_raised(caplog):
    from collections import Counter

    from dynamo_kvtc.connector.vllm.services import WorkerServices

    stats: Counter = Counter()
    cfg = ConnectorConfig(transfer="prefill", transfer_host="256.0.0.1", nixl_backend="NO_SUCH_BACKEND")
    svc = WorkerServices(cfg, f"svc-{uuid.uuid4().hex[:8]}", stats)
    with caplog.at_level("ERROR", logger="dynamo_kvtc.connector.vllm.services"):
        svc.start(None, object())  # a prefill engine whose store exists but whose server cannot start
    try:
        assert svc.handoff is None and stats["fallback_transfer_setup"] == 1
        assert "hand-off unavailable" in caplog.records[-1].getMessage()
    finally:
        svc.stop()
