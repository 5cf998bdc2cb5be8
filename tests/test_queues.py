"""The engine-side queues: the offload queue's byte bound, cancellable restores, the host hits' own lane.

Real stores on the chaos world's synthetic calibration (lossless: restores are bit-exact), real engine-layout paged
caches on the CPU, real worker threads. Slowness is real: a source (the peer path's interface) or a sink that blocks
until the test lets it go, an encoder kept busy by a job on its one worker.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from dynamo_kvtc.connector.config import ConnectorConfig
from dynamo_kvtc.connector.metrics import connector_counters
from dynamo_kvtc.connector.vllm.step_plan import LoadOp, SaveOp, StepPlan
from dynamo_kvtc.connector.vllm.worker import KvtcWorker
from dynamo_kvtc.errors import ConfigError, TierError
from dynamo_kvtc.reliability.testbed import BS, SPAN, Sink, World, close_store, make_store, offload, tier_config
from dynamo_kvtc.tiers import KvtcStore, PagedKV, TierConfig
from dynamo_kvtc.tiers.keys import sequence_hashes

SENTINEL = 7.0
NB = 24  # engine blocks


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(tmp_path_factory.mktemp("queues"), seed=3)


def _paged(world: World) -> tuple[PagedKV, list[torch.Tensor]]:
    caches = [torch.full((2, NB, BS, world.H, world.D), SENTINEL, dtype=torch.bfloat16) for _ in range(world.L)]
    return PagedKV(caches, "flash", BS), caches


def _engine_store(world: World, **kw) -> tuple[KvtcStore, list[torch.Tensor]]:
    kv, caches = _paged(world)
    return KvtcStore(world.cal, tier_config(True, 8 << 20, **kw), block_size=BS, span_tokens=SPAN, kv=kv), caches


class Gate:
    """Something slow: blocks whoever calls :meth:`wait` until :meth:`open`; says when it was reached."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self._open = threading.Event()

    def wait(self, timeout: float = 30.0) -> None:
        self.reached.set()
        assert self._open.wait(timeout), "the test never let the slow part go"

    def open(self) -> None:
        self._open.set()


def slow_source(store: KvtcStore, hashes: list[int], gate: Gate):
    """The peer path's interface: the runs covering ``hashes``, delivered once ``gate`` opens (a slow peer)."""

    def fetch():
        gate.wait()
        return store.export(hashes)[0]

    return fetch


# ---------------------------------------------------------------------------------------------- offload queue
def test_offload_queue_bound_skips_saves_before_copying_and_counts_them(world):
    one = 4 * BS * world.cal.fingerprint.raw_bytes_per_token(torch.bfloat16)  # a 4-block save's K/V
    store, caches = _engine_store(world, offload_queue_bytes=2 * one)
    busy = Gate()
    store.offloader._pool.submit(busy.wait)  # the encoder is behind: its one worker busy
    kv = store.kv
    copies = []
    futures, seqs = [], []
    try:
        for i in range(5):
            toks = world.tokens(("q", i), 4 * BS)
            hashes = sequence_hashes(toks, BS)
            ids = list(range(4 * i, 4 * i + 4))
            k, v = world.seq_kv(hashes)
            for layer in range(world.L):
                kv.scatter_layer(layer, ids, k[layer], v[layer])

            def copy(ids=ids):
                copies.append(ids)
                k, v = kv.gather(ids)
                return k, v, None

            futures.append(store.submit_offload(hashes, toks, copy=copy, tail=True))
            seqs.append(hashes)
        skipped = [f.result(0).skipped for f in futures[2:]]  # answered at once, nothing queued
        assert skipped == ["queue_full"] * 3
        assert len(copies) == 2  # the skipped saves copied nothing
        assert store.offloader.budget.held == 2 * one and store.offloader.budget.peak <= 2 * one
        busy.open()
        assert all(f.result(30).stored_blocks == 4 for f in futures[:2])
        assert store.offloader.budget.held == 0  # the copies are gone with their encode
        assert store.stats.offload_queue_full == 3
        assert connector_counters(store=store).fallbacks["offload_queue_full"] == 3.0  # kvtc_fallbacks_total{reason}
        snap = store.snapshot()
        assert snap["offload_queue_bytes"] == 0 and snap["offload_queue_peak_bytes"] == 2 * one
        for i, hashes in enumerate(seqs):  # queued ones restore exactly; skipped ones are a plain miss
            assert store.match(hashes) == (4 if i < 2 else 0)
        sink = Sink(world.L, 4 * BS, world.H, world.D)
        assert store.start_onboard(seqs[0], sink=sink).wait(30)
        k, v = world.seq_kv(seqs[0])
        assert torch.equal(sink.k, k) and torch.equal(sink.v, v)
        # with room again, the same save goes through
        toks = world.tokens(("q", 4), 4 * BS)
        assert (
            store.submit_offload(seqs[4], toks, copy=lambda: (*kv.gather(list(range(16, 20))), None))
            .result(30)
            .stored_blocks
            == 4
        )
    finally:
        busy.open()
        close_store(store)


