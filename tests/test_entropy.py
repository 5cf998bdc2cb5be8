"""The entropy coders' registry: lookups, what a coder promises (exact sizes, worst-case expansion, the container's
bound), and that a coder registered with one line (the tests' ``lzma``) goes through both codecs and the container
like the built-in CPU coder (``cpu_tag``: both)."""

from __future__ import annotations

import pytest
import torch

from dynamo_kvtc.codec import KvtcCodec
from dynamo_kvtc.codec.container import parse_blob, section_chunks
from dynamo_kvtc.codec.entropy import (
    CHUNK_BYTES,
    PORTABLE,
    Coder,
    EntropyCoder,
    check_readable,
    coder,
    gpu_only_tags,
    known,
    nvcomp_tags,
    register,
    tags,
)
from dynamo_kvtc.codec.entropy.deflate import Deflate
from dynamo_kvtc.codec.options import CodecOptions
from dynamo_kvtc.errors import ConfigError, CorruptBlobError, DecodeError, UnsupportedCodecError

FORCE = CodecOptions(fused="force", fused_strict=True)  # the fused path (its batched entropy stage) on the CPU


def test_lookup_names_the_unknown_tag_and_the_known_ones():
    assert tags()[:4] == ("store", "deflate", "gdeflate", "ans") and PORTABLE == "deflate"
    assert gpu_only_tags() >= {"gdeflate", "ans"} and "deflate" in nvcomp_tags() and "store" not in nvcomp_tags()
    assert coder("deflate").cpu and coder("deflate").nvcomp == "Deflate" and not coder("ans").cpu
    with pytest.raises(UnsupportedCodecError, match=r"'zip'.*known: store, deflate, gdeflate, ans"):
        coder("zip")
    with pytest.raises(ConfigError, match="'zip'"):  # a writer's configuration asks for its own error
        coder("zip", ConfigError)
    with pytest.raises(UnsupportedCodecError, match="unknown"):
        check_readable("zip", "cpu")
    assert not known(["deflate"]) and not known(None) and known("ans")  # a hostile header's tag may be anything


def test_the_gpu_choices_are_the_registrys_nvcomp_coders():
    """The settings table (a foundation module: it cannot import the codec) repeats them; this keeps them equal."""
    from dynamo_kvtc import settings
    from dynamo_kvtc.codec.options import GPU_TAGS

    assert settings.BY_KEY["gpu_entropy"].choices == nvcomp_tags() == GPU_TAGS == ("deflate", "gdeflate", "ans")
    assert settings.default("gpu_entropy") in nvcomp_tags() and CodecOptions().gpu_tag in nvcomp_tags()
    with pytest.raises(ConfigError, match="gpu_entropy"):
        CodecOptions(gpu_entropy="store")  # no nvCOMP algorithm: not a GPU codec


def test_register_refuses_what_the_format_cannot_hold():
    class Nothing(Coder):
        tag = "nothing"
        cpu = False

    class Huge(Coder):
        tag = "huge"
        max_expansion = 2 * CHUNK_BYTES

    with pytest.raises(ConfigError, match="already registered"):
        register(Deflate())
    with pytest.raises(ConfigError, match="neither"):
        register(Nothing())
    with pytest.raises(ConfigError, match="max_expansion"):
        register(Huge())
    assert not known("nothing") and not known("huge")


def test_the_container_bound_is_each_coders():
    assert coder("store").fits(100, 100) and not coder("store").fits(100, 101)
    assert coder("deflate").fits(64, CHUNK_BYTES) and not coder("deflate").fits(10, CHUNK_BYTES)  # 1032:1 at most
    assert not coder("gdeflate").fits(10, CHUNK_BYTES) and coder("ans").fits(1, CHUNK_BYTES)  # ANS: the chunk cap


