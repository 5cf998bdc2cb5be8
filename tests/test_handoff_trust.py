"""Hostile clients and peers of the hand-off: a malformed request parameter never raises out of a scheduler hook, a
fault inside a hook is answered as a miss (connector/vllm/guard.py), and a peer's reply can only make the decode side
keep blobs under the hashes it asked for (messages.plan_reply / kept_meta). Fuzzed with hypothesis."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_kvtc.connector.config import ConnectorConfig
from dynamo_kvtc.connector.handoff import messages, params
from dynamo_kvtc.connector.handoff.params import HandoffParams, parse
from dynamo_kvtc.connector.vllm.remote_prefill import REFUSED, RemotePrefill
from dynamo_kvtc.connector.vllm.scheduler import KvtcScheduler
from dynamo_kvtc.errors import TierError, TransferError

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
BS = 16


class Lookup:
    """The worker's store as the scheduler sees it: holds every block (so a request that is not fetched from a peer
    is answered by the local tiers)."""

    def __init__(self) -> None:
        self.asked = 0

    def match(self, hashes):
        self.asked += 1
        return len(hashes), len(hashes)

    def handoff_port(self):
        return 5555


def _req(p, rid="r1", tokens=1024):
    toks = list(range(tokens))
    return SimpleNamespace(
        request_id=rid, kv_transfer_params=p, prompt_token_ids=toks, num_prompt_tokens=tokens, all_token_ids=toks,
        num_computed_tokens=0,
    )  # fmt: skip


def _offer(**kw):
    return {"do_remote_prefill": True, "kvtc_host": "10.0.0.2", "kvtc_port": 5555, "kvtc_blocks": 63, **kw}


class Blocks:
    def __init__(self, n):
        self.ids = list(range(100, 100 + n))

    def get_block_ids(self):
        return (self.ids,)


def _decode(monkeypatch, lookup=None):
    monkeypatch.setenv("DYN_KVTC_HANDOFF_CHOICE", "compressed")
    cfg = ConnectorConfig(transfer="decode", transfer_peers="10.0.0.2")
    remote = RemotePrefill(cfg, "engine-d", BS, lambda: None)
    return KvtcScheduler(cfg, BS, lookup or Lookup(), remote)


# ---------------------------------------------------------------------------------------------- request params
def test_well_formed_params_parse():
    assert parse(_offer()) == HandoffParams("10.0.0.2", 5555, 63)
    assert parse({"kvtc_host": "[fe80::1%eth0]", "kvtc_port": 1}) == HandoffParams("[fe80::1%eth0]", 1, 0)
    assert parse({**_offer(), "kvtc_blocks": messages.MAX_FETCH_BLOCKS}).blocks == messages.MAX_FETCH_BLOCKS


BAD = [
    ({"kvtc_blocks": "abc"}, "kvtc_blocks"),
    ({"kvtc_blocks": -1}, "kvtc_blocks"),
    ({"kvtc_blocks": 1.5}, "kvtc_blocks"),
    ({"kvtc_blocks": True}, "kvtc_blocks"),
    ({"kvtc_blocks": 1 << 40}, "kvtc_blocks"),
    ({"kvtc_blocks": None}, "kvtc_blocks"),
    ({"kvtc_port": "5555"}, "kvtc_port"),
    ({"kvtc_port": 0}, "kvtc_port"),
    ({"kvtc_port": 65536}, "kvtc_port"),
    ({"kvtc_port": True}, "kvtc_port"),
    ({"kvtc_port": [1]}, "kvtc_port"),
    ({"kvtc_host": ""}, "kvtc_host"),
    ({"kvtc_host": "h" * 256}, "kvtc_host"),
    ({"kvtc_host": 7}, "kvtc_host"),
    ({"kvtc_host": "a b"}, "kvtc_host"),
    ({"kvtc_host": "*"}, "kvtc_host"),
    ({"kvtc_host": "host/../x"}, "kvtc_host"),
    ({"kvtc_host": None}, "kvtc_host"),
]


@pytest.mark.parametrize("bad,why", BAD)
def test_malformed_params_are_refused_counted_and_logged_once(bad, why, caplog):
    before = params.REFUSED[why]
    with caplog.at_level(logging.WARNING, logger="dynamo_kvtc.connector.handoff.params"):
        assert parse(_offer(**bad), "req-7") is None
    assert params.REFUSED[why] == before + 1
    assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()
    assert "req-7" in caplog.records[0].getMessage()
    assert params.check(_offer(**bad)) == why  # the same answer without the count


def test_params_that_are_not_a_map_are_refused():
    for p in (None, [1, 2], "x", 3):
        assert parse(p) is None


@pytest.mark.parametrize("bad,why", BAD[:8])
def test_a_decode_scheduler_answers_malformed_params_from_its_tiers_and_serves_the_next(bad, why, monkeypatch, caplog):
    """The engine-killing request of the issue (``kvtc_blocks: "abc"`` and friends): the hooks never raise, the
    request is not fetched from a peer (the local tiers answer), the refusal is logged once for the request however
    often the scheduler asks; the next, well-formed request is fetched from its peer as usual."""
    lookup = Lookup()
    sched = _decode(monkeypatch, lookup)
    bad_req = _req(_offer(**bad), "bad")
    with caplog.at_level(logging.WARNING, logger="dynamo_kvtc.connector.handoff.params"):
        for _ in range(3):  # a waiting request is asked again every step
            ext, asynchronous = sched.get_num_new_matched_tokens(bad_req, 0)
        sched.update_state_after_alloc(bad_req, Blocks(64), ext)
    assert len(caplog.records) == 1 and bad_req.kv_transfer_params["kvtc_choice"] == REFUSED
    assert lookup.asked == 3 and ext == 63 * BS  # answered by the local tiers, not by the peer
    plan = sched.build_meta(SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=
                                            SimpleNamespace(req_ids=[])))  # fmt: skip
    assert [op.remote for op in plan.loads] == [None]
    good = _req(_offer(), "good")
    assert sched.get_num_new_matched_tokens(good, 0) == (63 * BS, True)
    sched.update_state_after_alloc(good, Blocks(64), 63 * BS)
    assert sched._plan.loads[-1].remote == ("10.0.0.2", 5555) and len(sched._plan.loads[-1].hashes) == 63
    assert lookup.asked == 3  # the fetched request never asked the local tiers


def test_a_client_preset_choice_does_not_skip_the_checks(monkeypatch):
    sched = _decode(monkeypatch)
    req = _req(_offer(kvtc_choice="compressed", kvtc_port="nope"))
    assert sched.get_num_new_matched_tokens(req, 0)[0] == 63 * BS  # local tiers: not a fetch from "nope"
    assert req.kv_transfer_params["kvtc_choice"] == REFUSED
    with pytest.raises(ValueError):  # a caller that skips applies() still cannot build a fetch from it
        sched.remote.load(req, [1], [1])


@settings(FUZZ, max_examples=400)
@given(
    st.dictionaries(
        st.sampled_from(["kvtc_host", "kvtc_port", "kvtc_blocks", "do_remote_prefill", "kvtc_choice", "x"]),
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=300)
        | st.binary(max_size=8) | st.lists(st.integers(), max_size=3) | st.dictionaries(st.text(max_size=3),
                                                                                         st.integers(), max_size=2),
    )
    | st.none() | st.lists(st.integers(), max_size=3) | st.text(max_size=5)
)  # fmt: skip
def test_fuzzed_params_never_raise(p):
    """Any value in any key (or no map at all): ``parse`` answers HandoffParams within range or None, and the
    scheduler-side policy answers without raising."""
    got = params.parse(p)
    if got is not None:
        assert isinstance(got.host, str) and 0 < len(got.host) <= params.MAX_HOST
        assert type(got.port) is int and 1 <= got.port <= 65535
        assert type(got.blocks) is int and 0 <= got.blocks <= messages.MAX_FETCH_BLOCKS
    remote = RemotePrefill(ConnectorConfig(transfer="decode", transfer_peers="10.0.0.2"), "e", BS, lambda: None)
    req = _req(dict(p) if isinstance(p, dict) else p)
    if remote.applies(req):
        assert got is not None
        ext, asynchronous = remote.matched(req, 0)
        assert 0 <= ext <= got.blocks * BS and (asynchronous or ext == 0)
        assert remote.load(req, [1], [2]).remote == (got.host, got.port)
    else:
        assert remote.matched(_req({}), 0) == (0, False)


# ---------------------------------------------------------------------------------------------- the hook guard
vllm = pytest.importorskip("dynamo_kvtc.connector.vllm.connector")


def _connector(sched):
    c = object.__new__(vllm.KvtcConnector)  # the real class and hooks, without an engine around them
    c._scheduler = sched
    return c


def _empty_output():
    return SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=
                           SimpleNamespace(req_ids=[]))  # fmt: skip


def test_a_fault_in_a_hook_is_a_miss_not_an_engine_failure(monkeypatch, caplog):
    from dynamo_kvtc.connector.vllm import guard

    c = _connector(_decode(monkeypatch))
    broken = _req({}, "broken")
    broken.prompt_token_ids = broken.all_token_ids = ["not a token"] * 64  # hashing it raises ValueError
    before = guard.FAULTS["get_num_new_matched_tokens"]
    with caplog.at_level(logging.WARNING, logger="dynamo_kvtc.connector.vllm.guard"):
        assert c.get_num_new_matched_tokens(broken, 0) == (0, False)
    assert guard.FAULTS["get_num_new_matched_tokens"] == before + 1 and "answering a miss" in caplog.text
    c.update_state_after_alloc(broken, Blocks(4), 0)  # nothing promised: nothing planned
    assert c.request_finished(broken, [1, 2, 3]) == (False, None)
    ok = _req(_offer(), "ok")
    assert c.get_num_new_matched_tokens(ok, 0) == (63 * BS, True)  # the next request is served as before
    meta = c.build_connector_meta(_empty_output())
    assert not meta.plan.loads and not meta.plan.saves


class FailingAlloc(KvtcScheduler):
    """A scheduler whose planning of a load raises (a bug of ours, injected), after a lookup promised tokens."""

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        raise RuntimeError("injected")


@pytest.mark.parametrize("remote", [False, True])
def test_a_promised_load_that_cannot_be_planned_fails_in_the_worker(remote, monkeypatch, synth_cal):
    """``update_state_after_alloc`` raised after vLLM was promised tokens: the plan carries a load the worker's
    store refuses at once (no hashes for its blocks), so vLLM recomputes instead of running on unwritten blocks —
    from these blocks (synchronous) or the whole request (asynchronous, the peer fetch)."""
    from dynamo_kvtc.tiers import KvtcStore, TierConfig

    monkeypatch.setenv("DYN_KVTC_HANDOFF_CHOICE", "compressed")
    cfg = ConnectorConfig(transfer="decode", transfer_peers="10.0.0.2")
    sched = FailingAlloc(cfg, BS, Lookup(), RemotePrefill(cfg, "d", BS, lambda: None))
    c = _connector(sched)
    req = _req(_offer() if remote else {}, "r")
    ext, asynchronous = c.get_num_new_matched_tokens(req, 0)
    assert ext == 63 * BS and asynchronous is remote
    c.update_state_after_alloc(req, Blocks(64), ext)
    (op,) = c.build_connector_meta(_empty_output()).plan.loads
    assert op.hashes == [] and op.block_ids == [-1, *range(100, 163)] and op.asynchronous is remote
    store = KvtcStore(synth_cal, TierConfig(host_bytes=1 << 20, ratio=8, min_tokens=32, page_bytes=1024, window=32),
                      block_size=BS, span_tokens=128)  # fmt: skip
    try:
        with pytest.raises(TierError):  # what the worker's start_load meets: _fail_load, a recompute
            store.start_onboard(op.hashes, op.block_ids, sink=lambda *a: None)
    finally:
        store.close()


def test_a_failed_request_finished_still_holds_blocks_being_saved(monkeypatch):
    """request_finished raised after it planned the request's final save: the blocks stay held until the worker
    copied them out (freeing them would let the save copy reused blocks)."""
    monkeypatch.setenv("DYN_KVTC_HANDOFF_CHOICE", "compressed")
    cfg = ConnectorConfig(transfer="prefill")

    class Raising(RemotePrefill):
        def handoff_params(self, request):
            raise RuntimeError("injected")

    sched = KvtcScheduler(cfg, BS, Lookup(), Raising(cfg, "p", BS, lambda: 5555))
    c = _connector(sched)
    req = _req({"do_remote_decode": True}, "fin", tokens=64)
    c.get_num_new_matched_tokens(req, 0)
    req.num_computed_tokens = 64
    assert c.request_finished(req, [1, 2, 3, 4]) == (True, None)
    assert [s.final for s in sched._plan.saves] == [True]


# ---------------------------------------------------------------------------------------------- peer replies
REQ = [101, 102, 103, 104, 105, 106]


def _meta(hashes, **kw):
    m = {"id": "peer-chosen-id", "hashes": hashes, "block_size": 16, "first_position": 0, "ratio": 8.0,
         "cal": "cal-1", "raw_bytes": 4096, "stored_bytes": 512}  # fmt: skip
    return {**m, **kw}


def _blob(hashes, first, count, j, size=100, **kw):
    return {"size": size, "first": first, "count": count, "j": j, "meta": _meta(hashes, **kw.pop("meta", {})),
            "descs": [[4096 * (j + 1), size]], **kw}  # fmt: skip


def _reply(*blobs):
    return {"blobs": list(blobs)}


def test_only_requested_hashes_are_kept_and_the_id_is_ours():
    tail = _blob([101, 102, 103, 104, 999, 998], 0, 4, 0)  # the blob holds two blocks nobody asked for after ours
    rest = _blob([105, 106], 0, 2, 4, size=50)
    runs, remote = messages.plan_reply(_reply(tail, rest), REQ)
    assert [r.meta["hashes"] for r in runs] == [[101, 102, 103, 104], [105, 106]]
    assert runs[0].meta["id"] == f"{101:016x}{104:016x}" and runs[0].meta["stored_bytes"] == 100
    assert runs[1].meta["first_position"] == 0 and runs[0].first == 0 and runs[0].count == 4
    mid = _blob([7, 8, 101, 102, 103], 2, 3, 0)  # the requested blocks start inside the blob: used, not kept
    runs, _ = messages.plan_reply(_reply(mid, _blob([104, 105, 106], 0, 3, 3)), REQ)
    assert runs[0].meta is None and runs[0].first == 2 and runs[1].meta["hashes"] == [104, 105, 106]


@pytest.mark.parametrize(
    "blobs",
    [
        [_blob([101, 102, 103, 999, 105, 106], 0, 6, 0)],  # another block in the middle
        [_blob([102, 101, 103, 104, 105, 106], 0, 6, 0)],  # the requested blocks out of order
        [_blob([101, 102, 103], 0, 3, 0)],  # half the request
        [_blob([101, 102, 103], 0, 3, 0), _blob([104, 105, 106], 0, 3, 2)],  # overlapping runs
        [_blob([104, 105, 106], 0, 3, 3), _blob([101, 102, 103], 0, 3, 0)],  # runs out of order
        [_blob([101, 102, 103, 104, 105, 106, "x"], 0, 6, 0)],  # junk beside the requested hashes
        [_blob([101, 102, 103, 104, 105, 106, -1], 0, 6, 0)],
        [_blob([101, 102, 103, 104, 105, 106, 1 << 128], 0, 6, 0)],  # wider than a block key
        [_blob([True, 102, 103, 104, 105, 106], 0, 6, 0)],
    ],
)
def test_replies_naming_other_blocks_are_refused(blobs):
    with pytest.raises(TransferError):
        messages.plan_reply(_reply(*blobs), REQ)


@pytest.mark.parametrize(
    "bad",
    [{"block_size": 0}, {"block_size": "16"}, {"first_position": -1}, {"ratio": float("nan")},
     {"ratio": float("inf")}, {"ratio": True}, {"ratio": "8"}, {"cal": ""}, {"cal": 3}, {"raw_bytes": None}],
)  # fmt: skip
def test_malformed_metadata_is_used_never_kept(bad):
    (run,), _ = messages.plan_reply(_reply(_blob(REQ, 0, 6, 0, meta=bad)), REQ)
    assert run.meta is None
    (ok,), _ = messages.plan_reply(_reply(_blob(REQ, 0, 6, 0, meta={"ratio": None})), REQ)
    assert ok.meta["ratio"] is None and ok.meta["hashes"] == REQ


HASHES = st.sampled_from(REQ + [0, 1, 999, 1 << 63])
VALUES = st.none() | st.booleans() | st.integers(-5, 2**64 + 1) | st.floats() | st.text(max_size=4)


def _fuzzed_blob():
    return st.fixed_dictionaries(
        {
            "size": st.integers(-1, 200) | VALUES,
            "first": st.integers(-1, 4) | VALUES,
            "count": st.integers(-1, 7) | VALUES,
            "j": st.integers(-1, 7) | VALUES,
            "meta": st.fixed_dictionaries(
                {"hashes": st.lists(HASHES | VALUES, max_size=9) | st.permutations(REQ)},
                optional={k: VALUES | st.integers(0, 64) for k in ("block_size", "first_position", "ratio", "cal",
                                                                  "raw_bytes", "id")},
            )
            | VALUES,
            "descs": st.lists(st.lists(st.integers(-1, 300) | VALUES, min_size=2, max_size=2), max_size=3) | VALUES,
        },
        optional={"ranges": st.lists(st.integers(-1, 200) | VALUES, max_size=3) | VALUES},
    )  # fmt: skip


@settings(FUZZ, max_examples=600)
@given(st.fixed_dictionaries({"blobs": st.lists(_fuzzed_blob(), max_size=4) | VALUES}), st.integers(1, 6))
def test_fuzzed_replies_are_refused_or_keep_only_requested_hashes(reply, n):
    """Any reply: TransferError, or runs that tile exactly the requested blocks in order, whose kept metadata (what
    the store adopts) names exactly the requested hashes it covers, with an id derived from them."""
    hashes = REQ[:n]
    try:
        runs, remote = messages.plan_reply(reply, hashes)
    except TransferError:
        return
    at = 0
    for r, b in zip(runs, reply["blobs"]):
        assert r.at == at and b["meta"]["hashes"][r.first : r.first + r.count] == hashes[at : at + r.count]
        if r.meta is not None:
            assert r.meta["hashes"] == hashes[at : at + r.count] and r.first == 0
            assert r.meta["id"] == f"{hashes[at]:016x}{hashes[at + r.count - 1]:016x}"
            assert r.meta["stored_bytes"] == r.size
        at += r.count
    assert at == n


@st.composite
def _near_valid(draw):
    """(reply, requested): a well-formed reply — runs tiling the request, blobs holding other blocks before and after
    the requested ones, metadata fields in range — then, maybe, one field or one hash changed."""
    n = draw(st.integers(1, 6))
    hashes, blobs, j = REQ[:n], [], 0
    while j < n:
        count = draw(st.integers(1, n - j))
        before = draw(st.lists(st.sampled_from([1, 2, 999]), max_size=2))
        after = draw(st.lists(st.sampled_from([3, 4, 998, *REQ]), max_size=2))
        size = draw(st.integers(1, 300))
        cut = draw(st.integers(1, size))
        descs = [[4096, cut], [8192, size - cut]] if cut < size else [[4096, size]]
        meta = _meta(before + hashes[j : j + count] + after, ratio=draw(st.none() | st.floats(0.5, 64)))
        blobs.append({"size": size, "first": len(before), "count": count, "j": j, "meta": meta, "descs": descs})
        j += count
    if draw(st.booleans()):  # one lie
        b = draw(st.sampled_from(blobs))
        where = draw(st.sampled_from(["size", "first", "count", "j", "hash", "meta"]))
        if where == "hash":
            held = b["meta"]["hashes"]
            held[draw(st.integers(0, len(held) - 1))] = draw(HASHES | VALUES)
        elif where == "meta":
            b["meta"][draw(st.sampled_from(sorted(b["meta"])))] = draw(VALUES)
        else:
            b[where] = draw(st.integers(-1, 8) | VALUES)
    return {"blobs": blobs}, hashes


@settings(FUZZ, max_examples=600)
@given(_near_valid())
def test_fuzzed_near_valid_replies_keep_only_requested_hashes(case):
    """Replies one lie away from valid: refused, or accepted with kept metadata naming only requested hashes (the
    blobs' extra blocks before and after are never kept), and a lie in a run's hashes is never accepted."""
    reply, hashes = case
    try:
        runs, _ = messages.plan_reply(reply, hashes)
    except TransferError:
        return
    at = 0
    for r, b in zip(runs, reply["blobs"]):
        assert b["meta"]["hashes"][r.first : r.first + r.count] == hashes[at : at + r.count]
        assert r.meta is None or (r.meta["hashes"] == hashes[at : at + r.count] and r.first == 0)
        at += r.count
    assert at == len(hashes)


def test_near_valid_replies_are_mostly_accepted_and_kept():
    """The strategy reaches the accepting paths (a fuzz target that is all refusals tests nothing)."""
    seen = {"accepted": 0, "kept": 0, "trimmed": 0}

    @settings(FUZZ, max_examples=200)
    @given(_near_valid())
    def count(case):
        reply, hashes = case
        try:
            runs, _ = messages.plan_reply(reply, hashes)
        except TransferError:
            return
        seen["accepted"] += 1
        seen["kept"] += sum(r.meta is not None for r in runs)
        seen["trimmed"] += sum(
            r.meta is not None and len(b["meta"]["hashes"]) > r.count for r, b in zip(runs, reply["blobs"])
        )

    count()
    assert seen["accepted"] > 50 and seen["kept"] > 20 and seen["trimmed"] > 5, seen


def test_when_the_fallback_fails_too_the_hook_answers_its_default():
    from dynamo_kvtc.connector.vllm import guard

    c = _connector(None)  # no scheduler at all: the hook and its fallback both raise AttributeError
    before = guard.FAULTS["build_connector_meta_fallback"]
    meta = c.build_connector_meta(_empty_output())
    assert isinstance(meta, vllm.KvtcConnectorMetadata) and not meta.plan.loads
    assert meta is not c.build_connector_meta(_empty_output())  # a fresh one each time
    assert c.get_num_new_matched_tokens(_req({}), 0) == (0, False)
    assert c.request_finished(_req({}), []) == (False, None)
    assert c.update_state_after_alloc(_req({}), Blocks(1), 16) is None
    assert guard.FAULTS["build_connector_meta_fallback"] == before + 2


def test_a_lease_is_unguessable_and_only_its_fetching_peer_may_release_it():
    from dynamo_kvtc.connector.handoff.server import HandoffServer

    given_back = []
    arena = SimpleNamespace(give=given_back.append)
    srv = HandoffServer.__new__(HandoffServer)  # only the lease table is under test here
    srv._leases = {"a" * 32: (arena, float("inf"), "decode-1")}
    assert srv._handle({"op": "release", "lease": "a" * 32, "agent": "intruder"}) == {"ok": False}
    assert given_back == [] and srv.open_leases == 1
    assert srv._handle({"op": "release", "lease": "b" * 32, "agent": "decode-1"}) == {"ok": False}
    assert srv._handle({"op": "release", "lease": "a" * 32, "agent": "decode-1"}) == {"ok": True}
    assert given_back == ["a" * 32] and srv.open_leases == 0
