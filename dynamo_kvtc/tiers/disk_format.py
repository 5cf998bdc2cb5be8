"""The disk tier's file format, readable without torch or NIXL (``dynamo-kvtc inspect``, recovery scripts).

``b"KVTCD002"`` | uint32 record length | uint32 CRC-32 of the record | msgpack record ``{id, len, crc, meta}`` (blob
id, blob length, CRC-32 of the blob, the blob's tier metadata) | the KVTC blob (docs/format.md). The record is parsed
by the control channel's one bounded unpack; every field is checked before it is used (the ``meta`` map by
:meth:`BlobMeta.from_dict <dynamo_kvtc.tiers.blobs.BlobMeta.from_dict>` when the store adopts the file).

Version 2 (``KVTCD002``) files hold blobs that carry their 128-bit block keys and records whose ``meta.hashes`` are
those keys. A version 1 file (64-bit keys, a blob without keys) can never be served: recovery deletes it, naming the
reason (:class:`DamagedFile`).
"""

from __future__ import annotations

import re
import struct
import zlib
from typing import Any

from ..errors import TierError
from ..transport.channel import Limits, unpack

MAGIC = b"KVTCD002"
OLD_MAGICS = (b"KVTCD001",)  # earlier versions of this format: never served, deleted at start-up
PREFIX = struct.Struct("<8sII")
MAX_META = 1 << 20
SUFFIX = ".kvtc"
BLOB_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
RECORD_LIMITS = Limits(max_message=MAX_META, max_str=4096, max_bin=0, max_array=1 << 20, max_map=64)


class DamagedFile(TierError):
    """A file whose own bytes are wrong (torn, truncated, flipped, misnamed): safe to delete."""


def check_magic(magic: bytes) -> None:
    """DamagedFile unless ``magic`` is this version's (an older version's is named as such)."""
    if magic in OLD_MAGICS:
        raise DamagedFile(f"written by an older version ({magic.decode()}: 64-bit block keys); never served")
    if magic != MAGIC:
        raise DamagedFile("bad magic")


def parse_record(b: bytes) -> dict[str, Any]:
    """A file's record ``{id, len, crc, meta}``, checked; DamagedFile naming what is wrong."""
    m = unpack(b, RECORD_LIMITS, what="index record", error=DamagedFile)
    if not {"id", "len", "crc", "meta"} <= set(m):
        raise DamagedFile("metadata lacks required fields")
    if not isinstance(m["id"], str) or not BLOB_ID.fullmatch(m["id"]):
        raise DamagedFile("metadata has an invalid blob id")
    for key, hi in (("len", 1 << 48), ("crc", 1 << 32)):
        v = m[key]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < hi:
            raise DamagedFile(f"metadata field {key}={v!r} out of range")
    return m


def split_file(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(record, blob) of a whole disk-tier file, every CRC and length checked; DamagedFile otherwise."""
    if len(data) < PREFIX.size:
        raise DamagedFile("truncated prefix")
    magic, mlen, mcrc = PREFIX.unpack_from(data)
    check_magic(magic)
    if mlen > MAX_META or PREFIX.size + mlen > len(data):
        raise DamagedFile("bad record length")
    mbytes = data[PREFIX.size : PREFIX.size + mlen]
    if zlib.crc32(mbytes) != mcrc:
        raise DamagedFile("record checksum mismatch")
    m = parse_record(mbytes)
    blob = data[PREFIX.size + mlen :]
    if len(blob) != m["len"] or zlib.crc32(blob) != m["crc"]:
        raise DamagedFile("blob length or checksum does not match its record (torn write?)")
    return m, blob