@pytest.mark.parametrize("n", [1, 1000, CHUNK_BYTES, 3 * CHUNK_BYTES + 17])
def test_section_round_trip_within_the_worst_case(cpu_tag, n):
    g = torch.Generator().manual_seed(n)
    ec = EntropyCoder(cpu_tag)
    for data in (torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g), torch.zeros(n, dtype=torch.uint8)):
        chunks = ec.compress(data)
        assert len(chunks) == -(-n // CHUNK_BYTES)
        for c, s in zip(chunks, [CHUNK_BYTES] * (len(chunks) - 1) + [n - CHUNK_BYTES * (len(chunks) - 1)]):
            assert 0 < len(c) <= s + ec.coder.max_expansion and coder(cpu_tag).fits(len(c), s)
        assert torch.equal(ec.decompress(chunks, n), data)
    assert ec.compress(torch.empty(0, dtype=torch.uint8)) == [] and ec.decompress([], 0).numel() == 0


def test_damaged_chunks_never_decode(cpu_tag):
    ec = EntropyCoder(cpu_tag)
    data = torch.randint(0, 16, (2 * CHUNK_BYTES + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    chunks = ec.compress(data)
    for bad, n in (
        (chunks[:-1], data.numel()),  # a chunk missing
        (chunks[:-1] + [chunks[-1][:-2]], data.numel()),  # the last one truncated
        (chunks[:-1] + [chunks[-1] + b"\0\0"], data.numel()),  # bytes after the stream
        (chunks, data.numel() - 1),  # a stream longer than the header says
        ([chunks[0][: len(chunks[0]) // 2]] + chunks[1:], data.numel()),  # a stream cut in the middle
    ):
        with pytest.raises(CorruptBlobError):
            ec.decompress(bad, n)


def test_a_registered_coder_goes_through_codec_and_container(synth, synth_cal, cpu_tag):
    """The same quantized codes whatever the coder: a blob written with ``cpu_tag`` decodes to exactly what the
    Deflate blob decodes to, its coded sections carry the tag, and the container checks them with its bound."""
    k, v, pos = synth.sample(300, start=40)
    ref = KvtcCodec(synth_cal, ratio=8)
    codec = KvtcCodec(synth_cal, ratio=8, tag=cpu_tag)
    blob = codec.encode(k, v, pos)
    _, recs = parse_blob(blob)
    assert {r.tag for r in recs if r.name.endswith((".k", ".v"))} == {cpu_tag}
    for r in recs:  # parse_blob checked each chunk against its coder's bound; each section decodes on its own
        if r.raw_len:
            assert EntropyCoder(r.tag).decompress(section_chunks(blob, r), r.raw_len).numel() == r.raw_len
    got, want = codec.decode(blob), ref.decode(ref.encode(k, v, pos))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(ref.decode(blob)[0], want[0])  # any reader decodes it: the tag says which coder


def test_the_fused_batch_stage_takes_any_registered_coder(synth, synth_cal, cpu_tag):
    """The fused codec's batched entropy stage asks the registry too: it writes ``cpu_tag`` sections that the
    reference path reads, and reads them back itself."""
    k, v, pos = synth.sample(300, start=7)
    fus = KvtcCodec(synth_cal, ratio=8, window=32, tag=cpu_tag, options=FORCE)
    blob = fus.encode(k, v, pos)
    assert fus.fused is not None and cpu_tag in {r.tag for r in parse_blob(blob)[1]}
    base = KvtcCodec(synth_cal, ratio=8, window=32, options=FORCE).encode(k, v, pos)
    ref = KvtcCodec(synth_cal, ratio=8, window=32)
    a, b = ref.decode(blob), ref.decode(base)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # the same codes, another coder
    c, d = fus.decode(blob), fus.decode(base)  # the fused decode (its own, fp16 math) of both
    assert torch.equal(c[0], d[0]) and torch.equal(c[1], d[1])


def test_a_tag_nobody_registered_is_a_corrupt_blob(synth, synth_cal):
    from .lzma_coder import registered

    k, v, pos = synth.sample(200)
    with registered() as tag:
        blob = KvtcCodec(synth_cal, ratio=8, tag=tag).encode(k, v, pos)
        KvtcCodec(synth_cal, ratio=8).decode(blob)  # known: decodes
    with pytest.raises(CorruptBlobError, match="tag 'lzma'"):
        parse_blob(blob)
    with pytest.raises(DecodeError):
        KvtcCodec(synth_cal, ratio=8).decode(blob)
    with pytest.raises(ConfigError, match="'lzma'; known"):
        KvtcCodec(synth_cal, ratio=8, tag=tag)
