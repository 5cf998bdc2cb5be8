"""The start-up rule, the same for the three ways in (connector/startup.py, docs/configuration.md): invalid
configuration stops the engine with ONE ConfigError line naming the key as the operator set it; a runtime limitation
of the machine or model serves without the tier with one WARNING line and ``kvtc_enabled{reason}`` 0.

Every case runs through each way in's real start-up, called directly with real objects (no engine start):
KvtcConnector's worker (``ConnectorConfig.from_sources`` and ``KvtcWorker.register_kv_caches`` over zero KV caches of
the model's shape), the vLLM ``kvtc`` tier (vLLM's own ``TieringOffloadingSpec`` manager building the tier through
its secondary-tier factory from vLLM's ``OffloadingConfig`` objects, the served model's config read by vLLM's reader)
and the LMCache serde (``SerdeOptions.from_kwargs`` and ``KvtcChunkCoder``). Models: SmolLM2 (the shipped
calibration) and a Qwen2-shaped model of a shape the project does not ship (6 layers, 2 KV heads, head_dim 64,
rope_theta 1e4; its config only: start-up reads no weights), with calibrations made for rope_theta 1e6 and for 8
layers.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from dynamo_kvtc import settings  # noqa: E402
from dynamo_kvtc.calibration.artifact import Calibration  # noqa: E402
from dynamo_kvtc.calibration.catalog import find_calibration  # noqa: E402
from dynamo_kvtc.calibration.models import fingerprint_of  # noqa: E402
from dynamo_kvtc.calibration.synthetic import synthetic_calibration  # noqa: E402
from dynamo_kvtc.calibration.verdict import CHECK_FILE  # noqa: E402
from dynamo_kvtc.connector.config import ConnectorConfig, from_environment  # noqa: E402
from dynamo_kvtc.connector.lmcache.serde import KvtcChunkCoder, SerdeOptions  # noqa: E402
from dynamo_kvtc.connector.offloading.tier import served_config  # noqa: E402
from dynamo_kvtc.connector.vllm.worker import KvtcWorker  # noqa: E402
from dynamo_kvtc.errors import ConfigError, KvtcError  # noqa: E402

from .offload_config import tiering_manager  # noqa: E402

SMOL = "smollm2-135m-instruct"
BS, BPC, CHUNKS = 32, 2, 6  # the tier's primary chunks: 2 blocks of 32 tokens, 6 slots


@dataclass(frozen=True)
class Model:
    name: str  # what the engine was given (a hub name or a directory)
    hf: Any  # its config, as vLLM reads it
    layers: int
    heads: int
    head_dim: int


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The two models and their calibrations: SmolLM2's shipped one (and a copy without its verdict), the new
    shape's made for rope_theta 1e6 (the model has 1e4) and for 8 layers (the model has 6)."""
    from transformers import Qwen2Config

    tmp = tmp_path_factory.mktemp("startup")
    smol_cal = find_calibration(SMOL)
    bare = tmp / "smol-no-verdict"  # the shipped calibration without check.json: `ratio: auto` cannot resolve
    shutil.copytree(smol_cal, bare, ignore=shutil.ignore_patterns(CHECK_FILE), copy_function=os.symlink)
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=4096, architectures=["Qwen2ForCausalLM"])  # fmt: skip
    Qwen2Config(num_hidden_layers=6, rope_theta=1e4, **shape).save_pretrained(tmp / "MyModel-6L")
    groups6 = synthetic_calibration(6, 2, 64, ratios=(16,), rank=128, dp_rows=512).groups
    groups8 = synthetic_calibration(8, 2, 64, ratios=(16,), rank=128, dp_rows=512).groups
    Calibration(fingerprint_of(Qwen2Config(num_hidden_layers=6, rope_theta=1e6, **shape)), groups6).save(tmp / "t1e6")
    Calibration(fingerprint_of(Qwen2Config(num_hidden_layers=8, rope_theta=1e4, **shape)), groups8).save(tmp / "l8")
    mine = str(tmp / "MyModel-6L")
    return {
        "tmp": tmp,
        "smol": Model(SMOL, served_config(SMOL), 30, 3, 64),
        "mine": Model(mine, served_config(mine), 6, 2, 64),
        "cals": {"smol": str(smol_cal), "bare": str(bare), "t1e6": str(tmp / "t1e6"), "l8": str(tmp / "l8")},
    }


