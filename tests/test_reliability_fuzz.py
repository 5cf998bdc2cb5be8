"""Fuzzed parsers (hypothesis, CI-sized; integration/fuzz/ has the atheris harnesses for long runs).

Targets: the blob container and decoder (random bytes, multi-byte mutations, semantically edited headers re-signed
with a valid CRC, hostile lengths), the disk tier's index records (whole directories of damaged files: recovery and
reads), and the control-channel messages of the lookup and transfer channels. The only allowed outcomes are the
documented error types or a result identical to the intact input's.
"""

from __future__ import annotations

import os
import struct
import tempfile
import time
import tracemalloc
import zlib
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_kvtc import KvtcCodec
from dynamo_kvtc import settings as kvtc_settings
from dynamo_kvtc.codec.container import MAGIC, PREFIX, parse_blob
from dynamo_kvtc.connector.handoff import messages
from dynamo_kvtc.connector.vllm import lookup
from dynamo_kvtc.errors import ConfigError, CorruptBlobError, DecodeError, TierError, TransferError
from dynamo_kvtc.tiers import DiskTier, TierConfig, disk_format
from dynamo_kvtc.transport import channel
from dynamo_kvtc.transport.nixl_io import NixlFiles

FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,  # no example database written into the work tree
)


@pytest.fixture(scope="module")
def codec(synth_cal):
    return KvtcCodec(synth_cal, ratio=8, window=32)


@pytest.fixture(scope="module")
def blobs(synth, codec):
    """A transform-coded blob (sinks, coded tokens, window) and a raw one, with their decodes."""
    k, v, pos = synth.sample(160, start=0)
    coded = codec.encode(k, v, pos)
    raw = codec.encode(k[:, :40], v[:, :40], pos[:40] + 1000, window=40)
    return {name: (b, codec.decode(b)) for name, b in (("kvtc", coded), ("raw", raw))}


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------------------------- blob decoder
@settings(FUZZ, max_examples=150)
@given(st.binary(max_size=2048))
def test_parse_random_bytes_only_corrupt_blob_error(junk):
    for data in (junk, MAGIC + junk, PREFIX.pack(MAGIC, 1, 0, len(junk), zlib.crc32(junk)) + junk):
        with pytest.raises(CorruptBlobError):
            parse_blob(data)


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_multi_byte_mutations_are_refused(blobs, codec, data):
    name = data.draw(st.sampled_from(sorted(blobs)))
    blob, _ = blobs[name]
    bad = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["overwrite", "insert", "delete"]))
        at = data.draw(st.integers(0, len(bad) - 1))
        if op == "overwrite":
            chunk = data.draw(st.binary(min_size=1, max_size=32))
            bad[at : at + len(chunk)] = chunk
        elif op == "insert":
            bad[at:at] = data.draw(st.binary(min_size=1, max_size=32))
        else:
            del bad[at : at + data.draw(st.integers(1, 32))]
    if bytes(bad) == blob:
        return
    with pytest.raises(DecodeError):
        codec.decode(bytes(bad))


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _resign(blob: bytes, header: dict) -> bytes:
    _, ver, flags, hlen, _ = PREFIX.unpack_from(blob, 0)
    hb = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(MAGIC, ver, flags, len(hb), zlib.crc32(hb)) + hb + blob[PREFIX.size + hlen :]


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_header_edits_behind_a_valid_crc(blobs, codec, data):
    """The semantic checks behind the header CRC: any edit of any field (or of a nested value: a position run, a
    section row, a chunk length), re-signed, is refused with DecodeError or decodes to exactly the original, except
    valid other positions, which are data (the same values, keys rotated to the other positions)."""
    name = data.draw(st.sampled_from(sorted(blobs)))
    blob, ref = blobs[name]
    hlen = PREFIX.unpack_from(blob, 0)[3]
    h = msgpack.unpackb(blob[PREFIX.size : PREFIX.size + hlen], raw=False)
    original_positions = msgpack.unpackb(msgpack.packb(h["positions"]))
    for _ in range(data.draw(st.integers(1, 3))):
        path = [data.draw(st.sampled_from(sorted(h) + ["extra"]))]
        node = h.get(path[0])
        while isinstance(node, list) and node and data.draw(st.booleans()):
            path.append(data.draw(st.integers(0, len(node) - 1)))
            node = node[path[-1]]
        parent = h
        for p in path[:-1]:
            parent = parent[p]
        if isinstance(parent, dict) and path[-1] in parent and data.draw(st.integers(0, 9)) == 0:
            del parent[path[-1]]  # a required key missing
            continue
        if isinstance(node, int) and not isinstance(node, bool) and data.draw(st.booleans()):
            value = node + data.draw(st.integers(-3, 3))
        else:
            value = data.draw(msgpack_values)
        parent[path[-1]] = value
    try:
        bad = _resign(blob, h)
    except (OverflowError, ValueError, TypeError):
        return
    try:
        got = codec.decode(bad)
    except DecodeError:
        return
    if h.get("positions") != original_positions:
        # other valid positions are data, not damage: the same values, keys rotated elsewhere (RoPE keeps norms)
        assert torch.equal(got[1], ref[1])
        assert torch.allclose(got[0].float().norm(dim=-1), ref[0].float().norm(dim=-1), rtol=3e-2, atol=1e-2)
        return
    assert _same(got, ref), "a re-signed header edit decoded to different tensors"


