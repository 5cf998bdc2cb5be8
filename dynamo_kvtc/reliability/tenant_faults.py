"""Cross-tenant lookups: the same tokens stored under one tenant's keys and asked for under another's.

Tenants are what vLLM separates KV by: a cache salt, a LoRA adapter (name, id, path), multimodal inputs. A block keyed
for tenant A and looked up for tenant B (or for a plain request) must be a miss; serving it would be a data leak and a
wrong answer at once. Each cross-tenant lookup is one injected fault: detected when it misses, a ``wrong_kv_served``
block for every block it restores. The owner's own lookup must still restore exactly (lossless store).
"""

from __future__ import annotations

import random

from ..tiers.keys import TenantKey, sequence_hashes
from .ledger import Ledger
from .testbed import BS, Expect, World, close_store, make_store, restore


def _tenants(r: int) -> list[TenantKey]:
    """Tenants that differ in one field each (and the plain, tenant-less request)."""
    return [
        TenantKey(cache_salt=f"tenant-{r}-A"),
        TenantKey(cache_salt=f"tenant-{r}-B"),
        TenantKey(lora_name="adapter-1", lora_id=1, lora_path="/lora/1"),
        TenantKey(lora_name="adapter-1", lora_id=2, lora_path="/lora/1"),
        TenantKey(mm=(("image-hash-1", 3 * BS, 40),)),
        TenantKey(mm=(("image-hash-2", 3 * BS, 40),)),
        TenantKey(),
    ]


def scenario_tenant_keys(world: World, ledger: Ledger, rounds: int = 3) -> None:
    kind = "tenant_keys"
    rng = random.Random(f"{world.seed}/tenants")
    store = make_store(world, True, host=32 << 20)
    expect = Expect(world, True)
    try:
        for r in range(rounds):
            tokens = world.tokens(("tenants", r), rng.randint(4, 10) * BS)
            tenants = _tenants(r)
            keys = [sequence_hashes(tokens, BS, tenant=t) for t in tenants]
            owner = rng.randrange(len(tenants))
            k, v = world.seq_kv(keys[owner])
            res = store.submit_offload(keys[owner], tokens, keys=k, values=v, tail=True).result(60)
            if res.stored_blocks != len(keys[owner]):
                ledger.problem(kind, f"round {r}: the owner's offload stored {res.stored_blocks} blocks: {res.skipped}")
                continue
            for i, other in enumerate(keys):
                if i == owner:
                    continue
                ledger.add(kind, faults_injected=1)
                matched = store.match(other)
                if matched == 0:
                    ledger.add(kind, faults_detected=1)
                    continue
                out = restore(world, store, other[:matched])  # whatever it would be served is another tenant's KV
                ledger.add(kind, wrong_kv_served=matched if out.ok else 0)
                ledger.problem(kind, f"round {r}: tenant {i} matched {matched} blocks of tenant {owner}")
            out = restore(world, store, keys[owner])  # the owner still gets its own KV back, exactly
            if out.ok:
                wrong, _ = expect.check(keys[owner], 0, out.k, out.v)
                ledger.add(kind, wrong_kv_served=wrong)
                ledger.detail(kind, owner_restores_ok=1)
            else:
                ledger.problem(kind, f"round {r}: the owner's restore failed: {out.error}")
    finally:
        close_store(store)