# ---------------------------------------------------------------------------------------------- the three ways in
def start_connector(model: Model, extra: dict, env: dict | None = None) -> KvtcWorker:
    """KvtcConnector's start-up: its settings (``kv_connector_extra_config`` wins over ``DYN_KVTC_*``), which of
    them the environment set (as KvtcConnector computes it), then the worker's ``register_kv_caches``."""
    env = env or {}
    cfg = ConnectorConfig.from_sources(extra, env=env)
    w = KvtcWorker(cfg, engine_id=f"t-{uuid.uuid4().hex[:8]}", model=model.name, hf_config=model.hf, block_size=16,
                   num_blocks=4, from_env=from_environment(extra, env))  # fmt: skip
    shape = (2, 4, 16, model.heads, model.head_dim)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.bfloat16) for i in range(model.layers)}
    try:
        w.register_kv_caches(caches)
    except BaseException:
        w.shutdown()
        raise
    return w


def start_tier(model: Model, options: dict):
    """The ``kvtc`` tier's start-up: vLLM's TieringOffloadingSpec manager builds it through vLLM's secondary-tier
    factory from an ``OffloadingConfig`` of the served model (vLLM's classes, as the engine fills them)."""
    kv_bytes = model.layers * BPC * BS * model.heads * model.head_dim * 2 * 2  # a chunk's K and V in bf16
    tier = {"type": "kvtc", "page_layout": "nhd", **options}
    return tiering_manager(model.name, model.layers, kv_bytes, tier, bs=BS, bpc=BPC, chunks=CHUNKS, engine="rule")[1]


def start_serde(model: Model, options: dict) -> KvtcChunkCoder:
    """The LMCache serde's start-up (LMCache's factory calls exactly this, :func:`serde.build`)."""
    return KvtcChunkCoder(SerdeOptions.from_kwargs(options))


def start(way: str, model: Model, options: dict, env: dict | None = None) -> Any:
    if way == "extra":
        return start_connector(model, options, env)
    if way == "vllm_tier":
        return start_tier(model, {"cpu_cache_gb": 0.05, **options})
    return start_serde(model, options)


def stop(way: str, started: Any) -> None:
    if way == "extra":
        started.shutdown()
    elif way == "vllm_tier":
        started.shutdown()


# ---------------------------------------------------------------------------------------------- invalid configuration
def _gw(tmp: Path) -> str:
    d = tmp / f"shared-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    d.chmod(0o775)
    return str(d)