def test_hostile_lengths_are_refused_before_any_allocation(blobs, codec):
    """Claims of huge raw sizes are refused from the header alone: no chunk table or buffer is built for them."""
    blob, _ = blobs["kvtc"]
    hlen = PREFIX.unpack_from(blob, 0)[3]
    h = msgpack.unpackb(blob[PREFIX.size : PREFIX.size + hlen], raw=False)
    cases = []
    for raw_len, chunks in ((1 << 40, [100]), ((1 << 40), h["sections"][1][4]), (1 << 30, [1] * 16384)):
        e = msgpack.unpackb(msgpack.packb(h), raw=False)
        e["sections"][1][2], e["sections"][1][4] = raw_len, chunks
        cases.append(e)
    e = msgpack.unpackb(msgpack.packb(h), raw=False)  # a DEFLATE chunk "inflating" 64 KiB from 10 bytes
    e["sections"][1][2], e["sections"][1][4] = 1 << 16, [10]
    cases.append(e)
    e = msgpack.unpackb(msgpack.packb(h), raw=False)  # a stored chunk whose length is not its raw length
    e["sections"][3][4] = [c + 1 for c in e["sections"][3][4]]
    cases.append(e)
    for e in cases:
        bad = _resign(blob, e)
        tracemalloc.start()
        t0 = time.perf_counter()
        with pytest.raises(CorruptBlobError):
            codec.decode(bad)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 8 << 20 and time.perf_counter() - t0 < 2.0, (peak, e["sections"][1][2])


