"""The KVTC blob container: a small self-describing header, then sections ordered by layer group.

Layout (all integers little-endian)::

    offset 0   magic        4 bytes  b"KVTC"
           4   version      uint16   FORMAT_VERSION
           6   flags        uint16   0 (reserved; a reader refuses unknown flags)
           8   header_len   uint32   length of the msgpack header (<= MAX_HEADER_BYTES)
          12   header_crc   uint32   CRC-32 of the header bytes
          16   header       msgpack map (schema below)
           .   sections     the stored chunks of every section, in header order, back to back

Header keys (all required): ``cal`` calibration id (str), ``layers``/``heads``/``head_dim`` (int), ``dtype`` (str),
``tokens`` (int), ``positions`` (list of ``[start, length]`` runs), ``mode`` ("kvtc" or "raw"), ``ratio`` (float or
nil), ``sinks``/``window`` (token counts: a prefix kept in fp8 and a suffix kept raw), ``groups`` (list of
``[layer_start, layer_stop]``), ``sections`` (list of ``[name, tag, raw_len, crc32, [stored chunk lengths]]``).

Optional keys (per-layer token sets; written only by calibrations that have them, so every other blob keeps its bytes):
``order`` (a permutation of the layers: the layer groups are ranges over this order, so one group can hold layers that
are not neighbours, e.g. all sliding-window layers) and ``token_sets`` (one ``[start, stop]`` token-index range per
group: the tokens of the span that group encodes; the blob's ``sinks`` and ``window`` apply inside each range).
``kv`` (``"fp8_e4m3"``/``"fp8_e5m2"``): the values came from an FP8 KV cache of that format, through its scales; a
reader whose engine cache differs treats the blob as a miss.

Optional ``keys`` (bin): the 128-bit keys of the blocks the blob holds, 16 big-endian bytes each, in order; written
by the tiers (:func:`with_keys`) so a restore can check that a blob is the one it asked for. The codec never reads it.

Parsing checks magic, version, flags, header length and CRC, unpacks msgpack with hard limits, checks every field's
type and range, and checks that the section table accounts for exactly the remaining bytes. Section CRCs are checked
before anything is inflated. Any failure raises :class:`~dynamo_kvtc.errors.CorruptBlobError`.

Decompressed-size limits, checked from the header alone before anything is allocated: a section's tag must name a
registered entropy coder (:mod:`.entropy.registry`); a chunk's raw size is at most 64 KiB and its stored size at most
:data:`~.entropy.base.MAX_STORED_CHUNK`; each chunk must pass its coder's bound (:meth:`~.entropy.base.Coder.fits`:
a ``store`` chunk's stored length equals its raw size, a ``deflate``/``gdeflate`` chunk's raw size is at most 1032
times its stored length, DEFLATE's ceiling), so a blob can never claim more raw bytes than its own size allows; the
chunk count follows from the raw length arithmetically (no list is built for a hostile length).

Writing: :class:`BlobHeader` is the header (every key but ``sections``); :func:`write_blob` assembles a blob from a
header and its sections' stored chunks, :func:`frame_header` writes the prefix and header alone for writers that place
the section bytes themselves (the fused GPU path). Both writers of the format go through these two functions.

This module imports neither torch nor numpy: ``dynamo-kvtc inspect`` reads blobs without them.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from ..errors import CorruptBlobError, DecodeError, InputError
from .entropy.base import CHUNK_BYTES, MAX_STORED_CHUNK
from .entropy.registry import coder, known

MAGIC = b"KVTC"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<4sHHII")
MAX_HEADER_BYTES = 1 << 20
MAX_TOKENS = 1 << 24
MAX_LAYERS = 4096
MAX_SECTION_RAW = 1 << 40
HEADER_KEYS = (
    "cal",
    "layers",
    "heads",
    "head_dim",
    "dtype",
    "tokens",
    "positions",
    "mode",
    "ratio",
    "sinks",
    "window",
    "groups",
    "sections",
)
OPTIONAL_KEYS = ("order", "token_sets", "kv")  # per-layer token sets; the FP8 cache format the values came from
KV_SOURCES = ("fp8_e4m3", "fp8_e5m2")  # ``kv``: absent for a 16/32-bit cache (``dtype`` says which)
KEY_BYTES = 16  # one block key in the ``keys`` field (128 bits, big-endian)
MAX_KEYS = 1 << 16  # block keys one blob may carry


@dataclass
class BlobHeader:
    """The header of one blob, every key of the msgpack map but ``sections`` (the writer adds the section table).

    Field order is the key order on disk: the same header always packs to the same bytes. It only holds values; the
    checks a reader needs live in :func:`parse_blob`.
    """

    cal: str
    layers: int
    heads: int
    head_dim: int
    dtype: str
    tokens: int
    positions: list[list[int]]  # [start, length] runs (see positions_to_runs)
    mode: str  # "kvtc" or "raw"
    ratio: float | None  # the DP plan's ratio; None in raw mode
    sinks: int
    window: int
    groups: list[list[int]] = field(default_factory=list)  # [layer_start, layer_stop] per layer group
    order: list[int] | None = None  # layer permutation the groups are ranges over (None: 0..layers-1)
    token_sets: list[list[int]] | None = None  # [start, stop] token-index range per group (None: every token)
    kv: str | None = None  # the FP8 cache format the values were dequantized from (None: a 16/32-bit cache)

    def to_dict(self) -> dict[str, Any]:
        """The msgpack map's keys in order; the optional keys only where set (older blobs keep their bytes)."""
        d = asdict(self)
        for k in OPTIONAL_KEYS:
            if d[k] is None:
                del d[k]
        return d

    @classmethod
    def from_dict(cls, h: dict[str, Any]) -> BlobHeader:
        """From a parsed header (its ``sections`` key, if any, is ignored)."""
        return cls(**{k: h[k] for k in HEADER_KEYS if k != "sections"}, **{k: h[k] for k in OPTIONAL_KEYS if k in h})