# (name, key, the way in's options (placeholders: {smol} {bare} {t1e6} {l8} {gw} {tmp}), model, ways, what the line
# says). Every way in that reads the key is run; the serde has no cache sizes and no model to check against.
STORE_WAYS = ("extra", "vllm_tier")
ALL = ("extra", "vllm_tier", "lmcache_serde")
INVALID = [
    ("ratio-no-plan", "ratio", {"calibration": "{smol}", "ratio": 7}, "smol", ALL, "7 has no plan in calibration"),
    ("ratio-auto-no-verdict", "ratio", {"calibration": "{bare}", "ratio": "auto"}, "smol", ALL, "dynamo-kvtc check"),
    ("ratio-wrong-type", "ratio", {"calibration": "{smol}", "ratio": "abc"}, "smol", ALL, "='abc' is invalid"),
    ("cache-negative", "cpu_cache_gb", {"calibration": "{smol}", "cpu_cache_gb": -1}, "smol", STORE_WAYS, ">= 0"),
    ("cache-no-op", "cpu_cache_gb", {"calibration": "{smol}", "cpu_cache_gb": 0}, "smol", STORE_WAYS, "> 0"),
    ("disk-proc", "disk_cache_dir", {"calibration": "{smol}", "disk_cache_gb": 0.01, "disk_cache_dir": "/proc/kvtc"},
     "smol", STORE_WAYS, "kernel file system (/proc)"),
    ("disk-missing-parent", "disk_cache_dir",
     {"calibration": "{smol}", "disk_cache_gb": 0.01, "disk_cache_dir": "{tmp}/no/such/dir"}, "smol", STORE_WAYS,
     "does not exist"),
    ("disk-group-writable", "disk_cache_dir",
     {"calibration": "{smol}", "disk_cache_gb": 0.01, "disk_cache_dir": "{gw}"}, "smol", STORE_WAYS,
     "group- or world-writable"),
    ("calibration-missing", "calibration", {"calibration": "{tmp}/nowhere"}, "smol", ALL, "has no calibration.json"),
    ("calibration-theta", "calibration", {"calibration": "{t1e6}", "ratio": 16}, "mine", STORE_WAYS,
     "rope theta 1000000.0 vs 10000.0"),
    ("calibration-layers", "calibration", {"calibration": "{l8}", "ratio": 16}, "mine", STORE_WAYS,
     "num_layers 8 vs 6"),
]  # fmt: skip
PREFIX = {"extra": "kv_connector_extra_config.", "vllm_tier": "secondary_tiers[type=kvtc].",
          "lmcache_serde": "serde[type=kvtc]."}  # fmt: skip


def _fill(options: dict, world: dict) -> dict:
    subs = {**world["cals"], "tmp": str(world["tmp"])}
    out = {}
    for k, v in options.items():
        if v == "{gw}":
            v = _gw(world["tmp"])
        elif isinstance(v, str):
            v = v.format(**subs)
        out[k] = v
    return out


CASES = [(way, *c) for c in INVALID for way in c[4]]


