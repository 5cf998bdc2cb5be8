"""The hand-off's control messages (msgpack over the control channel) and their validation.

- ``fetch`` (decode → prefill): ``hashes`` (the requested blocks' Dynamo sequence hashes, 1..``MAX_FETCH_BLOCKS``
  unsigned 64-bit integers), ``agent`` and ``agent_md`` (the decode side's NIXL agent name and metadata), ``mem``
  (optional: ``VRAM`` when the decode side READs into device memory and would have the blobs staged in device memory
  too; default ``DRAM``).
- fetch reply: ``lease``, ``agent``, ``agent_md`` (the prefill side's), ``mem`` and ``dev`` (the NIXL memory type
  and device id of the staged bytes; default ``DRAM``, 0), and ``blobs``: one entry per blob run with
  ``size``, ``first`` (first block inside the blob), ``count`` (blocks used), ``j`` (index of its first block among
  the requested hashes), ``meta`` (the blob's :class:`~dynamo_kvtc.tiers.blobs.BlobMeta` as a map) and ``descs``
  (``[address, length]`` pairs of the staged bytes in the prefill side's registered memory); optionally ``ranges``
  (where each layer group's bytes end in the blob, the first range holding the header too: strictly increasing, the
  last equal to ``size``; present on every blob or none, the same count on each). The decode side READs range a of
  every blob in one transfer, a = 0, 1, ..., and restores group g once the ranges holding it landed; without
  ``ranges`` a blob is one range.
- ``release`` (decode → prefill): ``lease``; the prefill side frees the staged bytes (or when the lease expires).

:func:`plan_reply` checks a fetch reply against the request before anything is allocated or read: types and ranges,
at most ``MAX_FETCH_BYTES`` in all, runs that tile the requested blocks exactly and in order, each run's block hashes
(from the blob's metadata) equal to the requested ones, descriptors that add up to each blob's size, byte ranges
that tile each blob. The ranges only say when to READ what: the restore reads a group only after every range up to
the one holding its last byte landed, so ranges that lie cost a recompute (the CRCs and header checks), never wrong
KV or a byte outside the receive buffer.

What the decode side may *keep* of a peer's blob (``PlannedRun.meta``, which the store adopts into its index for the
next turn) is rebuilt here, never taken from the peer: the hashes are exactly the requested ones the run covers
(``hashes[at : at + count]``), the id is derived from them as the offloader derives its own (first and last hash), the
stored size is the run's checked size, and the other fields are type- and range-checked. A run that starts inside its
blob (``first > 0``) is not kept at all (its blocks could not be indexed at their positions without the ones before,
which nobody asked for), nor is one whose metadata is malformed; both still restore. A run whose blob holds more blocks
after the requested ones is kept under the requested hashes only: the blob's extra blocks are never indexed, so a peer
cannot plant KV under hashes this side did not ask for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...errors import TransferError
from ...transport.channel import Limits

MAX_MESSAGE = 1 << 24
MAX_FETCH_BLOCKS = 1 << 16  # 1M tokens at block size 16
MAX_FETCH_BYTES = MAX_MESSAGE * 64  # 1 GiB of compressed blobs for one prompt
MAX_AGENT_MD = 1 << 22
MAX_RANGES = 1024  # byte ranges per blob (one per layer group)
MAX_BLOB_BLOCKS = 1 << 16  # blocks one blob's metadata may name
LIMITS = Limits(max_message=MAX_MESSAGE, max_str=1 << 16, max_bin=MAX_AGENT_MD, max_array=1 << 20, max_map=64)
PEER_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,256}")


def hashes_ok(hashes: Any) -> bool:
    return isinstance(hashes, list) and all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 128 for h in hashes
    )


def peer_ok(name: Any, md: Any) -> bool:
    return isinstance(name, str) and PEER_NAME.fullmatch(name) is not None and isinstance(md, bytes) and bool(md)


MEMS = ("DRAM", "VRAM")


def fetch_request(hashes: list[int], agent: str, agent_md: bytes, mem: str = "DRAM") -> dict[str, Any]:
    msg = {"op": "fetch", "hashes": hashes, "agent": agent, "agent_md": agent_md}
    return {**msg, "mem": mem} if mem != "DRAM" else msg


def fetch_mem(msg: dict[str, Any]) -> str:
    """The memory a fetch asks its blobs to be staged in (``DRAM`` unless it asks for ``VRAM``)."""
    mem = msg.get("mem", "DRAM")
    if mem not in MEMS:
        raise TransferError(f"fetch asks for memory {mem!r:.40}; one of {MEMS}")
    return mem


def reply_memory(reply: dict[str, Any]) -> tuple[str, int]:
    """(NIXL memory type, device id) of a fetch reply's staged bytes; TransferError when malformed."""
    mem, dev = reply.get("mem", "DRAM"), reply.get("dev", 0)
    if mem not in MEMS or not _whole(dev, 0, 1023):
        raise TransferError("malformed fetch reply: memory type or device")
    return mem, dev


