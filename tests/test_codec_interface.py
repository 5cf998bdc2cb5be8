"""The codec's types at its edges: BlobView (one type for a blob's bytes, whatever holds them) and the one factory
that picks an implementation from CodecOptions, never from the environment."""

from __future__ import annotations

import pytest
import torch

from dynamo_kvtc.codec import BlobView, Codec, CodecOptions, KvtcCodec, make_codec
from dynamo_kvtc.codec.factory import entropy_tag
from dynamo_kvtc.errors import InputError


def test_blob_view_tells_every_form_apart_in_one_place():
    data = bytes(range(200))
    t = torch.frombuffer(bytearray(b"xx" + data), dtype=torch.uint8)
    views = [BlobView.of(data), BlobView.of(bytearray(data)), BlobView.of(memoryview(data)), BlobView.of((t, 2, 200))]
    for v in views:
        assert len(v) == 200 and bytes(v.host()) == data and not v.arriving and not v.on_device
        v.wait_for(200)  # landed: at once
    assert views[0].slice() is None and torch.equal(views[3].slice(), torch.tensor(list(data), dtype=torch.uint8))
    assert BlobView.of(views[3]) is views[3]
    with pytest.raises(InputError):
        BlobView(t, 100, 200)  # past the tensor's end


def test_a_leased_view_releases_its_owner_once():
    released = []
    v = BlobView(b"abc", on_release=lambda: released.append(1))
    v.release()
    v.release()
    assert released == [1]


def test_the_factory_picks_from_options_never_from_the_environment(synth_cal, monkeypatch):
    monkeypatch.setenv("DYN_KVTC_FUSED", "force")  # ignored: the codec reads only its options
    monkeypatch.setenv("DYN_KVTC_PROJECTION", "fp8")
    ref = make_codec(synth_cal, ratio=8)
    assert isinstance(ref, KvtcCodec) and isinstance(ref, Codec)
    assert ref.fused is None and ref.config.projection == "auto" and ref.config.tag == "deflate"
    assert ref.calibration_id == synth_cal.id and ref.ratio == 8.0
    fus = make_codec(synth_cal, ratio=8, options=CodecOptions(fused="force", projection="fp16"))
    assert fus.fused is not None and fus.config.projection == "fp16"
    assert entropy_tag("cpu", CodecOptions(gpu_entropy="ans")) == "deflate"  # the CPU writes what everyone reads
