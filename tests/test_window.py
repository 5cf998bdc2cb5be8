"""The moving raw window: a multi-turn conversation stored through a real KvtcStore (SmolLM2's shipped calibration,
real KV from the model) keeps one raw window, at its end, after every turn; restores during a replacement are exact
or clean misses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dynamo_kvtc.calibration.artifact import Calibration
from dynamo_kvtc.tiers import KvtcStore, TierConfig

from .conftest import offload_seq

BS = 16
WINDOW = 128
CAL = Path(__file__).resolve().parents[1] / "calibrations" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def cal():
    return Calibration.load(CAL)


def _store(cal, window=WINDOW):
    cfg = TierConfig(host_bytes=512 << 20, ratio=16, min_tokens=32, window=window)
    return KvtcStore(cal, cfg, block_size=BS, span_tokens=1024)


class Collect:
    def __init__(self, k):
        self.k = torch.zeros_like(k)
        self.v = torch.zeros_like(k)

    def __call__(self, layer, start, k, v):
        self.k[layer, start : start + k.shape[0]] = k
        self.v[layer, start : start + v.shape[0]] = v


async def _restore(store, hashes, like):
    sink = Collect(like)
    h = store.start_onboard(hashes, sink=sink)
    ok = await h.done()
    return ok, sink


def _exact_blocks(a, b, n):
    """Indices of the blocks (of ``n``) where ``a`` equals ``b`` bit for bit, layers and K/V both."""
    return [i for i in range(n) if torch.equal(a[:, i * BS : (i + 1) * BS], b[:, i * BS : (i + 1) * BS])]


# turn ends (tokens) of one conversation: long turns, a short one (2 blocks), one shorter than the window, one block
TURNS = [600, 632, 700, 1024, 1040, 1500]


async def test_a_conversation_keeps_one_raw_window_after_every_turn(cal, smol_heldout):
    k, v, _ = smol_heldout
    toks = list(range(1000, 1000 + k.shape[1]))
    store = _store(cal)
    raw_blocks = WINDOW // BS
    for t in TURNS:
        n = t // BS
        held = store.match(store.hashes(toks[: n * BS]))
        res = offload_seq(store, toks[:t], k[:, :t], v[:, :t])
        assert res.skipped is None and res.stored_blocks == n - held  # the new blocks (the window's not counted again)
        hashes = store.hashes(toks[: n * BS])
        assert store.match(hashes) == n
        ok, sink = await _restore(store, hashes, k[:, : n * BS])
        assert ok
        exact = _exact_blocks(sink.k, k[:, : n * BS], n)
        assert exact == list(range(n - raw_blocks, n)), (t, exact)  # the last window raw, every other block coded
        assert _exact_blocks(sink.v, v[:, : n * BS], n) == exact
        metas = store.index.metas()
        raw = [m for m in metas if m.stored_bytes >= m.raw_bytes]
        assert len(raw) == 1 and raw[0].hashes == hashes[-raw_blocks:]  # one raw blob: the window, nothing else
        assert sum(len(m.hashes) for m in metas) == n  # no block held twice
    st = store.stats
    assert st.offload_window_recoded == len(TURNS) - 1 and st.blobs_retired == len(TURNS) - 1
    # the offload byte counters add what each offload added (a replaced window deducted): nothing evicted, so they
    # sum to what the tiers hold
    assert (st.offload_raw_bytes, st.offload_stored_bytes) == (st.held_raw_bytes, st.held_stored_bytes)
    snap = store.snapshot()
    assert snap["host_blobs"] == len(store.index.metas())  # the retired windows left the host tier
    store.close()


async def test_the_held_ratio_counts_one_window_not_one_per_turn(cal, smol_heldout):
    """The same conversation with the window kept per turn (each turn's raw window left behind, as before) holds
    far more bytes: measured against the codec's own ratio on the same tokens."""
    k, v, _ = smol_heldout
    toks = list(range(1000, 1000 + k.shape[1]))
    held = {}
    for moving in (True, False):
        store = _store(cal)
        store.offloader.moving_window = moving
        for t in TURNS:
            offload_seq(store, toks[:t], k[:, :t], v[:, :t])
        snap = store.snapshot()
        held[moving] = snap["host_raw_bytes"] / snap["host_stored_bytes"]
        assert snap["held_raw_bytes"] == snap["host_raw_bytes"]
        assert snap["effective_ratio"] == pytest.approx(held[moving])
        store.close()
    assert held[True] > 1.5 * held[False], held


async def test_restores_during_a_replacement_are_exact_or_misses(cal, smol_heldout):
    k, v, _ = smol_heldout
    toks = list(range(1000, 1000 + k.shape[1]))
    store = _store(cal)
    offload_seq(store, toks[:640], k[:, :640], v[:, :640])
    hashes = store.hashes(toks[:640])
    ok, before = await _restore(store, hashes, k[:, :640])
    assert ok
    old = store.blob_of(hashes[-1])
    # a reader holding the old raw window (a host-tier lease, as a restore or a peer export holds it) ...
    runs, views = store.export(hashes, lease=True)
    planned = store.index.plan(hashes)
    # ... while the next turn replaces it
    offload_seq(store, toks[:960], k[:, :960], v[:, :960])
    assert store.blob_of(hashes[-1]) != old and old not in store.index.blob_ids()
    assert old not in store.host  # retired from the tier; its pages stay until the lease ends
    codec = store.default_codec()
    for run, view in zip(runs, views):
        dk, dv = codec.decode(view.tobytes())
        a = run.at * BS
        got = dk[:, run.first * BS : (run.first + run.count) * BS].to(k.dtype)
        assert torch.equal(got, before.k[:, a : a + run.count * BS])
        view.release()
    # a restore planned on the old blob finds it gone: a clean miss (TierError), never other bytes
    with pytest.raises(Exception) as e:
        store.placement.read(planned[-1].blob_id)
    assert "vanished" in str(e.value)
    # restores racing replacements: each is exact (as a restore of the same blocks before) or a miss
    outcomes = []
    for t0, t1 in ((960, 1200), (1200, 1456), (1456, 1712)):
        prefix = store.hashes(toks[:t0])
        _, ref = await _restore(store, prefix, k[:, :t0])
        sink = Collect(k[:, :t0])
        h = store.start_onboard(prefix, sink=sink)
        fut = store.submit_offload(store.hashes(toks[:t1]), toks[:t1], keys=k[:, :t1], values=v[:, :t1])
        ok = await h.done()
        fut.result()
        outcomes.append(ok)
        if ok:
            assert torch.equal(sink.k, ref.k) and torch.equal(sink.v, ref.v)
    assert any(outcomes)  # the exact case happened (the restore leases its blobs before the encode lands)
    store.close()


def test_bench_tiers_reports_the_effective_ratio_per_conversation(tmp_path):
    """`bench tiers --conversations`: per workload the effective ratio held, the one-raw-window bound, and the same
    conversation with a raw window per save (synthetic KV here: the numbers' mechanics, not their values)."""
    import json

    from dynamo_kvtc.cli.main import main

    out = tmp_path / "conv.json"
    argv = ["bench", "tiers", "--synthetic", "smollm2-135m", "--tokens", "1024", "--conversations", "demo"]
    assert main([*argv, "--conversations-only", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]["conversations"]["demo"]
    moving, before = r["moving_window"], r["window_per_offload"]
    assert r["tokens"] == 1584 and r["effective_ratio"] == moving["effective_ratio"]
    assert moving["held_raw_bytes"] == before["held_raw_bytes"] == 1584 * 30 * 3 * 64 * 2 * 2
    assert 0.9 * r["bound"] < r["effective_ratio"] <= r["bound"] and r["effective_ratio"] > before["effective_ratio"]
    assert moving["windows_recoded"] == 5 and before["windows_recoded"] == 0  # every save after the first
