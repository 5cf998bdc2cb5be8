"""One error hierarchy for dynamo_kvtc.

Every error the library raises on purpose is a :class:`KvtcError`. Callers that serve traffic catch
``KvtcError`` around a restore and treat it as a cache miss (the engine recomputes); nothing wrong is served.

- :class:`ConfigError`      bad arguments or configuration (unknown ratio, bad window, bad env var).
- :class:`InputError`       tensors handed to ``encode`` that do not fit (shape, dtype, positions, NaN).
- :class:`CalibrationError` a calibration artifact that is missing, torn or inconsistent.
  - :class:`CalibrationMismatchError` a calibration for another model / shard / blob.
- :class:`DecodeError`      *the* decoder error: any blob that cannot be decoded exactly as written.
  - :class:`CorruptBlobError`       bad magic, version, lengths, checksums, truncated or malformed header.
  - :class:`UnsupportedCodecError`  a codec tag this reader cannot decode (e.g. GPU-only nvCOMP ANS on CPU).
  - :class:`WrongCalibrationError`  the blob was written with another calibration.
- :class:`ModelError`       a model that cannot be loaded or is not supported.
"""

from __future__ import annotations


class KvtcError(Exception):
    """Base of every deliberate dynamo_kvtc error."""


class ConfigError(KvtcError, ValueError):
    """Invalid configuration or argument."""


class InputError(KvtcError, ValueError):
    """Tensors or positions passed to the codec do not match what it expects."""


class CalibrationError(KvtcError):
    """A calibration artifact is missing, incomplete, corrupted or inconsistent."""


class CalibrationMismatchError(CalibrationError):
    """A calibration does not belong to this model, shard or blob."""


class DecodeError(KvtcError):
    """A blob cannot be decoded. The only error type the decoder raises for bad input."""


class CorruptBlobError(DecodeError):
    """Bad magic, unknown version, malformed header, length or checksum mismatch, truncation."""


class UnsupportedCodecError(DecodeError):
    """The blob's entropy-codec tag cannot be decoded here (for example a GPU-only tag on CPU)."""


class WrongCalibrationError(DecodeError, CalibrationMismatchError):
    """The blob was encoded with a different calibration than the decoder's."""


class ModelError(KvtcError):
    """A model cannot be located, loaded or is not supported."""


class TierError(KvtcError):
    """A storage tier could not store or return a blob (full, I/O error, NIXL failure, torn file)."""


class TierFullError(TierError):
    """Not enough room in a tier even after eviction."""


class BadRecordError(TierError, ValueError):
    """A record from outside the process (a disk file's blob metadata, a peer's) with a missing, extra, wrong-typed
    or out-of-range field: dropped with its reason, never used."""


class BlobKeyError(TierError):
    """A blob does not carry the block keys a restore asked for (or none at all): never served, a counted miss."""


class TransferError(TierError):
    """A NIXL transfer failed, timed out or the peer disappeared."""


class PeerUnreachableError(TransferError):
    """A peer did not complete the control channel's handshake in time (nothing listening, a listener that never
    answers, or one without the cluster key), or was refused at once because it did so recently or has too many
    fetches waiting on it."""
