"""Engine-side queue faults: saves arriving faster than the encoder runs, restores timed out while they write, and
slow peer restores beside host hits.

Each scenario runs a real :class:`~dynamo_kvtc.tiers.KvtcStore` over a real paged KV cache in the engine's layout
(CPU tensors; lossless, so every restored block is compared bit for bit with the world's reference):

- ``offload_queue``: a burst of saves copied out of a small ring of engine blocks, each ring slot overwritten by the
  next save at once (as vLLM reuses blocks), with an offload queue budget of two saves, the encoder stalled for the
  first half of the burst (it fell behind). Saves over the budget are
  skipped before anything is copied (``faults_injected``; ``faults_detected`` when the store counted them, a
  ``recomputes`` each: a later miss); the queue's peak must stay within the budget; every stored sequence must restore
  exactly (``wrong_kv_served`` otherwise, e.g. a copy that was not one).
- ``restore_cancel``: a restore into engine blocks given up on, either while its blobs are still coming (a slow peer)
  or while it writes (cancelled as soon as a random layer is in place). Nothing may change in the destination after
  :meth:`~dynamo_kvtc.tiers.OnboardHandle.cancel` returned (each block changed is ``wrong_kv_served``: a write into
  blocks that may belong to another request by then), and every layer reported ready must hold the right KV.
- ``slow_restore``: a peer restore stuck on a slow peer; a host hit started after it must complete while it is still
  stuck (``faults_detected``: the host hit was unaffected; a problem otherwise), and the slow one must still restore
  exactly once its peer answers.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import torch

from ..errors import KvtcError
from ..tiers import KvtcStore, PagedKV
from ..tiers.keys import sequence_hashes
from .ledger import Ledger
from .testbed import BS, SPAN, Sink, World, close_store, offload, tier_config

SENTINEL = 3.0
WAIT_S = 60.0  # a deadline no healthy step here comes near; passing it is a hang (a crash)


def engine_store(world: World, blocks: int, **kw) -> tuple[KvtcStore, list[torch.Tensor]]:
    """A lossless store over a paged KV cache of ``blocks`` blocks in vLLM's FlashAttention layout, filled with a
    sentinel value."""
    caches = [torch.full((2, blocks, BS, world.H, world.D), SENTINEL, dtype=torch.bfloat16) for _ in range(world.L)]
    kv = PagedKV(caches, "flash", BS)
    store = KvtcStore(world.cal, tier_config(True, 16 << 20, **kw), block_size=BS, span_tokens=SPAN, kv=kv)
    return store, caches


class SlowPeer:
    """A peer that answers late: its runs (read from ``store``) come once :meth:`answer` is called."""

    def __init__(self, store: KvtcStore, hashes: list[int]) -> None:
        self.store, self.hashes = store, hashes
        self.asked = threading.Event()
        self._go = threading.Event()

    def __call__(self):
        self.asked.set()
        if not self._go.wait(WAIT_S):
            raise KvtcError("the slow peer was never let go")
        return self.store.export(self.hashes)[0]

    def answer(self) -> None:
        self._go.set()


def _changed_blocks(before: list[torch.Tensor], after: list[torch.Tensor], blocks: list[int]) -> int:
    """Engine blocks (of ``blocks``) whose K or V differ in any layer between two snapshots."""
    return sum(any(not torch.equal(b[:, i], a[:, i]) for b, a in zip(before, after)) for i in blocks)


def _wrong_layers(world: World, caches: list[torch.Tensor], hashes: list[int], dst: list[int], layers) -> int:
    """Blocks of the given layers that differ from the reference KV."""
    k, v = world.seq_kv(hashes)
    wrong = 0
    for layer in layers:
        for j, b in enumerate(dst):
            t = slice(j * BS, (j + 1) * BS)
            dk, dv = caches[layer][0, b], caches[layer][1, b]
            wrong += not (torch.equal(dk, k[layer, t]) and torch.equal(dv, v[layer, t]))
    return wrong


# ====================================================================================================== offload
def _copier(kv: PagedKV, ring: list[int], copies: list[int]) -> Callable[[], tuple[torch.Tensor, torch.Tensor, None]]:
    """The worker's copy out of the engine's blocks (called by the store only once a save is admitted)."""

    def copy() -> tuple[torch.Tensor, torch.Tensor, None]:
        copies.append(1)
        k, v = kv.gather(ring)
        return k, v, None

    return copy


def scenario_offload_queue(world: World, ledger: Ledger, rounds: int, saves: int = 16, blocks: int = 8) -> None:
    kind = "offload_queue"
    one = blocks * BS * world.cal.fingerprint.raw_bytes_per_token(torch.bfloat16)
    budget = 2 * one
    for r in range(rounds):
        store, caches = engine_store(world, blocks, offload_queue_bytes=budget)
        kv, ring = store.kv, list(range(blocks))
        stall = threading.Event()  # the encoder falls behind: stalled for the first half of the burst
        try:
            futures: list[tuple[list[int], object]] = []
            copies: list[int] = []  # one entry per copy made
            copy = _copier(kv, ring, copies)
            burst = []
            for s in range(saves):  # the KV the engine computes, made before the burst
                toks = world.tokens(("queue", r, s), blocks * BS)
                hashes = sequence_hashes(toks, BS)
                burst.append((toks, hashes, *world.seq_kv(hashes)))
            store.offloader._pool.submit(stall.wait, WAIT_S)
            for s, (toks, hashes, k, v) in enumerate(burst):
                if s == saves // 2:
                    stall.set()
                for layer in range(world.L):  # the engine computed this sequence into the ring's blocks
                    kv.scatter_layer(layer, ring, k[layer], v[layer])

                futures.append((hashes, store.submit_offload(hashes, toks, copy=copy, tail=True)))
            results = [(h, f.result(WAIT_S)) for h, f in futures]
            skipped = [h for h, res in results if res.skipped == "queue_full"]
            ledger.add(kind, faults_injected=len(skipped), recomputes=len(skipped))
            ledger.add(kind, faults_detected=min(len(skipped), store.stats.offload_queue_full))
            ledger.detail(kind, saves=saves, skipped_saves=len(skipped), copies=len(copies))
            if len(copies) != saves - len(skipped):
                ledger.problem(kind, f"round {r}: {len(copies)} copies for {saves - len(skipped)} admitted saves")
            peak = store.offloader.budget.peak
            d = ledger.details.setdefault(kind, {})  # maxima, not sums
            d["peak_queue_bytes"], d["queue_budget_bytes"] = max(peak, d.get("peak_queue_bytes", 0)), budget
            if peak > budget:
                ledger.problem(kind, f"round {r}: the queue held {peak} bytes, over its budget of {budget}")
            for hashes, res in results:
                if res.skipped == "queue_full":
                    if store.match(hashes):
                        ledger.problem(kind, f"round {r}: a skipped save was stored anyway")
                    continue
                sink = Sink(world.L, blocks * BS, world.H, world.D)
                h = store.start_onboard(hashes, sink=sink)
                if not h.wait(WAIT_S):
                    ledger.add(kind, recomputes=1, crashes=int(h.error is None))
                    ledger.problem(kind, f"round {r}: a stored sequence did not restore: {h.error}")
                    continue
                k, v = world.seq_kv(hashes)
                wrong = sum(
                    not (torch.equal(sink.k[:, b * BS : (b + 1) * BS], k[:, b * BS : (b + 1) * BS])
                         and torch.equal(sink.v[:, b * BS : (b + 1) * BS], v[:, b * BS : (b + 1) * BS]))
                    for b in range(blocks)
                )  # fmt: skip
                if wrong:
                    ledger.add(kind, wrong_kv_served=wrong)
                    ledger.problem(kind, f"round {r}: {wrong} blocks of a queued save restored wrong")
        finally:
            stall.set()
            close_store(store)


# ====================================================================================================== cancel
def scenario_restore_cancel(world: World, ledger: Ledger, rounds: int) -> None:
    kind = "restore_cancel"
    rng = random.Random(f"{world.seed}/cancel")
    nb = 16
    for r in range(rounds):
        store, caches = engine_store(world, 2 * nb)
        try:
            hashes, _ = offload(world, store, world.tokens(("cancel", r), nb * BS))
            dst = rng.sample(range(2 * nb), nb)
            mode = "while_fetching" if r % 2 == 0 else "while_writing"
            peer = SlowPeer(store, hashes)
            h = store.start_onboard(hashes, dst, source=peer if mode == "while_fetching" else None)
            if mode == "while_fetching":
                if not peer.asked.wait(WAIT_S):
                    raise KvtcError("the restore never asked its peer")
                cancelled = h.cancel(WAIT_S)
            else:
                stop = rng.randrange(world.L - 1)
                try:
                    h.wait_layer(stop, timeout=WAIT_S)  # the layer is in place: cancel while later ones are written
                except KvtcError:
                    pass
                cancelled = h.cancel(WAIT_S)
            before = [c.clone() for c in caches]
            peer.answer()
            h.wait(WAIT_S)
            ended = h.finished
            if not cancelled or not ended:
                ledger.add(kind, faults_injected=1, crashes=1)
                ledger.problem(kind, f"round {r} ({mode}): cancel {cancelled}, restore ended {ended}")
                continue
            late = _changed_blocks(before, caches, dst)
            untouched = _changed_blocks(before, caches, [b for b in range(2 * nb) if b not in dst])
            ready = [i for i, t in enumerate(h.ready_times) if t is not None]
            wrong = _wrong_layers(world, caches, hashes, dst, ready)
            ledger.detail(kind, **{f"{mode}_rounds": 1, "layers_written_before_cancel": len(ready)})
            if late or untouched or wrong:
                ledger.add(kind, wrong_kv_served=late + untouched + wrong)
                ledger.detail(kind, writes_after_cancel=late + untouched)
                ledger.problem(kind, f"round {r} ({mode}): {late + untouched} blocks written after the cancel, "
                                     f"{wrong} ready blocks wrong")  # fmt: skip
            if h.ok:  # finished all layers before the cancel: a served restore, no fault
                ledger.detail(kind, finished_before_cancel=1)
            else:  # cut short: the request recomputes
                ledger.add(kind, faults_injected=1, faults_detected=1, recomputes=1)
        finally:
            close_store(store)


# ====================================================================================================== lanes
def scenario_slow_restore(world: World, ledger: Ledger, rounds: int) -> None:
    kind = "slow_restore"
    for r in range(rounds):
        store, _ = engine_store(world, 4)
        peer: SlowPeer | None = None
        try:
            slow_hashes, _ = offload(world, store, world.tokens(("slow", r), 12 * BS))
            host_hashes, _ = offload(world, store, world.tokens(("hit", r), 6 * BS))
            peer = SlowPeer(store, slow_hashes)
            slow_sink = Sink(world.L, 12 * BS, world.H, world.D)
            slow = store.start_onboard(slow_hashes, sink=slow_sink, source=peer)
            ledger.add(kind, faults_injected=1)
            if not peer.asked.wait(WAIT_S):
                raise KvtcError("the slow restore never asked its peer")
            sink = Sink(world.L, 6 * BS, world.H, world.D)
            hit = store.start_onboard(host_hashes, sink=sink)
            ok = hit.wait(WAIT_S)
            stuck = not slow.finished
            peer.answer()
            _check(world, ledger, kind, r, "host hit", ok, hit.error, host_hashes, sink)
            if ok and stuck:
                ledger.add(kind, faults_detected=1)
                ledger.detail(kind, host_hits_beside_slow=1)
            else:
                ledger.detail(kind, host_hits_delayed=1)
                ledger.problem(kind, f"round {r}: the host hit did not complete beside the slow restore")
            _check(world, ledger, kind, r, "slow restore", slow.wait(WAIT_S), slow.error, slow_hashes, slow_sink)
        finally:
            if peer is not None:
                peer.answer()
            close_store(store)


def _check(world: World, ledger: Ledger, kind: str, r: int, what: str, ok: bool, error, hashes, sink: Sink) -> None:
    if not ok:
        ledger.add(kind, recomputes=1, crashes=int(error is None))
        ledger.problem(kind, f"round {r}: {what} failed: {error}")
        return
    k, v = world.seq_kv(hashes)
    if not (torch.equal(sink.k, k) and torch.equal(sink.v, v)):
        ledger.add(kind, wrong_kv_served=1)
        ledger.problem(kind, f"round {r}: {what} restored wrong KV")


SCENARIOS: dict[str, Callable[[World, Ledger, int], None]] = {
    "offload_queue": scenario_offload_queue,
    "restore_cancel": scenario_restore_cancel,
    "slow_restore": scenario_slow_restore,
}