def check_fetch(msg: dict[str, Any]) -> tuple[list[int], str, bytes]:
    """The (hashes, peer agent name, peer metadata) of a well-formed fetch request; TransferError otherwise."""
    hashes = msg.get("hashes")
    if not hashes_ok(hashes) or not hashes or len(hashes) > MAX_FETCH_BLOCKS:
        raise TransferError(f"fetch needs a list of 1..{MAX_FETCH_BLOCKS} 128-bit block keys")
    peer, md = msg.get("agent"), msg.get("agent_md")
    if not peer_ok(peer, md):
        raise TransferError("fetch needs the peer's NIXL agent name and metadata")
    return hashes, peer, md


@dataclass(frozen=True)
class PlannedRun:
    """One blob of a checked fetch reply: where its bytes go in the local buffer and which blocks it covers."""

    offset: int
    size: int
    first: int
    count: int
    at: int
    meta: dict[str, Any] | None  # what this side may keep of the blob (see the module doc), None: nothing
    descs: tuple[tuple[int, int], ...] = ()  # the staged bytes in the peer's memory, in blob order
    ranges: tuple[int, ...] = ()  # where each byte range ends in the blob (the last: size)


def _whole(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check_run(b: Any, hashes: list[int], at: int) -> tuple[int, int, int, dict[str, Any], list]:
    if not isinstance(b, dict):
        raise TransferError("malformed fetch reply: a blob entry is not a map")
    size, first, count, j = b.get("size"), b.get("first"), b.get("count"), b.get("j")
    descs, meta = b.get("descs"), b.get("meta")
    if not (
        _whole(size, 1, MAX_FETCH_BYTES)
        and _whole(first, 0, 1 << 32)
        and _whole(count, 1, len(hashes))
        and j == at
        and _whole(j, 0, len(hashes) - count)
    ):
        raise TransferError("fetch reply runs do not tile the requested blocks in order")
    held = meta.get("hashes") if isinstance(meta, dict) else None
    if (
        not (isinstance(held, list) and len(held) <= MAX_BLOB_BLOCKS and hashes_ok(held))
        or held[first : first + count] != hashes[j : j + count]
    ):
        raise TransferError(f"fetch reply blob for blocks {j}..{j + count - 1} holds other blocks")
    if not isinstance(descs, list) or not 0 < len(descs) <= 1 << 16:
        raise TransferError("malformed fetch reply: descriptors")
    for d in descs:
        if not (isinstance(d, list) and len(d) == 2 and _whole(d[0], 1, (1 << 64) - 1) and _whole(d[1], 1, size)):
            raise TransferError("malformed fetch reply: a descriptor")
    if sum(d[1] for d in descs) != size:
        raise TransferError("fetch reply descriptors do not add up to the blob size")
    return size, first, count, meta, descs


def _finite(v: Any, lo: float, hi: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi  # NaN and inf fail the range


def kept_meta(meta: dict[str, Any], first: int, mine: list[int], size: int) -> dict[str, Any] | None:
    """The metadata under which this side may keep a peer's blob whose blocks ``first ..`` are the requested hashes
    ``mine`` (already checked against the blob's own list): those hashes only, an id derived from them, the checked
    size; None when the run starts inside the blob or a field is malformed (the blob is then used, not kept)."""
    bs, pos, ratio, cal, raw = (meta.get(k) for k in ("block_size", "first_position", "ratio", "cal", "raw_bytes"))
    if first != 0 or not mine:
        return None
    if not (_whole(bs, 1, 1 << 20) and _whole(pos, 0, 1 << 48) and _whole(raw, 0, 1 << 48)):
        return None
    if not (ratio is None or _finite(ratio, 1e-3, 1e6)) or not (isinstance(cal, str) and 0 < len(cal) <= 256):
        return None
    return {
        "id": f"{mine[0]:016x}{mine[-1]:016x}",
        "hashes": list(mine),
        "block_size": bs,
        "first_position": pos,
        "ratio": None if ratio is None else float(ratio),
        "cal": cal,
        "raw_bytes": raw,
        "stored_bytes": size,
    }


def _ranges(b: dict[str, Any], size: int) -> tuple[int, ...]:
    """A blob entry's byte ranges (ends), checked: strictly increasing ints in [1, size], the last = size."""
    ends = b.get("ranges")
    if ends is None:
        return (size,)
    if not (isinstance(ends, list) and 0 < len(ends) <= MAX_RANGES and all(_whole(e, 1, size) for e in ends)):
        raise TransferError("malformed fetch reply: byte ranges")
    if ends[-1] != size or any(y <= x for x, y in zip(ends, ends[1:])):
        raise TransferError("fetch reply byte ranges do not tile the blob in order")
    return tuple(ends)


def plan_reply(reply: dict[str, Any], hashes: list[int]) -> tuple[list[PlannedRun], list[tuple]]:
    """Check a fetch reply's blob list against the requested ``hashes``; return the runs (with their offsets in one
    local buffer) and the remote (address, length, 0) descriptors in buffer order."""
    blobs = reply.get("blobs")
    if not isinstance(blobs, list) or not 0 < len(blobs) <= len(hashes):
        raise TransferError("malformed fetch reply: no blob list")
    runs: list[PlannedRun] = []
    remote: list[tuple] = []
    total = at = 0
    for b in blobs:
        size, first, count, meta, descs = _check_run(b, hashes, at)
        ends = _ranges(b, size)
        remote.extend((addr, n, 0) for addr, n in descs)
        kept = kept_meta(meta, first, hashes[at : at + count], size)
        runs.append(PlannedRun(total, size, first, count, at, kept, tuple((a, n) for a, n in descs), ends))
        total += size
        at += count
        if total > MAX_FETCH_BYTES:
            raise TransferError(f"peer offers more than {MAX_FETCH_BYTES} bytes, more than a prompt's blobs can be")
    if at != len(hashes):
        raise TransferError(f"fetch reply covers {at} of {len(hashes)} requested blocks")
    if len({len(r.ranges) for r in runs}) != 1 or ("ranges" in blobs[0]) != all("ranges" in b for b in blobs):
        raise TransferError("fetch reply byte ranges differ in count between blobs")
    return runs, remote


def range_descs(runs: list[PlannedRun], a: int, base: int, dev: int, rdev: int) -> tuple[list[tuple], list[tuple]]:
    """(local, remote) ``(address, length, device)`` descriptors of byte range ``a`` of every run: local in the
    receive buffer at ``base`` (each run at its offset), remote cut from the run's checked descriptors."""
    local: list[tuple] = []
    remote: list[tuple] = []
    for r in runs:
        s, e = (r.ranges[a - 1] if a else 0), r.ranges[a]
        local.append((base + r.offset + s, e - s, dev))
        pos = 0
        for addr, n in r.descs:
            lo, hi = max(s, pos), min(e, pos + n)
            if lo < hi:
                remote.append((addr + lo - pos, hi - lo, rdev))
            pos += n
    return local, remote
