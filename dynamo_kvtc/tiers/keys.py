"""Block keys: 128-bit chained hashes of a request's tokens, per tenant.

A block key names a block of ``block_size`` tokens *and its whole prefix*, which is what a KV cache block depends on:
each full block's tokens (little-endian uint32) are hashed (:func:`block_hashes`), and the block hashes are chained
into sequence hashes (:func:`chain`): the first block's key is its block hash (or, for a tenant, the hash of the
tenant's root and its block hash), each next one the hash of (parent key, block hash). Every hash is SHA-256 over a
domain-tagged input, truncated to 128 bits (vLLM's own prefix cache also hashes blocks with SHA-256). Keys are Python
ints in ``[0, 2**128)``. At 128 bits no two distinct prefixes share a key by accident, and SHA-256 leaves no shortcut
to a chosen collision (a 64-bit key with a public seed, as the tier used before, does: a birthday search of ~2**32).

Every blob stores the keys of the blocks it holds (the ``keys`` field of its header, docs/format.md), and a restore
checks them against the keys it asked for (:func:`check_blob_keys`): a blob that answers for other keys (a wrong index
entry, a file copied under another blob's name) is a counted miss, never served.

Router events. Dynamo's KV router and vLLM's event stream carry signed/unsigned 64-bit block hashes; the events carry
:func:`router_hash` of each key (its top 64 bits). The router indexes blocks by its own hash of the event's tokens and
uses these values only to link a block to its parent, so a 64-bit projection is all it needs.

Tenants. KV also depends on what is not in the token ids: the cache salt, the LoRA adapter, multimodal inputs behind
placeholder tokens. A :class:`TenantKey` names those; a request with an empty one keeps the plain chain above, any
other request's chain is seeded by the key's digest (:func:`sequence_hashes` with ``tenant=``), so no block key of
one tenant ever equals another's. The digest is conservative: it covers the whole request's salt, adapter and every
multimodal item, so two requests share blocks only when all of these are equal.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from ..codec.container import blob_keys, with_keys
from ..errors import BlobKeyError

if TYPE_CHECKING:
    from ..codec.blob import BlobView

KEY_BITS = 128
KEY_BYTES = KEY_BITS // 8
TENANT_DOMAIN = "dynamo-kvtc/tenant/v2"  # versions the digest: a change of its inputs must change this
_BLOCK = b"dynamo-kvtc/block/v2\0"
_CHAIN = b"dynamo-kvtc/chain/v2\0"
_MASK64 = (1 << 64) - 1
_BLOCK_HASH = hashlib.sha256(_BLOCK)  # copied per block: the domain tag is hashed once
_CHAIN_HASH = hashlib.sha256(_CHAIN)


def _h128(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:KEY_BYTES], "big")


def is_key(h: object) -> bool:
    """Whether ``h`` is a block key (an int in ``[0, 2**128)``, not a bool): for checks where keys enter."""
    return isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << KEY_BITS


@dataclass(frozen=True)
class TenantKey:
    """Everything besides the token ids that makes a request's KV differ (one value per request).

    ``mm`` holds one ``(identifier, offset, length)`` per multimodal item, in prompt order. An empty key (no salt, no
    adapter, no multimodal input) means "plain tokens". It never holds KV or tokens."""

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    lora_path: str | None = None
    mm: tuple[tuple[str, int, int], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.cache_salt or self.lora_name or self.lora_id or self.lora_path or self.mm)

    def digest(self) -> int:
        """The 128-bit seed of this tenant's chain (SHA-256 of a domain-tagged msgpack of every field)."""
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
        return _h128(payload)

    def root(self) -> int | None:
        """The parent of the first block: None for the plain chain, the digest otherwise."""
        return None if self.empty else self.digest()


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """One 128-bit hash per full block of ``tokens`` (a partial tail block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(tokens) // block_size
    words = array("I", tokens[: n * block_size])  # uint32; OverflowError for a token outside [0, 2**32)
    if sys.byteorder != "little":
        words.byteswap()
    data, step = memoryview(words.tobytes()), 4 * block_size
    out = []
    for i in range(n):
        h = _BLOCK_HASH.copy()
        h.update(data[i * step : (i + 1) * step])
        out.append(int.from_bytes(h.digest()[:KEY_BYTES], "big"))
    return out


def chain(block_hashes_: Sequence[int], parent: int | None = None) -> list[int]:
    """Sequence hashes (the block keys) from block hashes, optionally continuing after ``parent``."""
    out: list[int] = []
    prev = parent
    for h in block_hashes_:
        if prev is not None:
            c = _CHAIN_HASH.copy()
            c.update(prev.to_bytes(KEY_BYTES, "big") + h.to_bytes(KEY_BYTES, "big"))
            h = int.from_bytes(c.digest()[:KEY_BYTES], "big")
        out.append(h)
        prev = h
    return out


def sequence_hashes(tokens: Sequence[int], block_size: int, *, tenant: TenantKey | None = None) -> list[int]:
    """The chained key of every full block of ``tokens``: the tier's block keys. With a non-empty ``tenant`` the
    chain starts from the tenant's digest (every key differs from the plain chain's)."""
    return chain(block_hashes(tokens, block_size), tenant.root() if tenant else None)


def router_hash(h: int) -> int:
    """A block key's unsigned 64-bit projection (its top 64 bits): the hash KV events carry to the router."""
    return (h >> (KEY_BITS - 64)) & _MASK64


def to_signed(h: int) -> int:
    """Unsigned 64-bit hash -> the signed value Dynamo's KvEventPublisher expects."""
    return h - (1 << 64) if h >= (1 << 63) else h


def keys_to_bytes(keys: Sequence[int]) -> bytes:
    """Block keys as the blob header's ``keys`` field: 16 big-endian bytes per key, in order."""
    return b"".join(int(k).to_bytes(KEY_BYTES, "big") for k in keys)


def keys_from_bytes(b: bytes | memoryview) -> list[int]:
    if len(b) % KEY_BYTES:
        raise ValueError(f"a key list of {len(b)} bytes is not a multiple of {KEY_BYTES}")
    return [int.from_bytes(b[i : i + KEY_BYTES], "big") for i in range(0, len(b), KEY_BYTES)]


def keyed_blob(blob: bytes | memoryview, keys: Sequence[int]) -> bytes:
    """``blob`` with the keys of its blocks stored in its header (a copy: the header grows by 16 bytes a block)."""
    return with_keys(blob, keys_to_bytes(keys))


def check_blob_keys(blob: BlobView, first: int, wanted: Sequence[int]) -> None:
    """Raise :class:`~dynamo_kvtc.errors.BlobKeyError` unless blocks ``first .. first + len(wanted)`` of ``blob`` (a
    :class:`~dynamo_kvtc.codec.blob.BlobView`: host, device, or a peer's still landing — then only its header is waited
    for, :meth:`~dynamo_kvtc.codec.blob.BlobView.header`) carry exactly the keys ``wanted`` (its header's ``keys``
    field); a blob without keys is refused the same way. CorruptBlobError when the header does not parse."""
    stored = blob_keys(blob.header())
    if stored is None:
        raise BlobKeyError("blob carries no block keys (written by an older version); refused")
    got = stored[first * KEY_BYTES : (first + len(wanted)) * KEY_BYTES]
    if got != keys_to_bytes(wanted):
        raise BlobKeyError(
            f"blob holds other blocks than the {len(wanted)} requested at block {first} (a key collision, a wrong "
            "index entry or a peer's reply naming blocks it does not hold); refused"
        )