def group_segments(h: dict[str, Any], group: int) -> tuple[int, int, int, int]:
    """``(start, sinks, coded, window)`` token counts of layer group ``group`` of a parsed header: the group's range
    starts at token index ``start`` and holds ``sinks`` fp8 tokens, then ``coded`` transform-coded ones, then
    ``window`` raw ones (the blob's sinks and window clipped to the range)."""
    T, ns, nw = h["tokens"], h["sinks"], h["window"]
    sets = h.get("token_sets")
    a, b = (0, T) if sets is None else sets[group]
    gs = max(0, min(ns, b) - a)
    gw = max(0, b - max(T - nw, a))
    return a, gs, b - a - gs - gw, gw


@dataclass(frozen=True)
class SectionRecord:
    """One row of the section table: name, entropy tag, raw length, CRC-32 of the stored bytes, stored chunk lengths
    (and, when parsed, where the stored bytes start in the blob)."""

    name: str
    tag: str
    raw_len: int
    crc: int
    chunks: tuple[int, ...]  # stored lengths
    offset: int = 0  # absolute offset of the first stored byte in the blob

    @property
    def stored_len(self) -> int:
        return sum(self.chunks)


def positions_to_runs(positions: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([int(p), 1])
    return runs


def runs_to_positions(runs: Sequence[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for start, length in runs:
        out.extend(range(start, start + length))
    return out


def frame_header(header: BlobHeader, table: Sequence[SectionRecord]) -> bytes:
    """The prefix and msgpack header of a blob whose sections are ``table`` (their stored bytes follow, in order).

    Raises :class:`~dynamo_kvtc.errors.InputError` (a ValueError) if the header exceeds :data:`MAX_HEADER_BYTES`
    (a span with too many position runs)."""
    rows = [[r.name, r.tag, int(r.raw_len), int(r.crc), [int(n) for n in r.chunks]] for r in table]
    hdr = msgpack.packb({**header.to_dict(), "sections": rows}, use_bin_type=True)
    if len(hdr) > MAX_HEADER_BYTES:
        raise InputError(f"header of {len(hdr)} bytes exceeds {MAX_HEADER_BYTES}; use shorter spans")
    return PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(hdr), zlib.crc32(hdr)) + hdr


def write_blob(header: BlobHeader, sections: Sequence[tuple[str, str, int, Sequence[bytes]]]) -> bytes:
    """Assemble a blob. ``sections``: (name, tag, raw_len, stored chunks), in blob order."""
    table = []
    for name, tag, raw_len, chunks in sections:
        crc = 0
        for c in chunks:
            crc = zlib.crc32(c, crc)
        table.append(SectionRecord(name, tag, int(raw_len), crc, tuple(len(c) for c in chunks)))
    parts = [frame_header(header, table)]
    for _, _, _, chunks in sections:
        parts.extend(chunks)
    return b"".join(parts)


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise CorruptBlobError(f"blob header invalid: {what}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(h: dict, key: str, lo: int, hi: int) -> int:
    v = h.get(key)
    _need(_is_int(v) and lo <= v <= hi, f"{key}={v!r} not an integer in [{lo}, {hi}]")
    return v


def _header(blob: bytes | bytearray | memoryview) -> tuple[memoryview, dict[str, Any], int]:
    """(the blob as bytes, its header unpacked within limits, header length): prefix and header CRC checked."""
    mv = memoryview(blob)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    if len(mv) < PREFIX.size:
        raise CorruptBlobError(f"blob of {len(mv)} bytes is shorter than the {PREFIX.size}-byte prefix (truncated)")
    magic, version, flags, hlen, hcrc = PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptBlobError(f"not a KVTC blob (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CorruptBlobError(f"unsupported KVTC format version {version} (this reader handles {FORMAT_VERSION})")
    if flags != 0:
        raise CorruptBlobError(f"unknown header flags 0x{flags:04x}")
    if hlen > MAX_HEADER_BYTES or PREFIX.size + hlen > len(mv):
        raise CorruptBlobError(f"header length {hlen} exceeds the limit or the blob ({len(mv)} bytes; truncated?)")
    hbytes = mv[PREFIX.size : PREFIX.size + hlen]
    if zlib.crc32(hbytes) != hcrc:
        raise CorruptBlobError("header checksum mismatch")
    try:
        h = msgpack.unpackb(
            bytes(hbytes),
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=1024,
            max_bin_len=KEY_BYTES * MAX_KEYS,
            max_ext_len=0,
            max_array_len=MAX_TOKENS,
            max_map_len=64,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise CorruptBlobError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    _need(isinstance(h, dict), "not a map")
    keys = h.get("keys")
    if keys is not None:
        _need(isinstance(keys, bytes) and 0 < len(keys) and len(keys) % KEY_BYTES == 0, "keys must be 16 bytes a block")
    for k, v in h.items():  # the one binary field: a bin anywhere else is refused
        _need(k == "keys" or not isinstance(v, bytes), f"{k} must not be binary")
    return mv, h, hlen


def parse_blob(blob: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list[SectionRecord]]:
    """Validate a blob's prefix, header and section table; return the header and section records."""
    mv, h, hlen = _header(blob)
    missing = [k for k in HEADER_KEYS if k not in h]
    _need(not missing, f"missing header keys {missing}")
    _need(isinstance(h.get("cal"), str), "cal must be a string")
    layers = _int(h, "layers", 1, MAX_LAYERS)
    _int(h, "heads", 1, 1 << 16)
    _int(h, "head_dim", 1, 1 << 16)
    tokens = _int(h, "tokens", 1, MAX_TOKENS)
    _need(h.get("dtype") in ("bfloat16", "float16", "float32"), f"dtype {h.get('dtype')!r}")
    _need(h.get("mode") in ("kvtc", "raw"), f"mode {h.get('mode')!r}")
    r = h.get("ratio")
    _need(r is None or (isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0), f"ratio {r!r}")
    sinks = _int(h, "sinks", 0, tokens)
    window = _int(h, "window", 0, tokens)
    _need(sinks + window <= tokens, "sinks + window exceed tokens")
    runs = h.get("positions")
    _need(isinstance(runs, list) and 0 < len(runs) <= tokens, "positions must be a non-empty run list")
    total, last = 0, -1
    for run in runs:
        _need(
            isinstance(run, list) and len(run) == 2 and all(_is_int(x) for x in run),
            "position run",
        )
        start, length = run
        _need(start > last and length >= 1 and start + length <= (1 << 40), "positions must be strictly increasing")
        last = start + length - 1
        total += length
    _need(total == tokens, f"positions cover {total} tokens, header says {tokens}")
    groups = h.get("groups")
    _need(isinstance(groups, list) and 0 < len(groups) <= layers, "groups")
    prev = 0
    for g in groups:
        _need(
            isinstance(g, list) and len(g) == 2 and _is_int(g[0]) and _is_int(g[1]) and g[0] == prev and g[1] > g[0],
            "layer groups must tile the layers",
        )
        prev = g[1]
    _need(prev == layers, "layer groups must cover every layer")
    order = h.get("order")
    if order is not None:
        _need(
            isinstance(order, list) and all(_is_int(x) for x in order) and sorted(order) == list(range(layers)),
            "order must be a permutation of the layers",
        )
    sets = h.get("token_sets")
    if sets is not None:
        _need(isinstance(sets, list) and len(sets) == len(groups), "token_sets must have one range per group")
        for ts in sets:
            _need(
                isinstance(ts, list) and len(ts) == 2 and all(_is_int(x) for x in ts) and 0 <= ts[0] <= ts[1] <= tokens,
                "token set ranges must lie within the span's tokens",
            )
    _need(h.get("kv") is None or h.get("kv") in KV_SOURCES, f"kv {h.get('kv')!r}")
    table = h.get("sections")
    _need(isinstance(table, list) and len(table) <= 8 * len(groups), "sections")
    recs: list[SectionRecord] = []
    off = PREFIX.size + hlen
    for row in table:
        _need(isinstance(row, list) and len(row) == 5, "section row")
        name, tag, raw_len, crc, chunks = row
        _need(isinstance(name, str) and known(tag), f"section {name!r} tag {tag!r}")
        cod = coder(tag)
        _need(_is_int(raw_len) and 0 <= raw_len <= MAX_SECTION_RAW, f"section {name} raw length")
        _need(_is_int(crc) and 0 <= crc < (1 << 32), f"section {name} crc")
        n_chunks = -(-raw_len // CHUNK_BYTES)  # arithmetic: never build a list for a hostile raw length
        _need(isinstance(chunks, list) and len(chunks) == n_chunks, f"section {name} chunk count")
        for i, c in enumerate(chunks):
            _need(_is_int(c) and 0 < c <= MAX_STORED_CHUNK, f"section {name} chunk length {c}")
            raw_c = CHUNK_BYTES if i < n_chunks - 1 else raw_len - CHUNK_BYTES * (n_chunks - 1)
            _need(cod.fits(c, raw_c), f"section {name}: {c} stored bytes cannot decode to {raw_c} ({tag})")
        rec = SectionRecord(name, tag, raw_len, crc, tuple(chunks), off)
        off += rec.stored_len
        recs.append(rec)
    if off != len(mv):
        raise CorruptBlobError(
            f"section table accounts for {off} bytes but the blob has {len(mv)} "
            f"({'truncated' if off > len(mv) else 'trailing bytes'})"
        )
    return h, recs


def group_ends(blob: bytes | bytearray | memoryview) -> list[int] | None:
    """Where each layer group's sections end in ``blob`` (strictly increasing, the last = the blob's length; the
    header sits before group 0, so range 0 holds it), or None when the blob does not parse (it then moves as one
    range). The hand-off READs a blob range by range and the pool tier seals it segment by segment along these."""
    try:
        _, recs = parse_blob(blob)
        ends: dict[int, int] = {}
        for r in recs:
            g = int(r.name.split(".", 1)[0])
            ends[g] = max(ends.get(g, 0), r.offset + r.stored_len)
    except (DecodeError, ValueError):
        return None
    out: list[int] = []
    for g in sorted(ends):
        if not out or ends[g] > out[-1]:  # an empty group adds no range
            out.append(ends[g])
    n = len(memoryview(blob).cast("B"))
    if not out or out[-1] != n:
        return None
    return out


def with_keys(blob: bytes | memoryview, keys: bytes) -> bytes:
    """A copy of ``blob`` whose header carries ``keys`` (16 bytes per block key, see the module docstring), replacing
    any it had; sections unchanged. Raises CorruptBlobError for a blob that does not parse, InputError for bad keys."""
    if not keys or len(keys) % KEY_BYTES or len(keys) > KEY_BYTES * MAX_KEYS:
        raise InputError(f"keys of {len(keys)} bytes: need 1..{MAX_KEYS} keys of {KEY_BYTES} bytes")
    h, recs = parse_blob(blob)
    h["keys"] = bytes(keys)
    hdr = msgpack.packb(h, use_bin_type=True)
    if len(hdr) > MAX_HEADER_BYTES:
        raise InputError(f"header of {len(hdr)} bytes exceeds {MAX_HEADER_BYTES}")
    start = recs[0].offset if recs else len(blob)
    return b"".join((PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(hdr), zlib.crc32(hdr)), hdr, memoryview(blob)[start:]))


def blob_keys(blob: bytes | memoryview) -> bytes | None:
    """The ``keys`` field of a blob's header (None when it has none); CorruptBlobError for a blob whose prefix or
    header does not check out. Reads the prefix and header only."""
    return _header(blob)[1].get("keys")


def check_section(blob: bytes | memoryview, rec: SectionRecord) -> None:
    """Raise CorruptBlobError if a section's stored bytes do not match its CRC (no copy)."""
    data = memoryview(blob)[rec.offset : rec.offset + rec.stored_len]
    if zlib.crc32(data) != rec.crc:
        raise CorruptBlobError(f"section {rec.name!r} checksum mismatch (corrupted bytes)")


def section_chunks(blob: bytes | memoryview, rec: SectionRecord, verify: bool = True) -> list[bytes]:
    """The stored chunks of one section, after checking its CRC."""
    if verify:
        check_section(blob, rec)
    data = memoryview(blob)[rec.offset : rec.offset + rec.stored_len]
    out, off = [], 0
    for n in rec.chunks:
        out.append(bytes(data[off : off + n]))
        off += n
    return out
