"""Hostile clients and peers of the hand-off: malformed ``kvtc_*`` request params through the scheduler's hooks, a
prefill peer that poisons (blobs or metadata for blocks nobody asked for, at other positions, another prompt's KV under
the requested keys) and one that stalls. Each must cost a miss (recompute) and nothing else: no wrong KV, no
exception into the engine, no block planted in the decode side's index, other requests unaffected."""

from __future__ import annotations

import functools
import random
import secrets
import threading
import time
from types import SimpleNamespace
from typing import Any

from ..tiers.keys import sequence_hashes
from .ledger import Ledger
from .testbed import BS, Expect, Outcome, World, account_faulted_restore, close_store, make_store, restore
from .transfer_faults import in_process_peers, transfer_sequences

POISON_MODES = ("foreign_kv", "planted", "shifted", "other_hashes")


def _planted(n: int) -> list[int]:
    return [secrets.randbits(127) | 1 << 100 for _ in range(n)]  # 128-bit keys nobody stored


def poisoning_server(cfg: Any, store: Any, mode: str, device: Any = None) -> Any:
    """A :class:`HandoffServer` that answers every fetch with a real blob of another prompt it holds (same
    calibration, well-formed) described as covering the requested blocks (``foreign_kv``), followed by extra blocks
    nobody asked for (``planted``), with the requested blocks one position later inside the blob (``shifted``), or
    naming other blocks altogether (``other_hashes``). The keys it invents are kept in ``planted``: none of them may
    ever be indexed by the decode side."""
    from ..connector.handoff.messages import check_fetch, fetch_mem
    from ..connector.handoff.server import HandoffServer
    from ..errors import TierError

    if mode not in POISON_MODES:
        raise ValueError(f"mode must be one of {POISON_MODES}")

    class PoisoningServer(HandoffServer):
        planted: list[int]

        def _fetch(self, msg: dict[str, Any]) -> dict[str, Any]:
            hashes, peer, md = check_fetch(msg)
            mine = set(hashes)
            metas = self.store.index.metas()
            if not metas:
                raise TierError("the poisoning peer holds no blob")
            other = min(metas, key=lambda m: len(mine & set(m.hashes))).hashes  # another prompt's blob
            reply = self._stage(list(other), peer, md, self.arena(fetch_mem(msg)))
            b = reply["blobs"][0]
            reply["blobs"] = [b]  # one blob claimed to cover every requested block
            extra = _planted(max(3, len(hashes)))
            self.planted.extend(extra)
            held = {
                "foreign_kv": list(hashes),
                "planted": [*hashes, *extra[:3]],
                "shifted": [extra[0], *hashes],
                "other_hashes": extra[: len(hashes)],
            }[mode]
            b.update(first=1 if mode == "shifted" else 0, count=len(hashes), j=0)
            b["meta"] = {**b["meta"], "hashes": held}
            return reply

    srv = PoisoningServer(cfg, store, device)
    srv.planted = []
    return srv


def _indexed(store: Any, keys: list[int]) -> int:
    return sum(store.index.locate(h) is not None for h in keys)