def test_offload_queue_setting_is_checked():
    assert TierConfig().offload_queue_bytes == 1 << 30
    with pytest.raises(ConfigError, match="offload_queue"):
        TierConfig(offload_queue_bytes=0)
    assert TierConfig.from_env({"DYN_KVTC_OFFLOAD_QUEUE_GB": "0.5"}).offload_queue_bytes == 1 << 29


def test_worker_save_over_the_queue_budget_is_skipped_and_counted(world):
    store, caches = _engine_store(world, offload_queue_bytes=1)  # any save is over: only one alone in the queue
    w = KvtcWorker(ConnectorConfig.from_sources({}, env={}), engine_id=f"t-{uuid.uuid4().hex[:8]}", model="m",
                   hf_config=None, block_size=BS)  # fmt: skip
    w.store = store
    busy = Gate()
    store.offloader._pool.submit(busy.wait)  # the encoder is behind
    try:
        saves, seqs = [], []
        for i in range(2):
            toks = world.tokens(("w", i), 4 * BS)
            ids = [4 * i + j for j in range(4)]
            hashes = sequence_hashes(toks, BS)
            k, v = world.seq_kv(hashes)
            for layer in range(world.L):
                store.kv.scatter_layer(layer, ids, k[layer], v[layer])
            saves.append(SaveOp(f"r{i}", hashes, None, 0, toks, ids, tail=True, final=True))
            seqs.append(hashes)
        w.save(StepPlan(saves=saves))
        assert store.stats.offload_queue_full == 1  # the second: the first alone holds more than the budget
        assert w.finished()[0] == {"r0", "r1"}  # both requests are released as usual
        busy.open()
        assert w.wait_idle(30)
        assert store.match(seqs[0]) == 4 and store.match(seqs[1]) == 0  # the skipped one is a later miss
        assert connector_counters(w).fallbacks["offload_queue_full"] == 1.0
    finally:
        busy.open()
        w.shutdown()


# ---------------------------------------------------------------------------------------------- cancellation
def test_restore_cancelled_while_fetching_writes_nothing_into_the_blocks(world):
    store, caches = _engine_store(world)
    try:
        hashes, _ = offload(world, store, world.tokens("c1", 6 * BS))
        gate = Gate()
        dst = list(range(10, 16))
        h = store.start_onboard(hashes, dst, source=slow_source(store, hashes, gate))
        assert h.lane == "peer"
        with pytest.raises(TierError, match="within"):
            h.wait_layer(0, timeout=0.05)  # the caller's deadline passed
        assert h.cancel(10)
        before = [c.clone() for c in caches]
        gate.open()  # the slow peer delivers after all
        assert not h.wait(30) and "cancelled" in str(h.error)
        assert all(torch.equal(a, b) for a, b in zip(before, caches))  # not one write after the cancel
        assert all(bool((c == SENTINEL).all()) for c in caches)
        assert store.stats.onboard_cancelled == 1 and not store.stats.onboard_errors
    finally:
        close_store(store)


def test_restore_cancelled_mid_write_stops_after_the_layer_being_written(world):
    store = make_store(world, True, host=8 << 20)
    try:
        hashes, _ = offload(world, store, world.tokens("c2", 5 * BS))
        log: list[object] = []
        in_layer1 = Gate()
        sink = Sink(world.L, 5 * BS, world.H, world.D)

        def slow_sink(layer, start, k, v):
            log.append(("start", layer))
            if layer == 1:
                in_layer1.wait()
            sink(layer, start, k, v)
            log.append(("end", layer))

        h = store.start_onboard(hashes, sink=slow_sink)
        assert in_layer1.reached.wait(30)
        t = threading.Thread(target=lambda: (h.cancel(), log.append("cancelled")))
        t.start()
        t.join(0.2)
        assert "cancelled" not in log  # cancel waits for the layer being written ...
        in_layer1.open()
        t.join(30)
        assert not h.wait(30) and h.cancelled
        # ... and nothing starts after it returned
        assert log == [("start", 0), ("end", 0), ("start", 1), ("end", 1), "cancelled"]
        assert h.ready_times[2:] == [None] * (world.L - 2)
        k, v = world.seq_kv(hashes)
        assert torch.equal(sink.k[:2], k[:2]) and bool((sink.k[2:] == 0).all())
    finally:
        close_store(store)


