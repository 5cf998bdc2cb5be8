"""128-bit block keys stored in every blob and checked on restore; disk records validated by type and range where
they enter; a group-writable disk directory refused.

Real store (synthetic shard, real codec, real NIXL POSIX disk I/O), real files on disk written with msgpack."""

from __future__ import annotations

import os
import random
import struct
import zlib

import msgpack
import pytest
import torch

from dynamo_kvtc.codec.blob import BlobView
from dynamo_kvtc.codec.container import blob_keys, parse_blob, with_keys
from dynamo_kvtc.errors import BadRecordError, BlobKeyError, ConfigError, CorruptBlobError, InputError
from dynamo_kvtc.tiers import DiskTier, KvtcStore, TierConfig, disk_format
from dynamo_kvtc.tiers.blobs import BlobMeta
from dynamo_kvtc.tiers.keys import check_blob_keys, keys_from_bytes, keys_to_bytes, sequence_hashes
from dynamo_kvtc.transport.channel import Limits, pack, unpack

from .conftest import offload_seq

BS = 16


@pytest.fixture(scope="module")
def nixl_files():
    from dynamo_kvtc.transport.nixl_io import NixlFiles

    return NixlFiles()


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _store(cal, disk_dir=None, host=1 << 20, disk=0) -> KvtcStore:
    cfg = TierConfig(
        host_bytes=host,
        disk_bytes=disk,
        disk_dir=disk_dir,
        ratio=8,
        min_tokens=32,
        page_bytes=1024,
        window=32,
        disk_min_uses=1,
    )
    return KvtcStore(cal, cfg, block_size=BS, span_tokens=128)


class Sink:
    """Records every write a restore makes."""

    def __init__(self) -> None:
        self.writes = 0

    def __call__(self, layer, start, k, v) -> None:
        self.writes += 1


# ---------------------------------------------------------------------------------------------- the blob field
def test_keys_field_round_trips_and_leaves_the_blob_decodable(synth, synth_cal):
    from dynamo_kvtc import KvtcCodec

    codec = KvtcCodec(synth_cal, ratio=8)
    k, v, pos = synth.sample(128)
    blob = codec.encode(k, v, pos)
    plain_h, plain_recs = parse_blob(blob)
    assert blob_keys(blob) is None  # a codec-level blob carries none
    keys = sequence_hashes(_tokens(128, 0), BS)
    keyed = with_keys(blob, keys_to_bytes(keys))
    assert keys_from_bytes(blob_keys(keyed)) == keys and len(blob) + 16 * len(keys) < len(keyed) < len(blob) + 17 * 16
    h, recs = parse_blob(keyed)
    assert h["keys"] == keys_to_bytes(keys) and [r.crc for r in recs] == [r.crc for r in plain_recs]
    for (la, ka, va), (lb, kb, vb) in zip(codec.decode_layers(blob), codec.decode_layers(keyed)):
        assert la == lb and torch.equal(ka, kb) and torch.equal(va, vb)  # the codec never reads the keys
    check_blob_keys(BlobView.of(keyed), 0, keys)
    check_blob_keys(BlobView.of(keyed), 3, keys[3:5])
    with pytest.raises(BlobKeyError, match="other blocks"):
        check_blob_keys(BlobView.of(keyed), 0, keys[1:3])  # the right keys at the wrong position
    with pytest.raises(BlobKeyError, match="other blocks"):
        check_blob_keys(BlobView.of(keyed), 7, keys[7:] + [5])  # past the blob's blocks
    with pytest.raises(BlobKeyError, match="no block keys"):
        check_blob_keys(BlobView.of(blob), 0, keys)
    with pytest.raises(InputError):
        with_keys(blob, b"\0" * 15)
    # a malformed keys field, or a binary value anywhere else, is a corrupt header
    for bad in ({"keys": b"\0" * 15}, {"keys": "ab"}, {"cal": b"x" * 32}):
        hb = msgpack.packb({**plain_h, **bad}, use_bin_type=True)
        forged = struct.pack("<4sHHII", b"KVTC", 1, 0, len(hb), zlib.crc32(hb)) + hb + blob[plain_recs[0].offset :]
        with pytest.raises(CorruptBlobError):
            parse_blob(forged)


def test_control_messages_carry_128_bit_keys_and_nothing_else_extended():
    keys = sequence_hashes(_tokens(96, 1), BS) + [0, (1 << 64) - 1, (1 << 128) - 1]
    assert unpack(pack({"hashes": keys}), Limits()) == {"hashes": keys}
    with pytest.raises(TypeError):
        pack({"h": 1 << 128})
    for ext in (msgpack.ExtType(2, b"\1" * 16), msgpack.ExtType(1, b"\1" * 15), msgpack.ExtType(1, b"\0" * 16)):
        with pytest.raises(Exception, match="not valid msgpack"):  # another code, length, or a 64-bit value as ext
            unpack(msgpack.packb({"h": ext}), Limits())