def scenario_poisoning_peer(world: World, ledger: Ledger, rounds: int) -> None:
    """A decode store fetches a prompt the poisoning peer does not hold (each mode in turn): the restore must fail
    (the blob's block keys or the reply's checks refuse it), nothing it named may be indexed, and an honest fetch
    from the same client right after restores bit for bit."""
    kind = "poisoning_peer"
    victim = transfer_sequences(world, 3)[2]
    vh = sequence_hashes(victim[: len(victim) // BS * BS], BS)
    dst = make_store(world, True, host=64 << 20)
    expect = Expect(world, True)
    try:
        with in_process_peers(world, "cpu", seqs=2) as (honest, client, seqs):
            for r in range(rounds):
                mode = POISON_MODES[r % len(POISON_MODES)]
                bad = poisoning_server(honest.cfg, honest.store, mode)
                try:
                    out = restore(world, dst, vh, 60, source=functools.partial(client.fetch, "127.0.0.1", bad.port, vh))
                    client.flush()
                    ledger.add(kind, faults_injected=1)
                    ledger.detail(kind, **{mode: 1})
                    account_faulted_restore(ledger, kind, mode, out, expect, vh)
                    leaked = _indexed(dst, bad.planted) + (0 if out.ok else _indexed(dst, vh))
                    if leaked:
                        ledger.add(kind, wrong_kv_served=leaked)
                        ledger.problem(kind, f"{mode}: {leaked} blocks the peer named were indexed")
                    if bad.open_leases:
                        ledger.problem(kind, f"{mode}: the client left {bad.open_leases} leases open")
                finally:
                    bad.close()
                hashes = sequence_hashes(seqs[r % 2][: len(seqs[r % 2]) // BS * BS], BS)
                fetch = functools.partial(client.fetch, "127.0.0.1", honest.port, hashes)
                out = restore(world, dst, hashes, 60, source=fetch)
                if out.ok:
                    ledger.add(kind, wrong_kv_served=expect.check(hashes, 0, out.k, out.v)[0])
                    ledger.detail(kind, clean_fetches_ok=1)
                else:
                    ledger.problem(kind, f"honest fetch after {mode} failed: {out.error}")
    finally:
        close_store(dst)


def slow_server(cfg: Any, store: Any, stall_s: float, device: Any = None) -> Any:
    """A :class:`HandoffServer` whose fetches stall ``stall_s`` (parked, then refused) — a peer that hangs — while
    its serving thread still answers releases."""
    from ..connector.handoff.messages import check_fetch
    from ..connector.handoff.server import HandoffServer
    from ..errors import TierError
    from ..transport.channel import Deferred

    class SlowServer(HandoffServer):
        def _fetch(self, msg: dict[str, Any]) -> Deferred:
            check_fetch(msg)
            until = time.monotonic() + stall_s

            def stalled() -> None:
                if time.monotonic() > until:
                    raise TierError("stalled")
                return None

            return Deferred(stalled)

    return SlowServer(cfg, store, device)


def scenario_slow_peer(world: World, ledger: Ledger, rounds: int, timeout: float = 1.0) -> None:
    """Decode worker A fetches from a peer that stalls; while A waits, worker B fetches from an honest peer and
    restores exactly, and the stalled peer answers a release. A's restore must fail within its deadline (a miss)."""
    from ..connector.config import ConnectorConfig, handoff_settings
    from ..connector.handoff.client import HandoffClient

    kind = "slow_peer"
    dst_a, dst_b = make_store(world, True, host=32 << 20), make_store(world, True, host=32 << 20)
    expect = Expect(world, True)
    try:
        with in_process_peers(world, "cpu", seqs=2, timeout=timeout) as (honest, client_b, seqs):
            client_a = HandoffClient(ConnectorConfig(transfer_timeout_s=timeout, **handoff_settings()), "cpu")
            slow = slow_server(honest.cfg, honest.store, 3 * timeout)
            try:
                for r in range(rounds):
                    toks = seqs[r % 2]
                    hashes = sequence_hashes(toks[: len(toks) // BS * BS], BS)
                    got: dict[str, Any] = {}

                    def a_fetch(h: list[int] = hashes, into: dict = got) -> None:
                        t = time.monotonic()
                        into["out"] = restore(
                            world, dst_a, h, 60, source=lambda: client_a.fetch("127.0.0.1", slow.port, h)
                        )
                        into["s"] = time.monotonic() - t  # fmt: skip

                    t = threading.Thread(target=a_fetch, daemon=True)
                    t.start()
                    ledger.add(kind, faults_injected=1)
                    fetch_b = functools.partial(client_b.fetch, "127.0.0.1", honest.port, hashes)
                    out = restore(world, dst_b, hashes, 60, source=fetch_b)
                    released = client_b._channel("127.0.0.1", slow.port).ask({"op": "release", "lease": "x" * 32})
                    during = t.is_alive()
                    t.join(10 * timeout)
                    _account_slow(ledger, kind, expect, hashes, out, got, during, released, timeout)
                    dst_a.wait_idle(10)
            finally:
                slow.close()
                client_a.close()
    finally:
        close_store(dst_a)
        close_store(dst_b)


def _account_slow(ledger, kind, expect, hashes, out: Outcome, got: dict, during: bool, released: dict, timeout):
    if out.ok:
        ledger.add(kind, wrong_kv_served=expect.check(hashes, 0, out.k, out.v)[0])
        ledger.detail(kind, other_fetch_ok_while_stalled=int(during))
    else:
        ledger.problem(kind, f"the honest fetch beside a stalled peer failed: {out.error}")
    if released != {"ok": False}:
        ledger.problem(kind, f"the stalled peer did not answer a release: {released}")
    a = got.get("out")
    if a is None:
        ledger.add(kind, crashes=1)
        ledger.problem(kind, "the restore from the stalled peer did not end")
        return
    account_faulted_restore(ledger, kind, "slow_peer", a, expect, hashes)
    ledger.detail(kind, stalled_restore_s_max=0)
    d = ledger.details[kind]
    d["stalled_restore_s_max"] = max(d["stalled_restore_s_max"], round(got["s"], 2))
    if got["s"] > 3 * timeout:
        ledger.problem(kind, f"the stalled fetch took {got['s']:.1f} s, past its {timeout:g} s deadline")


# ====================================================================================================== params
HOSTILE_PARAMS = (
    {"kvtc_blocks": "abc"}, {"kvtc_blocks": -3}, {"kvtc_blocks": 1 << 62}, {"kvtc_blocks": 2.5},
    {"kvtc_blocks": True}, {"kvtc_port": "x"}, {"kvtc_port": 0}, {"kvtc_port": [1, 2]}, {"kvtc_port": 1 << 20},
    {"kvtc_host": 5}, {"kvtc_host": ""}, {"kvtc_host": "a b/c*"}, {"kvtc_host": "h" * 300},
    {"kvtc_choice": "compressed", "kvtc_port": "x"}, {"kvtc_host": "10.255.0.1"},  # the last: well-formed, untrusted
)  # fmt: skip
_JUNK = (None, -1, 0, 2**64, 1.5, float("nan"), "", "x" * 70, "127.0.0.1", [1], {"a": 1}, True, b"\x00")


def scenario_hostile_params(world: World, ledger: Ledger, rounds: int) -> None:
    """Malformed or untrusted ``kvtc_*`` params (a fixed list, then seeded random values in every key) through a
    decode scheduler's hooks (match, alloc, step plan), each request followed by a well-formed one from a loopback
    peer: no hook raises, no malformed request is planned as a fetch, each refusal is counted once, and the
    well-formed request is still planned from its peer."""
    from ..connector.config import ConnectorConfig
    from ..connector.handoff import params
    from ..connector.vllm.remote_prefill import RemotePrefill
    from ..connector.vllm.scheduler import KvtcScheduler

    kind = "hostile_params"
    cfg = ConnectorConfig(transfer="decode")
    lookup = SimpleNamespace(match=lambda hashes: (0, 0), handoff_port=lambda: None)  # an empty local store
    sched = KvtcScheduler(cfg, BS, lookup, RemotePrefill(cfg, "engine-d", BS, lambda: None))
    rng = random.Random(world.seed)
    offer = {"do_remote_prefill": True, "kvtc_host": "127.0.0.1", "kvtc_port": 5555, "kvtc_blocks": 8}
    cases = [{**offer, **bad} for bad in HOSTILE_PARAMS]
    keys = ("kvtc_host", "kvtc_port", "kvtc_blocks", "kvtc_choice", "do_remote_prefill")
    while len(cases) < rounds:
        cases.append({**offer, **{k: rng.choice(_JUNK) for k in rng.sample(keys, rng.randint(1, 3))}})
    for i, p in enumerate(cases[: max(rounds, len(HOSTILE_PARAMS))]):
        before = sum(params.REFUSED.values())
        bad = _through_hooks(sched, f"bad-{i}", dict(p), ledger, kind)
        refused = sum(params.REFUSED.values()) - before
        good = _through_hooks(sched, f"good-{i}", dict(offer), ledger, kind)
        malformed = params.check(p)
        trusted = not isinstance(malformed, str) and params.trusted(malformed.host, None, False)
        asks = bool(p.get("do_remote_prefill"))
        expected_fetch = trusted and asks and malformed.blocks > 0
        hostile = asks and not trusted  # malformed or untrusted: must be refused
        ledger.add(kind, faults_injected=int(hostile))
        if bad is not None and not expected_fetch:
            ledger.add(kind, wrong_kv_served=1)
            ledger.problem(kind, f"params {p!r:.120} were planned as a fetch from {bad}")
        elif hostile:
            ledger.add(kind, faults_detected=int(refused == 1), recomputes=1)
            if refused != 1:
                ledger.problem(kind, f"params {p!r:.120} refused {refused} times (once expected)")
        if good != ("127.0.0.1", 5555):
            ledger.problem(kind, f"a well-formed request after {p!r:.80} was planned as {good}")
    ledger.detail(kind, refused_by_reason=dict(params.REFUSED))


def _through_hooks(sched: Any, rid: str, p: dict, ledger: Ledger, kind: str) -> tuple | None:
    """One request through the scheduler hooks; the peer its step plan fetches from, or None."""
    toks = list(range(1000, 1000 + 9 * BS + 3))
    req = SimpleNamespace(request_id=rid, kv_transfer_params=p, prompt_token_ids=toks, num_prompt_tokens=len(toks),
                          all_token_ids=toks, num_computed_tokens=0, lora_request=None, cache_salt=None)  # fmt: skip
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(100, 110)),))
    try:
        for _ in range(2):  # a waiting request is asked again every step
            ext, _asynchronous = sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, blocks, ext)
        plan = sched.build_meta(
            SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[],
                            scheduled_cached_reqs=SimpleNamespace(req_ids=[]))
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - an exception here would reach vLLM's engine loop
        ledger.add(kind, crashes=1)
        ledger.problem(kind, f"{rid}: {type(e).__name__} out of a scheduler hook: {e}")
        return None
    remote = [op.remote for op in plan.loads if op.req_id == rid and op.remote is not None]
    return remote[0] if remote else None
