"""Block keys compatible with Dynamo's KV-aware router.

Dynamo hashes each full block of ``block_size`` tokens with XXH3-64 (seed 1337) over the tokens as little-endian
uint32 (``dynamo.llm.compute_block_hash_for_seq``), and chains them into sequence hashes: the first block's sequence
hash is its block hash, each next one is XXH3-64 (seed 1337) of the little-endian pair (parent, block hash). A sequence
hash therefore names a block *and its whole prefix*, which is what a KV cache block depends on.

When ai-dynamo-runtime is installed its function computes the block hashes; otherwise the same algorithm runs here
(tests check both give equal results). Router events take signed 64-bit integers: see :func:`to_signed`.

Tenants. KV also depends on what is not in the token ids: the cache salt, the LoRA adapter, multimodal inputs behind
placeholder tokens. A :class:`TenantKey` names those; a request with an empty one keeps the plain chain above (so the
router's own hashes still match the tier's events), any other request's chain is seeded by the key's digest
(:func:`sequence_hashes` with ``tenant=``), so no block key of one tenant ever equals another's (short of a 64-bit
collision). The digest is conservative: it covers the whole request's salt, adapter and every multimodal item, so two
requests share blocks only when all of these are equal.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import xxhash

SEED = 1337
TENANT_DOMAIN = "dynamo-kvtc/tenant/v1"  # versions the digest: a change of its inputs must change this


@dataclass(frozen=True)
class TenantKey:
    """Everything besides the token ids that makes a request's KV differ (one value per request).

    ``mm`` holds one ``(identifier, offset, length)`` per multimodal item, in prompt order. An empty key (no salt, no
    adapter, no multimodal input) means "plain tokens": its chain is Dynamo's. It never holds KV or tokens."""

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    lora_path: str | None = None
    mm: tuple[tuple[str, int, int], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.cache_salt or self.lora_name or self.lora_id or self.lora_path or self.mm)

    def digest(self) -> int:
        """The 64-bit seed of this tenant's chain (XXH3-64 of a domain-tagged msgpack of every field)."""
        payload = msgpack.packb(
            [
                TENANT_DOMAIN,
                self.cache_salt,
                self.lora_name,
                self.lora_id,
                self.lora_path,
                [[str(i), int(o), int(n)] for i, o, n in self.mm],
            ]
        )
        return xxhash.xxh3_64_intdigest(payload, seed=SEED)

    def root(self) -> int | None:
        """The parent of the first block: None for the plain chain, the digest otherwise."""
        return None if self.empty else self.digest()


def _dynamo_block_hashes():
    try:
        from dynamo.llm import compute_block_hash_for_seq
    except Exception:  # not installed, or its native module cannot load here
        return None
    return compute_block_hash_for_seq


def block_hashes(tokens: Sequence[int], block_size: int, *, use_dynamo: bool = True) -> list[int]:
    """One unsigned 64-bit hash per full block (a partial tail block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    fn = _dynamo_block_hashes() if use_dynamo else None
    if fn is not None:
        return [int(h) for h in fn([int(t) for t in tokens], block_size)]
    n = len(tokens) // block_size
    fmt = f"<{block_size}I"
    return [
        xxhash.xxh3_64_intdigest(struct.pack(fmt, *tokens[i * block_size : (i + 1) * block_size]), seed=SEED)
        for i in range(n)
    ]


def chain(block_hashes_: Sequence[int], parent: int | None = None) -> list[int]:
    """Sequence hashes from block hashes (optionally continuing after ``parent``)."""
    out: list[int] = []
    prev = parent
    for h in block_hashes_:
        prev = h if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, h), seed=SEED)
        out.append(prev)
    return out


def sequence_hashes(
    tokens: Sequence[int], block_size: int, *, use_dynamo: bool = True, tenant: TenantKey | None = None
) -> list[int]:
    """The chained sequence hash of every full block of ``tokens``: the tier's block keys. With a non-empty
    ``tenant`` the chain starts from the tenant's digest (every key differs from the plain chain's)."""
    return chain(block_hashes(tokens, block_size, use_dynamo=use_dynamo), tenant.root() if tenant else None)


def to_signed(h: int) -> int:
    """Unsigned 64-bit hash -> the signed value Dynamo's KvEventPublisher expects."""
    return h - (1 << 64) if h >= (1 << 63) else h
