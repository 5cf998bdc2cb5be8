"""The connector's worker half on vLLM's GPU layouts (FlashAttention, FlashInfer) without an engine: save blocks out of
a paged cache, restore them into other blocks layer by layer, compare. Runs on CPU tensors everywhere and on CUDA
where present (the same code path the engine uses on a GPU: dedicated streams, per-layer events)."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
import torch

from dynamo_kvtc.calibration.synthetic import synthetic_calibration, synthetic_kv
from dynamo_kvtc.connector.config import ConnectorConfig
from dynamo_kvtc.connector.vllm.step_plan import LoadOp, SaveOp, StepPlan
from dynamo_kvtc.connector.vllm.worker import KvtcWorker
from dynamo_kvtc.tiers.keys import sequence_hashes

L, H, D, BS, NB = 4, 2, 64, 16, 40
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def cal_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal") / "synthetic"
    synthetic_calibration(L, H, D, theta=1e4, ratios=(16,), rank=256, dp_rows=1024).save(d)
    return d


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _worker(cfg: ConnectorConfig) -> KvtcWorker:
    """A worker for a model whose config matches the synthetic calibration (what vLLM's hf_config would say)."""
    hf = SimpleNamespace(
        architectures=["SyntheticForCausalLM"],
        num_hidden_layers=L,
        num_key_value_heads=H,
        num_attention_heads=H,
        hidden_size=H * D,
        head_dim=D,
        rope_theta=1e4,
    )
    return KvtcWorker(cfg, engine_id=f"t-{uuid.uuid4()}", model="synthetic", hf_config=hf, block_size=BS, num_blocks=NB)


def _caches(layout: str, device: str) -> dict[str, torch.Tensor]:
    shape = (2, NB, BS, H, D) if layout == "flash" else (NB, 2, BS, H, D)
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.bfloat16, device=device) for i in range(L)
    }


def _write(caches, layout, block_ids, k, v):
    for i, c in enumerate(caches.values()):
        kk = k[i].reshape(len(block_ids), BS, H, D).to(c.device)
        vv = v[i].reshape(len(block_ids), BS, H, D).to(c.device)
        for j, b in enumerate(block_ids):
            if layout == "flash":
                c[0, b], c[1, b] = kk[j], vv[j]
            else:
                c[b, 0], c[b, 1] = kk[j], vv[j]


def _read(caches, layout, block_ids):
    ks, vs = [], []
    for c in caches.values():
        ids = torch.tensor(block_ids, device=c.device)
        k, v = (c[0, ids], c[1, ids]) if layout == "flash" else (c[ids, 0], c[ids, 1])
        ks.append(k.reshape(-1, H, D).cpu())
        vs.append(v.reshape(-1, H, D).cpu())
    return torch.stack(ks), torch.stack(vs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["flash", "flashinfer"])
@pytest.mark.parametrize("lossless", [True, False])
def test_worker_saves_and_restores_layer_by_layer(cal_dir, device, layout, lossless):
    extra = {"calibration": str(cal_dir), "min_tokens": 16, "ratio": 16}
    if lossless:
        extra["window"] = 1 << 20
    cfg = ConnectorConfig.from_sources(extra, {})
    w = _worker(cfg)
    caches = _caches(layout, device)
    w.register_kv_caches(caches)
    try:
        assert w.disabled is None, w.disabled
        n = 12
        k, v, _ = synthetic_kv(w.store.cal, n * BS)
        src = list(range(3, 3 + n))
        _write(caches, layout, src, k, v)
        tokens = list(range(1000, 1000 + n * BS))
        hashes = sequence_hashes(tokens, BS)
        save = SaveOp("r1", hashes, None, 0, tokens, src, tail=True, final=True)
        w.save(StepPlan(saves=[save]))
        assert w.finished()[0] == {"r1"}  # blocks copied out: vLLM may free them now
        w.wait_idle()
        assert w.match(hashes) == (n, n)
        dst = list(range(20, 20 + n))
        w.start_load(StepPlan(loads=[LoadOp("r2", hashes, dst)]))
        for name in caches:  # what vLLM's attention layers do, in order
            w.wait_layer(name)
        w.save(None)
        assert w.load_errors() == set()
        (r,) = w.restores
        assert r["blocks"] == n and r["layer_ready_s"] == sorted(r["layer_ready_s"])
        k2, v2 = _read(caches, layout, dst)
        if lossless:
            assert torch.equal(k2, k) and torch.equal(v2, v)
        else:
            assert _rel(k2, k) < 0.3 and _rel(v2, v) < 0.3
        assert _read(caches, layout, src)[0].equal(k)  # the source blocks were only read
    finally:
        w.shutdown()


def test_worker_reports_a_restore_of_a_missing_blob_as_invalid_blocks(cal_dir):
    cfg = ConnectorConfig.from_sources({"calibration": str(cal_dir)}, {})
    w = _worker(cfg)
    caches = _caches("flash", "cpu")
    w.register_kv_caches(caches)
    try:
        w.start_load(StepPlan(loads=[LoadOp("r", [1, 2, 3], [5, 6, 7])]))  # hashes no tier holds
        for name in caches:
            w.wait_layer(name)  # must not raise: a failed restore is a recompute, not an engine crash
        w.save(None)
        assert w.load_errors() == {5, 6, 7} and w.stats["fallback_load_error"] == 1
    finally:
        w.shutdown()