def test_worker_cancels_a_timed_out_restore_and_holds_the_request_until_it_let_go(world):
    store, caches = _engine_store(world)
    cfg = ConnectorConfig.from_sources({"load_timeout_s": 0.1}, env={})
    w = KvtcWorker(cfg, engine_id=f"t-{uuid.uuid4().hex[:8]}", model="m", hf_config=None, block_size=BS)
    w.store = store
    w.layers = {f"model.layers.{i}.self_attn.attn": i for i in range(world.L)}
    gate = Gate()

    class SlowPeer:  # the hand-off client's interface: a prefill peer that answers late
        def fetch(self, host, port, hashes):
            gate.wait()
            return store.export(hashes)[0]

        def close(self):
            pass

    w.peer = SlowPeer()
    try:
        hashes, _ = offload(world, store, world.tokens("c3", 4 * BS))
        op = LoadOp("r-async", hashes, [20, 21, 22, 23], asynchronous=True, remote=("127.0.0.1", 1))
        w.start_load(StepPlan(loads=[op]))
        assert gate.reached.wait(30)
        threading.Event().wait(0.2)  # past load_timeout_s
        assert w.finished() == (set(), set(), set())  # cancelled, but its restore still holds the blocks
        gate.open()
        handle = w._async["r-async"][1]
        assert not handle.wait(30) and handle.cancelled
        sending, recv, failed = w.finished()
        assert recv == {"r-async"} and failed == {"r-async"}  # now reported: vLLM recomputes, frees the blocks
        assert all(bool((c == SENTINEL).all()) for c in caches)  # nothing landed in them
        assert w.stats["fallback_timeout"] == 1
    finally:
        gate.open()
        w.shutdown()


def test_a_restore_cancelled_before_its_turn_never_asks_the_peer(world):
    """An asynchronous hand-off load given up on (``load_timeout_s``) while it waited for its lane is not fetched at
    all when its turn comes: the peer is never asked."""
    store, caches = _engine_store(world)
    cfg = ConnectorConfig.from_sources({"load_timeout_s": 0.1}, env={})
    w = KvtcWorker(cfg, engine_id=f"t-{uuid.uuid4().hex[:8]}", model="m", hf_config=None, block_size=BS)
    w.store = store
    asked = []

    class CountingPeer:  # the hand-off client's interface: records every fetch it is asked for
        def fetch(self, host, port, hashes):
            asked.append(list(hashes))
            return store.export(hashes)[0]

        def close(self):
            pass

    w.peer = CountingPeer()
    gate = Gate()
    try:
        busy_hashes, _ = offload(world, store, world.tokens("c4", 2 * BS))
        busy = store.start_onboard(busy_hashes, sink=Sink(world.L, 2 * BS, world.H, world.D),
                                   source=slow_source(store, busy_hashes, gate))  # fmt: skip
        assert gate.reached.wait(30)  # the peer lane is busy with a slow fetch
        hashes, _ = offload(world, store, world.tokens("c5", 4 * BS))
        op = LoadOp("r-late", hashes, [20, 21, 22, 23], asynchronous=True, remote=("127.0.0.1", 1))
        w.start_load(StepPlan(loads=[op]))
        threading.Event().wait(0.2)  # past load_timeout_s while still queued behind the slow one
        assert w.finished() == (set(), set(), set())  # cancelled (flag raised), not yet let go
        gate.open()
        assert busy.wait(30)
        handle = w._async["r-late"][1]
        assert not handle.wait(30) and handle.cancelled
        assert asked == []  # its turn came after the cancel: nothing was fetched
        assert w.finished()[2] == {"r-late"}
        assert all(bool((c[:, 20:24] == SENTINEL).all()) for c in caches)
    finally:
        gate.open()
        w.shutdown()


