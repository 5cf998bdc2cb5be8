"""Damaged blobs: every corruption or truncation is refused with DecodeError, never garbage, never a crash."""

from __future__ import annotations

import struct
import zlib

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_kvtc import KvtcCodec
from dynamo_kvtc.codec.container import MAGIC, PREFIX, parse_blob
from dynamo_kvtc.errors import CorruptBlobError, DecodeError


@pytest.fixture(scope="module")
def blob_and_codec(synth, synth_cal):
    codec = KvtcCodec(synth_cal, ratio=8, window=32)
    k, v, pos = synth.sample(200, start=0)
    return codec.encode(k, v, pos), codec


def test_intact_blob_decodes(blob_and_codec):
    blob, codec = blob_and_codec
    codec.decode(blob)
    assert blob[:4] == MAGIC


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_bit_flip_is_refused(blob_and_codec, data):
    blob, codec = blob_and_codec
    pos = data.draw(st.integers(0, len(blob) - 1))
    bit = data.draw(st.integers(0, 7))
    bad = bytearray(blob)
    bad[pos] ^= 1 << bit
    with pytest.raises(DecodeError):
        codec.decode(bytes(bad))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_truncation_or_extension_is_refused(blob_and_codec, data):
    blob, codec = blob_and_codec
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(DecodeError):
        codec.decode(blob[:cut])
    with pytest.raises(DecodeError):
        codec.decode(blob + data.draw(st.binary(min_size=1, max_size=64)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400))
def test_random_bytes_refused(blob_and_codec, junk):
    _, codec = blob_and_codec
    with pytest.raises(DecodeError):
        codec.decode(junk)
    with pytest.raises(DecodeError):
        codec.decode(MAGIC + junk)


def _reheader(blob: bytes, edit) -> bytes:
    """Rewrite the header (with a valid header CRC) to test the semantic checks behind the checksum."""
    _, ver, flags, hlen, _ = PREFIX.unpack_from(blob, 0)
    h = msgpack.unpackb(blob[PREFIX.size : PREFIX.size + hlen])
    edit(h)
    hb = msgpack.packb(h)
    return PREFIX.pack(MAGIC, ver, flags, len(hb), zlib.crc32(hb)) + hb + blob[PREFIX.size + hlen :]


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h.__setitem__("tokens", h["tokens"] + 1), "positions cover"),
        (lambda h: h.__setitem__("tokens", 1 << 30), "tokens"),
        (lambda h: h.__setitem__("sinks", 10**6), "sinks"),
        (lambda h: h.__setitem__("positions", [[5, 100], [0, 100]]), "increasing"),
        (lambda h: h.__setitem__("ratio", 5.0), "no plan|ratio"),
        (lambda h: h.__setitem__("dtype", "int8"), "dtype"),
        (lambda h: h["sections"][1].__setitem__(2, h["sections"][1][2] + 2), "chunk count|match the sizes"),
        (lambda h: h["sections"][1].__setitem__(1, "lz77"), "tag"),
        (lambda h: h.__setitem__("groups", [[0, 2], [2, 4]]), "groups"),
        (lambda h: h.__setitem__("mode", "magic"), "mode"),
        (lambda h: h.pop("cal"), "cal"),
        (lambda h: h.__setitem__("window", h["window"] - 1), "match the sizes|positions"),
    ],
)
def test_semantic_header_damage(blob_and_codec, edit, match):
    blob, codec = blob_and_codec
    with pytest.raises(CorruptBlobError, match=match):
        codec.decode(_reheader(blob, edit))


def test_huge_header_length_refused_before_allocation(blob_and_codec):
    blob, codec = blob_and_codec
    bad = PREFIX.pack(MAGIC, 1, 0, 0xFFFFFFFF, 0) + blob[PREFIX.size :]
    with pytest.raises(CorruptBlobError, match="header length"):
        codec.decode(bad)


def test_version_and_flags(blob_and_codec):
    blob, codec = blob_and_codec
    _, ver, flags, hlen, crc = PREFIX.unpack_from(blob, 0)
    with pytest.raises(CorruptBlobError, match="version 2"):
        codec.decode(PREFIX.pack(MAGIC, 2, flags, hlen, crc) + blob[PREFIX.size :])
    with pytest.raises(CorruptBlobError, match="flags"):
        codec.decode(PREFIX.pack(MAGIC, ver, 1, hlen, crc) + blob[PREFIX.size :])


def test_parse_reports_layout(blob_and_codec):
    blob, _ = blob_and_codec
    h, recs = parse_blob(blob)
    assert [r.name for r in recs] == ["0.sinks", "0.k", "0.v", "0.window"]
    assert recs[-1].offset + recs[-1].stored_len == len(blob)
    assert struct.unpack_from("<4s", blob)[0] == MAGIC and h["tokens"] == 200


def test_container_and_codec_package_import_without_torch():
    """``dynamo-kvtc inspect`` reads blobs without torch: the container, its tags and the lazy ``codec`` package
    import neither torch nor numpy (checked with bare parent packages, so only these modules' own imports count)."""
    import subprocess
    import sys

    code = (
        "import sys, types, importlib.util\n"
        "root = types.ModuleType('dynamo_kvtc'); root.__path__ = ['dynamo_kvtc']; sys.modules['dynamo_kvtc'] = root\n"
        "spec = importlib.util.spec_from_file_location('dynamo_kvtc.codec', 'dynamo_kvtc/codec/__init__.py',\n"
        "    submodule_search_locations=['dynamo_kvtc/codec'])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['dynamo_kvtc.codec'] = m; spec.loader.exec_module(m)\n"
        "from dynamo_kvtc.codec import MAGIC, TAGS, BlobHeader, parse_blob, write_blob\n"
        "from dynamo_kvtc.codec.container import frame_header\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'numpy'))\n"
        "assert not bad, bad\n"
        "from dynamo_kvtc.codec import KvtcCodec\n"
        "assert 'torch' in sys.modules\n"
    )
    from pathlib import Path

    import dynamo_kvtc

    repo = Path(dynamo_kvtc.__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
