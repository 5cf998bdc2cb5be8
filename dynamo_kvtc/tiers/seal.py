"""Sealing pool objects: AES-GCM under a key derived from the cluster secret, bound to what the object answers for.

Whoever reaches a Mooncake master can put or get any key, and a KV cache reveals its prompt. Every object the pool
tier (:mod:`.pool`) writes is sealed: ``MAGIC | nonce (12 bytes) | AES-256-GCM(plaintext)``, the key HKDF-SHA256 of
the cluster secret (``info`` :data:`INFO`), and the associated data :func:`associated` binds the object's kind, the
calibration id, the tenant salt and the block keys it holds. An object whose tag does not verify under that data (a
forged or corrupted one, one written without the secret, or one copied under another key or calibration) raises
:class:`SealError` (a TierError: a miss), never returns bytes. ``insecure``: no secret, objects are ``PLAIN | bytes``
(the operator's explicit ``pool_insecure``); a sealed store refuses them and an insecure one refuses sealed ones.

A blob is sealed in parts (:meth:`Sealer.seal_parts`, one per layer group, so a reader opens group 0 while later
groups still move): each part is such a message on its own, whose associated data adds to the blob's the part's index
and the number of parts (:func:`part_associated`), so parts cannot be swapped, dropped, cut short or moved between
blobs without failing authentication.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..errors import ConfigError, TierError

INFO = b"dynamo-kvtc pool seal v1"
MAGIC, PLAIN = b"KVTCPS1\0", b"KVTCPP1\0"
NONCE = 12


class SealError(TierError):
    """A pool object that does not open: forged, corrupted, sealed for other keys, or of the other mode."""


def associated(kind: str, cal: str, salt: str, hashes: Sequence[int]) -> bytes:
    """The associated data of one object: its kind (``blob``, ``meta``), calibration id, tenant salt and block keys."""
    head = b"\0".join(x.encode() for x in ("dynamo-kvtc pool", kind, cal, salt))
    return head + b"\0" + b"".join(int(h).to_bytes(16, "big") for h in hashes)


def part_associated(aad: bytes, k: int, n: int) -> bytes:
    """The associated data of part ``k`` of ``n`` of an object whose own associated data is ``aad``."""
    return aad + b"\0part" + k.to_bytes(4, "big") + n.to_bytes(4, "big")


class Sealer:
    """Seals and opens pool objects with one cluster secret (``None`` and ``insecure``: plain objects)."""

    def __init__(self, secret: bytes | None, *, insecure: bool = False) -> None:
        if not secret and not insecure:
            raise ConfigError(
                "the pool tier needs the cluster secret to seal its objects: set transfer_secret_file (or "
                "DYN_KVTC_TRANSFER_SECRET); pool_insecure=true runs it unsealed (anyone reaching the master reads "
                "the prompts' KV)"
            )
        self.insecure = not secret
        self._aead = None
        if secret:
            from cryptography.hazmat.primitives import hashes
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            from cryptography.hazmat.primitives.kdf.hkdf import HKDF

            key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=INFO).derive(secret)
            self._aead = AESGCM(key)

    def overhead(self) -> int:
        return len(MAGIC) + (0 if self._aead is None else NONCE + 16)

    def seal(self, data: bytes | memoryview, aad: bytes) -> bytes:
        if self._aead is None:
            return PLAIN + bytes(data)
        nonce = os.urandom(NONCE)
        return MAGIC + nonce + self._aead.encrypt(nonce, bytes(data), aad)

    def open(self, obj: bytes | memoryview, aad: bytes) -> bytes:
        """The plaintext of a sealed object, or SealError."""
        obj = memoryview(obj)
        if self._aead is None:
            if bytes(obj[: len(PLAIN)]) != PLAIN:
                raise SealError("a sealed (or unknown) object met an unsealed pool tier")
            return bytes(obj[len(PLAIN) :])
        if bytes(obj[: len(MAGIC)]) != MAGIC or len(obj) < len(MAGIC) + NONCE + 16:
            raise SealError("not a sealed pool object")
        from cryptography.exceptions import InvalidTag

        nonce = bytes(obj[len(MAGIC) : len(MAGIC) + NONCE])
        try:
            return self._aead.decrypt(nonce, bytes(obj[len(MAGIC) + NONCE :]), aad)
        except InvalidTag:
            raise SealError("pool object failed authentication (forged, corrupted or sealed for other keys)") from None

    def seal_parts(self, data: bytes | memoryview, ends: Sequence[int], aad: bytes) -> tuple[bytes, list[int]]:
        """``data`` cut at ``ends`` (strictly increasing, the last ``len(data)``), each part sealed on its own: the
        parts back to back, and where each sealed part ends in them."""
        mv, n = memoryview(data).cast("B"), len(ends)
        if not ends or ends[-1] != len(mv) or any(b <= a for a, b in zip([0, *ends], ends)):
            raise ValueError(f"part ends must increase strictly up to {len(mv)}, got {list(ends)[:8]}")
        parts, sealed, lo = [], [], 0
        for k, hi in enumerate(ends):
            parts.append(self.seal(mv[lo:hi], part_associated(aad, k, n)))
            sealed.append((sealed[-1] if sealed else 0) + len(parts[-1]))
            lo = hi
        return b"".join(parts), sealed

    def open_part(self, obj: bytes | memoryview, aad: bytes, k: int, n: int) -> bytes:
        """The plaintext of part ``k`` of ``n`` (sealed by :meth:`seal_parts` under ``aad``), or SealError."""
        return self.open(obj, part_associated(aad, k, n))

    def open_part_into(self, obj: bytes | memoryview, aad: bytes, k: int, n: int, out: memoryview) -> None:
        """:meth:`open_part` straight into ``out`` (no copy of the sealed bytes nor of the plaintext); SealError, with
        ``out`` undefined, when it does not open or its plaintext is not ``len(out)`` bytes."""
        obj, aad = memoryview(obj), part_associated(aad, k, n)
        if len(obj) - self.overhead() != len(out):
            raise SealError(f"part {k} of {n}: {len(obj)} sealed bytes cannot open to {len(out)}")
        into = getattr(self._aead, "decrypt_into", None)  # cryptography >= 45
        if into is None or bytes(obj[: len(MAGIC)]) != MAGIC:
            out[:] = self.open(obj, aad)
            return
        from cryptography.exceptions import InvalidTag

        try:
            into(bytes(obj[len(MAGIC) : len(MAGIC) + NONCE]), obj[len(MAGIC) + NONCE :], aad, out)
        except InvalidTag:
            raise SealError("pool object failed authentication (forged, corrupted or sealed for other keys)") from None