# ---------------------------------------------------------------------------------------------- restore checks
async def test_a_blob_indexed_under_other_keys_is_a_counted_miss(synth, synth_cal):
    """Two keys on one index slot: the index says key A lives in blob B (a collision or a wrong entry); the restore
    reads blob B, whose own keys are not A's, and refuses it: nothing written, counted, the blob dropped."""
    store = _store(synth_cal)
    ta, tb = _tokens(128, 10), _tokens(128, 11)
    ka, va, _ = synth.sample(128)
    kb, vb, _ = synth.sample(128)
    offload_seq(store, ta, ka, va)
    offload_seq(store, tb, kb, vb)
    ha, hb = store.hashes(ta), store.hashes(tb)
    meta_b = store.index.meta(store.index.locate(hb[0])[0])
    blob_b = bytes(store.placement.fetch(meta_b.id))
    forged = BlobMeta("collision", list(ha), BS, 0, meta_b.ratio, meta_b.cal, meta_b.raw_bytes, len(blob_b))
    store.placement.put(forged, blob_b)  # key A's slot now points at B's bytes
    assert store.match(ha) == len(ha)
    for lease in (False, True):  # a peer asking for A is not handed B's blob either
        with pytest.raises(BlobKeyError):
            store.export(ha, lease=lease)
    assert len(store.export(hb, lease=False)[0]) == 2  # B's own keys still export: its coded span and raw window
    sink = Sink()
    h = store.start_onboard(ha, sink=sink)
    assert not await h.done()
    assert isinstance(h.error, BlobKeyError) and sink.writes == 0
    snap = store.snapshot()
    assert snap["onboard_error_BlobKeyError"] == 1 and snap["blobs_dropped"] == 1
    assert store.match(ha) == 0  # the bad entry is gone; B itself still restores under its own keys
    sink_b = Sink()
    assert await store.start_onboard(hb, sink=sink_b).done() and sink_b.writes > 0
    store.close()


def _rewrite_record(path, **changes) -> None:
    """Rewrite a disk file's index record (valid CRCs: a consistent plant, or a record of the wrong types)."""
    data = path.read_bytes()
    mlen = struct.unpack_from("<I", data, 8)[0]
    rec = unpack(data[16 : 16 + mlen], disk_format.RECORD_LIMITS, what="record")
    blob = data[16 + mlen :]
    planted = dict(changes)
    blob = changes.pop("blob", blob)
    rec.update(changes.pop("record", {}))
    rec["meta"] = changes.pop("meta", rec["meta"])
    if "blob" in planted and isinstance(rec["meta"], dict) and "stored_bytes" in rec["meta"]:
        rec["meta"] = {**rec["meta"], "stored_bytes": len(blob)}  # consistent: the start-up length check passes
    rec["len"], rec["crc"] = len(blob), zlib.crc32(blob)
    mb = msgpack.packb(rec, use_bin_type=True, default=lambda o: msgpack.ExtType(1, o.to_bytes(16, "big")))
    path.write_bytes(struct.pack("<8sII", changes.pop("magic", disk_format.MAGIC), len(mb), zlib.crc32(mb)) + mb + blob)


def _on_disk(synth, synth_cal, d, n=4):
    """``n`` sequences offloaded through a store whose host tier is smaller than a blob (each goes to disk); closed."""
    store = _store(synth_cal, d, host=8 * 1024, disk=1 << 22)
    seqs = []
    for s in range(n):
        toks = _tokens(128, 100 + s)
        k, v, _ = synth.sample(128)
        offload_seq(store, toks, k, v)
        seqs.append(toks)
    ids = {m.id: m for m in store.index.metas() if store.placement.where(m.id) == "disk"}
    store.close()
    return seqs, ids


async def test_a_blob_file_planted_under_another_keys_name_is_refused(tmp_path, synth, synth_cal):
    """Blob B's bytes under blob A's file name, its record rewritten to A's id and keys with valid CRCs: what someone
    who can write the cache directory could plant. The blob's own keys disprove it: a counted miss, never served."""
    d = tmp_path / "g3"
    seqs, ids = _on_disk(synth, synth_cal, d)
    assert len(ids) >= 3
    a_id, b_id, c_id = sorted(ids)[:3]
    b_blob = disk_format.split_file((d / f"{b_id}.kvtc").read_bytes())[1]
    _rewrite_record(d / f"{a_id}.kvtc", blob=b_blob)  # A's record and keys, B's bytes
    # C: a blob without keys (as written before keys were stored) in a current file
    c_blob = bytes(disk_format.split_file((d / f"{c_id}.kvtc").read_bytes())[1])
    h, recs = parse_blob(c_blob)
    del h["keys"]
    hb = msgpack.packb(h, use_bin_type=True)
    c_plain = struct.pack("<4sHHII", b"KVTC", 1, 0, len(hb), zlib.crc32(hb)) + hb + c_blob[recs[0].offset :]
    parse_blob(c_plain)
    _rewrite_record(d / f"{c_id}.kvtc", blob=c_plain)
    store = _store(synth_cal, d, host=8 * 1024, disk=1 << 22)
    try:
        assert store.snapshot()["disk_recovered_blobs"] == len(ids)
        for blob_id, why in ((a_id, "other blocks"), (c_id, "no block keys")):
            hashes = ids[blob_id].hashes
            assert store.match(hashes) == len(hashes)
            sink = Sink()
            h = store.start_onboard(hashes, sink=sink)
            assert not await h.done() and sink.writes == 0
            assert isinstance(h.error, BlobKeyError) and why in str(h.error)
            assert store.match(hashes) == 0 and not (d / f"{blob_id}.kvtc").exists()
        assert store.snapshot()["onboard_error_BlobKeyError"] == 2
        ok = Sink()
        assert await store.start_onboard(ids[b_id].hashes, sink=ok).done() and ok.writes > 0  # B itself is fine
    finally:
        store.close()


