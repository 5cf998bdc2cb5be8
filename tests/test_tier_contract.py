"""vLLM's ``SecondaryTierManager`` contract, written here from vLLM 0.31's interface
(vllm/v1/kv_offload/tiering/base.py), and both the ``kvtc`` tier and vLLM's own ``fs`` tier driven through the same
cases.

The contract: ``submit_store``/``submit_load`` queue a job; every submitted job is reported exactly once by
``get_finished_jobs`` (after ``drain_jobs`` every result is available), whatever fails; a failed job says
``success=False`` (a failed promotion names the keys restored before the failure in ``successful_keys``); a store
reports the raw bytes it moved (vLLM's backpressure detector reads latency per byte); a stored chunk is found by
``lookup`` and comes back bit for bit (the ``kvtc`` tier stores raw here, ``ratio_policy: raw``); vLLM's
``TieringOffloadingManager.reset_cache`` works after failed jobs (it asserts no job is left unreported) and its
``shutdown`` releases the primary tier's shared memory.

Both tiers are built the way vLLM builds them: ``KvtcTieringSpec(config).get_manager()`` (vLLM's
TieringOffloadingManager with its real CPU primary tier in shared memory and the tier from SecondaryTierFactory); no
engine. Faults are injected into the real objects (a method replaced to raise an unexpected exception type, a blob's
bytes flipped, a file truncated).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from .offload_config import tiering_manager  # noqa: E402

L, BS, BPC, H, D = 30, 32, 2, 3, 64  # SmolLM2-135M: 30 layers x 3 KV heads x 64; chunks of 2 blocks of 32 tokens
KV_BYTES = L * BPC * BS * H * D * 2 * 2  # a chunk's K and V in bf16
CHUNKS = 6  # primary tier slots
KINDS = ("kvtc", "fs")


class Rig:
    """One tier of ``kind`` behind vLLM's TieringOffloadingManager, and the primary tier's rows as a tensor."""

    def __init__(self, kind: str, tmp: Path, events: bool = False, **options) -> None:
        from dynamo_kvtc.calibration.catalog import find_calibration

        if kind == "kvtc":
            tier_cfg = {"type": "kvtc", "ratio_policy": "raw", "page_layout": "nhd", "cpu_cache_gb": 0.05}
            tier_cfg["calibration"] = str(find_calibration("smollm2-135m-instruct"))
            tier_cfg.update(options)
        else:
            tier_cfg = {"type": "fs", "root_dir": str(tmp / "fs"), "n_read_threads": 1, "n_write_threads": 1}
        model = "smollm2-135m-instruct"
        self.cfg, self.manager = tiering_manager(
            model, L, KV_BYTES, tier_cfg, bs=BS, bpc=BPC, chunks=CHUNKS, events=events, engine="contract"
        )
        self.kind = kind
        self.tier = self.manager.secondary_tiers[0]
        view = self.manager.primary_tier.get_kv_memoryview()
        self._flat = view.cast("B") if view.ndim != 1 else view[:]
        self.rows = torch.frombuffer(self._flat, dtype=torch.uint8).view(-1, self.tier.block_size_bytes)
        self._next = 1000
        self.written: dict[bytes, torch.Tensor] = {}

    def close(self) -> None:
        del self.rows
        self._flat.release()
        self.manager.shutdown()

    # ------------------------------------------------------------------ jobs
    def job(self, keys: list[bytes], chunks: list[int], promotion: bool) -> TransferJob:
        ctx = ReqContext(f"r{self._next}")
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * BS * BPC)
        self._next += 1
        return TransferJob(self._next, keys, np.array(chunks, dtype=np.int64), promotion, ctx)

    def fill(self, chunk: int, key: bytes) -> None:
        x = (torch.randn(KV_BYTES // 2) * 0.5).to(torch.bfloat16).view(torch.uint8)
        self.rows[chunk, :KV_BYTES] = x
        self.written[key] = x.clone()

    def run(self, *jobs: TransferJob) -> dict[int, object]:
        """Submit ``jobs``, drain, and collect: every job is reported exactly once (and nothing else is)."""
        for j in jobs:
            (self.tier.submit_load if j.is_promotion else self.tier.submit_store)(j)
        self.tier.drain_jobs()
        results = list(self.tier.get_finished_jobs()) + list(self.tier.get_finished_jobs())
        ids = [r.job_id for r in results]
        assert sorted(ids) == sorted(j.job_id for j in jobs), f"reported {ids}, submitted {[j.job_id for j in jobs]}"
        assert not self.tier.has_pending_work()
        return {r.job_id: r for r in results}

    def store(self, keys: list[bytes], chunks: list[int]):
        for k, c in zip(keys, chunks):
            self.fill(c, k)
        j = self.job(keys, chunks, False)
        return self.run(j)[j.job_id]

    def load(self, keys: list[bytes], chunks: list[int]):
        j = self.job(keys, chunks, True)
        return self.run(j)[j.job_id]

    def lookup(self, key: bytes) -> LookupResult:
        ctx = ReqContext(f"l{uuid.uuid4().hex[:6]}")
        self.tier.on_new_request(ctx)
        try:
            for _ in range(200):  # fs looks up asynchronously: RETRY until a step end flushes its batch
                got = self.tier.lookup(key, ctx)
                if got is not LookupResult.RETRY:
                    return got
                self.tier.on_schedule_end(ScheduleEndContext((), ()))
                time.sleep(0.01)
            raise AssertionError("lookup kept answering RETRY")
        finally:
            self.tier.on_request_finished(ctx)

    # ------------------------------------------------------------------ faults
    def corrupt(self, key: bytes) -> None:
        """Damage a stored chunk where the tier keeps it: a flipped byte in the kvtc blob's host-tier pages, the fs
        tier's file cut in half."""
        if self.kind == "kvtc":
            from dynamo_kvtc.connector.offloading.tier import offload_hash

            store = self.tier.store
            (off, n), *_ = store.host.extents(store.blob_of(offload_hash(key)))
            store.host.arena[off + n // 2] ^= 0xFF
        else:
            path = Path(self.tier.file_mapper.get_file_name(key))
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def break_encode(self, monkeypatch, exc: type[BaseException]) -> None:
        """Make the tier's store path raise ``exc`` (a type no tier expects)."""

        def boom(*a, **k):
            raise exc("injected")

        if self.kind == "kvtc":
            monkeypatch.setattr(self.tier.codec, "encode", boom)
        else:
            monkeypatch.setattr("vllm.v1.kv_offload.tiering.fs.manager.batch_store_block", boom)

    def break_decode(self, monkeypatch, exc: type[BaseException]) -> None:
        def boom(*a, **k):
            raise exc("injected")

        if self.kind == "kvtc":
            monkeypatch.setattr(self.tier.layout, "pack", boom)
        else:
            monkeypatch.setattr("vllm.v1.kv_offload.tiering.fs.manager.batch_load_block", boom)


@pytest.fixture(params=KINDS)
def rig(request, tmp_path):
    r = Rig(request.param, tmp_path)
    yield r
    r.close()


def key(i: int) -> bytes:
    return make_offload_key(bytes([i]) * 32, 0)


# ----------------------------------------------------------------------------------------------- cases
def test_store_lookup_load_round_trip_reports_raw_bytes(rig):
    res = rig.store([key(1), key(2)], [0, 1])
    assert res.success and res.transfer_bytes == 2 * rig.tier.block_size_bytes  # raw bytes, as the backpressure reads
    assert rig.lookup(key(1)) is LookupResult.HIT and rig.lookup(key(2)) is LookupResult.HIT
    assert rig.lookup(key(9)) is LookupResult.MISS
    rig.rows[2:4] = 0
    res = rig.load([key(1), key(2)], [2, 3])
    assert res.success and res.successful_keys is None
    assert torch.equal(rig.rows[2, :KV_BYTES], rig.written[key(1)])
    assert torch.equal(rig.rows[3, :KV_BYTES], rig.written[key(2)])


def test_a_missing_chunk_fails_the_promotion_after_the_ones_before_it(rig):
    assert rig.store([key(1)], [0]).success
    res = rig.load([key(1), key(8)], [2, 3])
    assert not res.success and tuple(res.successful_keys) == (key(1),)
    assert torch.equal(rig.rows[2, :KV_BYTES], rig.written[key(1)])


def test_a_corrupt_chunk_fails_its_promotion(rig):
    assert rig.store([key(1), key(2)], [0, 1]).success
    rig.corrupt(key(1))
    res = rig.load([key(1)], [2])
    assert not res.success and not res.successful_keys
    assert rig.load([key(2)], [3]).success  # the other chunk is intact


@pytest.mark.parametrize("exc", [TypeError, KeyError, ZeroDivisionError])
def test_unexpected_exceptions_fail_their_job_once(rig, monkeypatch, exc):
    rig.break_encode(monkeypatch, exc)
    res = rig.store([key(1), key(2)], [0, 1])
    assert not res.success
    monkeypatch.undo()
    assert rig.store([key(3)], [2]).success
    rig.break_decode(monkeypatch, exc)
    res = rig.load([key(3)], [4])
    assert not res.success and not res.successful_keys


def test_a_store_whose_only_chunk_fails_is_a_failure(rig, monkeypatch):
    rig.break_encode(monkeypatch, TypeError)
    assert not rig.store([key(5)], [0]).success


def test_an_out_of_range_chunk_id_fails_the_job_not_the_tier(rig):
    rig.fill(0, key(1))
    j1, j2 = rig.job([key(1), key(2)], [0, 10**6], False), rig.job([key(3)], [10**6], True)
    res = rig.run(j1, j2)
    assert not res[j1.job_id].success and not res[j2.job_id].success
    assert rig.store([key(4)], [1]).success  # the tier still works


def test_reset_cache_after_failed_jobs_and_shutdown_release_the_primary(rig, monkeypatch):
    """Through vLLM's manager: chunks stored by the engine cascade into the tier, one cascade fails on an injected
    TypeError; reset_cache (which asserts that every job was reported) and shutdown then work."""
    m = rig.manager
    end = ScheduleEndContext((), ())

    def store(req: str, keys: list[bytes]) -> None:
        ctx = ReqContext(req)
        m.on_new_request(ctx)
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * BS * BPC)
        spec = m.prepare_store(keys, ctx).store_spec
        for k, c in zip(keys, spec.chunk_ids):
            rig.fill(int(c), k)
        m.complete_store(keys, ctx)
        m.on_schedule_end(end)
        m.on_request_finished(ctx)

    store("a", [key(1), key(2)])
    rig.tier.drain_jobs()
    m.on_schedule_end(end)
    rig.break_encode(monkeypatch, TypeError)
    store("b", [key(3)])
    m.reset_cache()  # drains the tier and asserts no job is left unreported
    assert not m._jobs
    monkeypatch.undo()
    assert rig.lookup(key(1)) is LookupResult.HIT and rig.lookup(key(3)) is LookupResult.MISS
    shm = Path(f"/dev/shm/vllm_offload_{rig.cfg.engine_id}.mmap")
    rig.close()
    rig.close = lambda: None
    assert not shm.exists()


def test_kvtc_reports_a_job_submitted_after_shutdown(tmp_path):
    """The kvtc tier only: a job that cannot be queued any more is reported failed, not lost (vLLM's fs tier queues
    it into a stopped pool)."""
    rig = Rig("kvtc", tmp_path)
    try:
        rig.tier.shutdown()
        j = rig.job([key(1)], [0], False)
        rig.tier.submit_store(j)
        (res,) = rig.tier.get_finished_jobs()
        assert res.job_id == j.job_id and not res.success
    finally:
        rig.close()