# ---------------------------------------------------------------------------------------------- disk index
@pytest.fixture(scope="module")
def nixl_files():
    return NixlFiles()


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_disk_recovery_over_damaged_files(nixl_files, data):
    """A directory of committed blobs, some damaged in any way (bytes, lengths, names, junk files): recovery never
    raises and never adopts a damaged file whose header does not check out; every read returns exactly the committed
    bytes or raises TierError."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "g3"
        tier = DiskTier(d, 1 << 24, io=nixl_files, fsync=False)
        originals = {}
        for i in range(data.draw(st.integers(1, 4))):
            bid = f"{i:032x}"
            originals[bid] = data.draw(st.binary(min_size=1, max_size=3000))
            tier.put(bid, originals[bid], {"hashes": [i], "n": i})
        tier.close()
        files = sorted(d.iterdir())
        damaged = set()
        for _ in range(data.draw(st.integers(0, 4))):
            f = data.draw(st.sampled_from(files))
            raw = bytearray(f.read_bytes())
            op = data.draw(st.sampled_from(["flip", "cut", "grow", "junk", "header"]))
            if op == "flip" and raw:
                at = data.draw(st.integers(0, len(raw) - 1))
                raw[at] ^= 1 << data.draw(st.integers(0, 7))
            elif op == "cut":
                raw = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
            elif op == "grow":
                raw += data.draw(st.binary(min_size=1, max_size=64))
            elif op == "junk":
                raw = bytearray(data.draw(st.binary(max_size=200)))
            else:  # a forged index record: valid CRC, arbitrary content
                meta = data.draw(msgpack_values)
                try:
                    mb = msgpack.packb(meta, use_bin_type=True)
                except (OverflowError, ValueError, TypeError):
                    continue
                raw = bytearray(struct.pack("<8sII", disk_format.MAGIC, len(mb), zlib.crc32(mb)) + mb)
            f.write_bytes(bytes(raw))
            damaged.add(f.name[: -len(".kvtc")])
        (d / "junk.kvtc").write_bytes(data.draw(st.binary(max_size=64)))
        (d / "leftover.tmp").write_bytes(b"torn")
        again = DiskTier(d, 1 << 24, io=nixl_files, fsync=False)
        try:
            assert not (d / "leftover.tmp").exists() and not (d / "junk.kvtc").exists()
            assert set(again.ids()) <= set(originals)
            for bid in originals:
                if bid not in again:
                    assert bid in damaged
                    continue
                try:
                    blob = again.copy(bid)
                except TierError:
                    assert bid in damaged
                    continue
                assert blob == originals[bid]
        finally:
            again.close()


@settings(FUZZ, max_examples=300)
@given(st.binary(max_size=512) | msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_disk_index_record_parser(raw):
    try:
        m = disk_format.parse_record(raw)
    except TierError:
        return
    assert isinstance(m["id"], str) and isinstance(m["len"], int) and isinstance(m["crc"], int)


# ---------------------------------------------------------------------------------------------- control channels
@settings(FUZZ, max_examples=300)
@given(st.binary(max_size=512) | msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_control_messages_parse_or_transfer_error(raw):
    """The control channel's one parser, under each channel's limits, returns a map or raises TransferError; a
    parsed message is then either a well-formed fetch request or refused with TransferError."""
    for limits in (messages.LIMITS, lookup.LIMITS):
        try:
            msg = channel.unpack(raw, limits)
        except TransferError:
            continue
        assert isinstance(msg, dict)
        try:  # as a sealed envelope: only the right MAC, inside the window, opens it
            channel.Auth(b"fuzz-secret-0123456789").open_request(msg)
            raise AssertionError("a random message opened as an authenticated request")
        except TransferError:
            pass
        try:
            hashes, peer, md = messages.check_fetch(msg)
        except TransferError:
            continue
        assert 0 < len(hashes) <= messages.MAX_FETCH_BLOCKS and messages.peer_ok(peer, md)


def _reply_strategy():
    hashes = [11, 22, 33, 44]
    blob = st.fixed_dictionaries(
        {
            "size": st.integers(-5, 300) | st.booleans(),
            "first": st.integers(-2, 6),
            "count": st.integers(-1, 5),
            "j": st.integers(-1, 5),
            "meta": st.fixed_dictionaries({"hashes": st.permutations(hashes + [55, 66])}) | msgpack_values,
            "descs": st.lists(st.lists(st.integers(-5, 2**64) | st.booleans(), min_size=1, max_size=3), max_size=4)
            | msgpack_values,
        }
    )
    return st.fixed_dictionaries({"blobs": st.lists(blob, max_size=4) | msgpack_values}), hashes


REPLIES, REQUESTED = _reply_strategy()


@settings(FUZZ, max_examples=400)
@given(REPLIES)
def test_transfer_reply_checks(reply):
    """Whatever a peer replies, the decode side either refuses it (TransferError) or accepts a plan whose runs tile
    exactly the requested blocks, name them in the blob metadata, and whose descriptors add up to each blob."""
    try:
        runs, remote = messages.plan_reply(reply, REQUESTED)
    except TransferError:
        return
    j = offset = 0
    for r in runs:
        assert r.at == j and r.size > 0
        assert r.meta is None or r.meta["hashes"] == REQUESTED[j : j + r.count]  # only requested hashes are kept
        assert r.offset == offset
        j += r.count
        offset += r.size
    assert j == len(REQUESTED) and sum(n for _, n, _ in remote) == offset


# ---------------------------------------------------------------------------------------------- configuration
@settings(FUZZ, max_examples=200)
@given(st.dictionaries(st.sampled_from(sorted(s.env for s in kvtc_settings.select("tier"))), st.text()))
def test_tier_config_from_any_environment(env):
    try:
        cfg = TierConfig.from_env(env)
    except ConfigError as e:
        assert "DYN_KVTC_" in str(e) or "must" in str(e)
        return
    assert cfg.host_bytes >= 0 and cfg.page_bytes >= 512 and cfg.nixl_timeout_s > 0


def test_fuzz_targets_exist_for_atheris():
    root = Path(__file__).resolve().parents[1] / "integration" / "fuzz"
    assert (root / "README.md").is_file()
    for name in ("fuzz_blob.py", "fuzz_disk_index.py", "fuzz_control.py"):
        src = (root / name).read_text()
        compile(src, name, "exec")
        assert "atheris.Setup" in src and "TestOneInput" in src
    assert os.access(root / "run.sh", os.X_OK)