def test_a_cancel_that_times_out_keeps_the_blocks_until_the_restore_stopped_writing(world):
    """A synchronous restore whose layer write outlives ``load_timeout_s`` (and then the cancel's own wait) is
    failed only once that write is over: vLLM gets the blocks back (to recompute into) only when nothing of ours
    writes into them any more."""
    store, caches = _engine_store(world)
    cfg = ConnectorConfig.from_sources({"load_timeout_s": 0.1}, env={})
    w = KvtcWorker(cfg, engine_id=f"t-{uuid.uuid4().hex[:8]}", model="m", hf_config=None, block_size=BS)
    w.store = store
    w.layers = {f"model.layers.{i}.self_attn.attn": i for i in range(world.L)}
    in_write, events = Gate(), []
    scatter = store.kv.scatter_layer

    def slow_scatter(layer, ids, k, v):  # the engine's blocks written slowly (a stalled device copy)
        if layer == 0:
            in_write.wait()
        scatter(layer, ids, k, v)
        events.append(("written", layer))

    store.kv.scatter_layer = slow_scatter
    try:
        hashes, _ = offload(world, store, world.tokens("c6", 4 * BS))
        ids = [12, 13, 14, 15]
        w.start_load(StepPlan(loads=[LoadOp("r-sync", hashes, ids)]))
        assert in_write.reached.wait(30)
        t = threading.Thread(target=lambda: (w.wait_layer("model.layers.0.self_attn.attn"), events.append("failed")))
        t.start()
        t.join(1.0)  # far past load_timeout_s and the cancel's wait
        assert t.is_alive() and w.load_errors() == set()  # the blocks are not handed back while being written
        in_write.open()
        t.join(30)
        assert events == [("written", 0), "failed"]  # failed only after the write it waited for
        assert w.load_errors() == set(ids)  # vLLM recomputes them now
        assert ("written", 1) not in events  # and nothing after the cancel
    finally:
        in_write.open()
        w.shutdown()


# ---------------------------------------------------------------------------------------------- lanes
def test_host_hit_completes_while_a_slow_restore_is_in_flight(world):
    store = make_store(world, True, host=8 << 20)
    try:
        slow_hashes, _ = offload(world, store, world.tokens("l1", 6 * BS))
        host_hashes, _ = offload(world, store, world.tokens("l2", 3 * BS))
        gate = Gate()
        slow = store.start_onboard(slow_hashes, sink=Sink(world.L, 6 * BS, world.H, world.D),
                                   source=slow_source(store, slow_hashes, gate))  # fmt: skip
        assert gate.reached.wait(30)  # the slow restore occupies its lane
        sink = Sink(world.L, 3 * BS, world.H, world.D)
        fast = store.start_onboard(host_hashes, sink=sink)
        assert (slow.lane, fast.lane) == ("peer", "host")
        assert fast.wait(30)  # done while the slow one still waits on its peer
        assert not slow.finished
        k, v = world.seq_kv(host_hashes)
        assert torch.equal(sink.k, k) and torch.equal(sink.v, v)
        gate.open()
        assert slow.wait(30)
    finally:
        gate.open()
        close_store(store)


def test_disk_resident_restores_take_the_slow_lane(world, tmp_path):
    store = make_store(world, True, host=64 << 10, disk=64 << 20, disk_dir=tmp_path / "disk")
    try:
        first, _ = offload(world, store, world.tokens("d1", 8 * BS))
        for i in range(6):  # push the first sequence out of host memory onto disk
            offload(world, store, world.tokens(("d2", i), 8 * BS))
        assert store.where(first[0]) == "disk"
        assert store.restorer.lane_of(first, None) == "slow"
        h = store.start_onboard(first, sink=Sink(world.L, 8 * BS, world.H, world.D))
        assert h.lane == "slow" and h.wait(30)
    finally:
        close_store(store)


# ---------------------------------------------------------------------------------------------- bench chaos kinds
@pytest.mark.parametrize("kind", ["offload_queue", "restore_cancel", "slow_restore"])
def test_chaos_queue_kinds(world, kind):
    from dynamo_kvtc.reliability.chaos import Plan, run_chaos

    ledger = run_chaos(world, Plan(kinds=(kind,), host_rounds=4))
    c = ledger.kinds[kind]
    assert ledger.problems == []
    assert c["wrong_kv_served"] == 0 and c["crashes"] == 0 and c["committed_blocks_lost"] == 0
    assert c["faults_injected"] > 0 and c["faults_detected"] == c["faults_injected"]
    if kind == "offload_queue":
        d = ledger.details[kind]
        assert d["skipped_saves"] == c["faults_injected"] == c["recomputes"]
        assert d["peak_queue_bytes"] <= d["queue_budget_bytes"]
