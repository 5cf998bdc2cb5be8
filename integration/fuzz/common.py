"""Shared by the atheris harnesses: a small synthetic calibration, seed inputs, and CRC fix-ups.

The fix-ups make mutated inputs pass the checksums so the fuzzer reaches the semantic checks behind them (a purely
random mutation almost never survives a CRC-32): every harness runs each input as given *and* re-signed.
"""

from __future__ import annotations

import logging
import struct
import zlib
from functools import lru_cache

import msgpack

BLOB_PREFIX = struct.Struct("<4sHHII")
DISK_PREFIX = struct.Struct("<8sII")
logging.disable(logging.CRITICAL)  # the tiers log every dropped file; a fuzzer makes millions


@lru_cache(maxsize=1)
def calibration():
    from dynamo_kvtc.calibration.synthetic import synthetic_calibration

    return synthetic_calibration(4, 2, 16, ratios=(8, 16), dp_rows=512, seed=0, name="fuzz")


@lru_cache(maxsize=1)
def codec():
    from dynamo_kvtc import KvtcCodec

    return KvtcCodec(calibration(), ratio=8, window=16)


def seed_blobs() -> list[bytes]:
    import torch

    from dynamo_kvtc.calibration.synthetic import synthetic_kv

    cal = calibration()
    k, v, pos = synthetic_kv(cal, 96, start=0, seed=1)
    c = codec()
    return [
        c.encode(k, v, pos),  # sinks + coded + window
        c.encode(k[:, :20], v[:, :20], pos[:20] + 500, window=20),  # raw mode
        c.encode(k[:, :78], v[:, :78], torch.cat([pos[8:40], pos[50:96]])),  # two position runs, no sinks
    ]


def resign_blob(data: bytes) -> bytes:
    """Recompute the header CRC and every section CRC of a (mutated) blob, keeping its bytes otherwise."""
    if len(data) < BLOB_PREFIX.size or data[:4] != b"KVTC":
        return data
    magic, ver, flags, hlen, _ = BLOB_PREFIX.unpack_from(data, 0)
    hb = data[BLOB_PREFIX.size : BLOB_PREFIX.size + hlen]
    try:
        h = msgpack.unpackb(hb, raw=False, strict_map_key=False)
    except Exception:
        return BLOB_PREFIX.pack(magic, ver, flags, len(hb), zlib.crc32(hb)) + data[BLOB_PREFIX.size + len(hb) :]
    body = data[BLOB_PREFIX.size + hlen :]
    if isinstance(h, dict) and isinstance(h.get("sections"), list):
        off = 0
        for row in h["sections"]:
            if isinstance(row, list) and len(row) == 5 and isinstance(row[4], list):
                n = sum(c for c in row[4] if isinstance(c, int) and c > 0)
                row[3] = zlib.crc32(body[off : off + n])
                off += n
    try:
        hb = msgpack.packb(h, use_bin_type=True)
    except Exception:
        pass
    return BLOB_PREFIX.pack(magic, ver, flags, len(hb), zlib.crc32(hb)) + hb + body


def resign_disk_file(data: bytes) -> bytes:
    """Recompute a disk-tier file's metadata CRC and the blob CRC/length it records."""
    if len(data) < DISK_PREFIX.size:
        return data
    magic, mlen, _ = DISK_PREFIX.unpack_from(data, 0)
    mb = data[DISK_PREFIX.size : DISK_PREFIX.size + mlen]
    blob = data[DISK_PREFIX.size + mlen :]
    try:
        m = msgpack.unpackb(mb, raw=False, strict_map_key=False)
        if isinstance(m, dict):
            m["crc"], m["len"] = zlib.crc32(blob), len(blob)
            mb = msgpack.packb(m, use_bin_type=True)
    except Exception:
        pass
    return DISK_PREFIX.pack(magic, len(mb), zlib.crc32(mb)) + mb + blob