# ---------------------------------------------------------------------------------------------- disk records
def test_records_of_the_wrong_types_are_dropped_and_counted_at_start_up(tmp_path, synth, synth_cal, caplog):
    d = tmp_path / "g3"
    seqs, ids = _on_disk(synth, synth_cal, d, n=6)
    victims = sorted(ids)[:5]
    good = {k: m for k, m in ids.items() if k not in victims}
    bad_metas = [
        5,  # not a map
        {**ids[victims[1]].to_dict(), "hashes": "abc"},  # a string where keys belong
        {**ids[victims[2]].to_dict(), "block_size": "16"},  # a string where an int belongs
        {**ids[victims[3]].to_dict(), "hashes": [[1, 2]]},  # unhashable keys (a TypeError in the index before)
        {k: v for k, v in ids[victims[4]].to_dict().items() if k != "cal"},  # a field missing
    ]
    for blob_id, meta in zip(victims, bad_metas):
        _rewrite_record(d / f"{blob_id}.kvtc", meta=meta)
    with caplog.at_level("WARNING", logger="dynamo_kvtc.tiers.placement"):
        store = _store(synth_cal, d, host=8 * 1024, disk=1 << 22)  # start-up never raises
    try:
        snap = store.snapshot()
        assert snap["disk_bad_records"] == len(victims) and snap["disk_recovered_blobs"] == len(good)
        assert all(not (d / f"{b}.kvtc").exists() for b in victims)
        reasons = [r.getMessage() for r in caplog.records if "dropping blob" in r.getMessage()]
        assert len(reasons) == len(victims) and any("hashes='abc'" in r for r in reasons)
        assert good and all(store.match(m.hashes) == len(m.hashes) for m in good.values())
    finally:
        store.close()


def test_blob_meta_checks_every_field():
    m = BlobMeta("a", [1 << 100, 7], 16, 0, 8.0, "c" * 32, 10, 5)
    assert BlobMeta.from_dict(m.to_dict()) == m
    for field, value in [
        ("id", 3),
        ("id", "../x"),
        ("hashes", []),
        ("hashes", [1 << 128]),
        ("hashes", [True]),
        ("block_size", 0),
        ("block_size", 1.5),
        ("first_position", -1),
        ("ratio", float("inf")),
        ("ratio", -2.0),
        ("ratio", "8"),
        ("cal", ""),
        ("raw_bytes", None),
        ("stored_bytes", 1 << 60),
    ]:
        with pytest.raises(BadRecordError, match=field):
            BlobMeta.from_dict({**m.to_dict(), field: value})
    with pytest.raises(BadRecordError, match="extra"):
        BlobMeta.from_dict({**m.to_dict(), "extra": 1})
    assert issubclass(BadRecordError, ValueError)  # the hand-off client's catch keeps working


def test_a_file_of_the_previous_format_is_dropped_with_its_reason(tmp_path, nixl_files, caplog):
    d = tmp_path / "g3"
    tier = DiskTier(d, 1 << 20, io=nixl_files)
    tier.put("old", os.urandom(1000), {"n": 1})
    tier.put("new", os.urandom(1000), {"n": 2})
    tier.close()
    _rewrite_record(d / "old.kvtc", magic=b"KVTCD001")
    with caplog.at_level("WARNING", logger="dynamo_kvtc.tiers.disk"):
        again = DiskTier(d, 1 << 20, io=nixl_files)
    try:
        assert again.ids() == ["new"] and again.dropped == 1 and not (d / "old.kvtc").exists()
        assert any("older version" in r.getMessage() for r in caplog.records)
    finally:
        again.close()


# ---------------------------------------------------------------------------------------------- the directory
@pytest.mark.parametrize("mode", [0o770, 0o720, 0o707, 0o777, 0o1777])
def test_group_or_world_writable_dir_is_refused(tmp_path, nixl_files, mode, synth_cal):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(ConfigError, match="group- or world-writable") as e:
        DiskTier(d, 1 << 20, io=nixl_files)
    assert str(d) in str(e.value) and "chmod go-w" in str(e.value)
    with pytest.raises(ConfigError, match="group- or world-writable"):  # the store (and so the connector) refuses
        _store(synth_cal, d, disk=1 << 20)
    os.chmod(d, 0o750)  # group-readable is fine
    DiskTier(d, 1 << 20, io=nixl_files).close()