@pytest.mark.parametrize("way, name, key, options, model, ways, says", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_invalid_configuration_stops_the_engine_with_one_line_naming_the_key(
    world, way, name, key, options, model, ways, says, caplog
):
    opts = _fill(options, world)
    with caplog.at_level("WARNING", logger="dynamo_kvtc"), pytest.raises(ConfigError) as e:
        stop(way, start(way, world[model], opts))  # (stop: only if it wrongly started)
    line = str(e.value)
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith(PREFIX[way] + key), line  # the key as this way in spells it
    assert settings.BY_KEY[key].env not in line, line  # never the variable the operator did not set
    assert says in line, line
    if name == "calibration-theta":  # the field and both values, nothing spurious
        assert "num_layers" not in line and "rotary" not in line, line
    if name == "calibration-layers":  # a layers-only difference says nothing about the rotary config or theta
        assert "rotary" not in line and "theta" not in line, line
    assert not [r for r in caplog.records if r.levelno >= 30 and "serving without" in r.getMessage()]  # stopped


@pytest.mark.parametrize(
    "extra, env, named",
    [
        ({}, {"DYN_KVTC_RATIO": "7"}, "DYN_KVTC_RATIO: 7 has no plan"),  # the environment set it: its variable
        ({"ratio": 7}, {"DYN_KVTC_RATIO": "16"}, "kv_connector_extra_config.ratio: 7 has no plan"),  # extra wins
        ({}, {"DYN_KVTC_RATIO": "abc"}, "DYN_KVTC_RATIO='abc' is invalid"),
        ({"cpu_cache_gb": 0}, {}, "kv_connector_extra_config.cpu_cache_gb: is 0 and there is no disk tier"),
        ({}, {"DYN_KVTC_CPU_CACHE_GB": "0"}, "DYN_KVTC_CPU_CACHE_GB: is 0 and there is no disk tier"),
        ({}, {"DYN_KVTC_DISK_CACHE_GB": "1", "DYN_KVTC_DISK_CACHE_DIR": "/proc/x"}, "DYN_KVTC_DISK_CACHE_DIR: /proc/x"),
    ],
)
def test_kvtc_connector_names_the_variable_only_when_the_environment_set_it(world, extra, env, named):
    env = {"DYN_KVTC_CALIBRATION": world["cals"]["smol"], **env}
    with pytest.raises(ConfigError) as e:
        start_connector(world["smol"], extra, env).shutdown()
    assert str(e.value).startswith(named) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------- runtime limitations
def _one_warning(caplog, reason: str) -> str:
    lines = [r for r in caplog.records if r.levelno >= 30]
    assert len(lines) == 1 and lines[0].levelname == "WARNING", [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    assert "serving without the tier" in msg and reason in msg and "\n" not in msg, msg
    return msg


def test_a_model_family_the_connector_does_not_serve_is_served_without_it(world, caplog):
    from transformers import LlamaConfig

    hf = LlamaConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    hybrid = Model("m", hf, 2, 2, 128)
    with caplog.at_level("WARNING", logger="dynamo_kvtc"):
        w = start_connector(hybrid, {"calibration": world["cals"]["smol"], "ratio": 16})
    try:
        _one_warning(caplog, "model")
        assert w.store is None and w.disabled_reason == "model" and w.match([1, 2, 3]) == (0, 0)
    finally:
        w.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here: device cuda is no limitation")
def test_device_cuda_without_cuda_serves_without_the_tier_and_the_serde(world, caplog):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    cal = world["cals"]["smol"]
    with caplog.at_level("WARNING", logger="dynamo_kvtc"):
        manager = start_tier(world["smol"], {"calibration": cal, "cpu_cache_gb": 0.05, "device": "cuda"})
    try:
        _one_warning(caplog, "device")
        tier = manager.secondary_tiers[0]
        assert tier.store is None and tier.disabled.reason == "device"
        key = make_offload_key(b"k" * 16, 0)
        assert tier.lookup(key, ReqContext("r")) is LookupResult.MISS  # every lookup a miss
        import numpy as np

        tier.submit_store(TransferJob(7, [key], np.array([0], dtype=np.int64), False, ReqContext("r")))
        (result,) = list(tier.get_finished_jobs())  # reported once, failed: nothing is stored
        assert result.job_id == 7 and result.success is False
        assert tier.get_stats().data["data"]["vllm:kvtc_tier_enabled"] == {("device",): 0.0}
    finally:
        manager.shutdown()
    caplog.clear()
    with caplog.at_level("WARNING", logger="dynamo_kvtc"):
        coder = start_serde(world["smol"], {"calibration": cal, "device": "cuda"})
    _one_warning(caplog, "device")
    assert coder.disabled.reason == "device"
    with pytest.raises(KvtcError, match="serves without the tier"):
        coder.serialize_into(torch.zeros(2, 30, 16, 192, dtype=torch.bfloat16), torch.zeros(1 << 20, dtype=torch.uint8))


def test_the_three_ways_in_serve_a_valid_configuration(world, caplog):
    """The same options minus the fault start every way in (the cases above fail for their fault alone)."""
    cal = world["cals"]["smol"]
    with caplog.at_level("WARNING", logger="dynamo_kvtc"):
        w = start_connector(world["smol"], {"calibration": cal, "ratio": 16, "cpu_cache_gb": 0.01})
        try:
            assert w.disabled is None and w.store is not None
        finally:
            w.shutdown()
        manager = start_tier(world["smol"], {"calibration": cal, "cpu_cache_gb": 0.05, "ratio": 16})
        try:
            assert manager.secondary_tiers[0].disabled is None
        finally:
            manager.shutdown()
        assert start_serde(world["smol"], {"calibration": cal, "ratio": 16}).disabled is None
    assert not [r.getMessage() for r in caplog.records if r.levelno >= 30 and "serving without" in r.getMessage()]
