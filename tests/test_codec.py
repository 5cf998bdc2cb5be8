"""KvtcCodec on synthetic KV with real RoPE: round trips, segments, accounting, bad input, artifact I/O."""

from __future__ import annotations

import json

import pytest
import torch

from dynamo_kvtc import Calibration, KvtcCodec, calibrate
from dynamo_kvtc.codec.container import BlobHeader, parse_blob, write_blob
from dynamo_kvtc.errors import (
    CalibrationError,
    CalibrationMismatchError,
    ConfigError,
    InputError,
    UnsupportedCodecError,
    WrongCalibrationError,
)

from .conftest import SyntheticKV, make_fp


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_roundtrip_shapes_dtype_segments(synth, synth_cal, cpu_tag):
    codec = KvtcCodec(synth_cal, ratio=8, tag=cpu_tag)
    k, v, pos = synth.sample(400, start=0)
    blob = codec.encode(k, v, pos)
    k2, v2 = codec.decode(blob)
    assert k2.shape == k.shape and k2.dtype == k.dtype and v2.dtype == v.dtype
    assert torch.equal(k2[:, -128:], k[:, -128:]) and torch.equal(v2[:, -128:], v[:, -128:])  # window raw
    assert rel(k2[:, :4], k[:, :4]) < 0.05  # sinks in fp8
    assert rel(k2[:, 4:-128], k[:, 4:-128]) < 0.1 and rel(v2[:, 4:-128], v[:, 4:-128]) < 0.1
    assert torch.equal(codec.positions(blob), pos)
    st = codec.stats(blob)
    assert (st["sink_tokens"], st["coded_tokens"], st["window_tokens"]) == (4, 268, 128)
    assert st["ratio_before_entropy"] == pytest.approx(8.0, rel=0.02)
    assert st["ratio"] > 7.0 and st["ratio_with_window"] < st["ratio"]
    assert st["plan"]["k"]["bits_per_token"] <= st["plan"]["k"]["budget_bits"]


def test_decode_layers_in_order_equal_decode(synth, synth_cal, cpu_tag):
    codec = KvtcCodec(synth_cal, ratio=16, tag=cpu_tag)
    k, v, pos = synth.sample(300, start=1000)  # mid-sequence span: no sinks
    blob = codec.encode(k, v, pos)
    layers = list(codec.decode_layers(blob))
    assert [layer for layer, _, _ in layers] == list(range(k.shape[0]))
    k2, v2 = codec.decode(blob)
    for layer, kl, vl in layers:
        assert torch.equal(kl, k2[layer]) and torch.equal(vl, v2[layer])
    assert codec.stats(blob)["sink_tokens"] == 0


def test_lower_ratio_lower_error(synth, synth_cal):
    k, v, pos = synth.sample(600, start=10)
    errs = []
    for r in (4, 8, 16):
        codec = KvtcCodec(synth_cal, ratio=r, window=0)
        k2, v2 = codec.decode(codec.encode(k, v, pos))
        errs.append(rel(k2[:, 4:], k[:, 4:]) + rel(v2[:, 4:], v[:, 4:]))
    assert errs[0] < errs[1] < errs[2]


def test_rope_removal_matters(synth):
    """Positive control: keys are low-rank only before RoPE; a basis fitted with RoPE kept codes them worse."""
    samples = [synth.sample(512, start=i * 131) for i in range(6)]
    with_rope = calibrate(samples, synth.fp, ratios=(16,), dp_tokens=2048, progress=False, remove_rope=False)
    without = calibrate(samples, synth.fp, ratios=(16,), dp_tokens=2048, progress=False)
    k, v, pos = synth.sample(512, start=7000)
    e = {}
    for name, cal in (("kept", with_rope), ("removed", without)):
        codec = KvtcCodec(cal, ratio=16, window=0)
        e[name] = rel(codec.decode(codec.encode(k, v, pos))[0][:, 4:], k[:, 4:])
    assert e["removed"] < 0.5 * e["kept"]


def test_short_span_stored_raw(synth, synth_cal):
    codec = KvtcCodec(synth_cal, ratio=16, window=8, min_tokens=16)
    k, v, pos = synth.sample(20, start=100)
    blob = codec.encode(k, v, pos)
    k2, v2 = codec.decode(blob)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert codec.stats(blob)["mode"] == "raw"


def test_float32_and_float16_inputs(synth, synth_cal, cpu_tag):
    codec = KvtcCodec(synth_cal, ratio=8, tag=cpu_tag)
    for dt in (torch.float16, torch.float32):
        k, v, pos = synth.sample(200, dtype=dt)
        k2, v2 = codec.decode(codec.encode(k, v, pos))
        assert k2.dtype == dt and rel(k2[:, 4:72], k[:, 4:72]) < 0.1


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda k, v, p: (k[:3], v[:3], p), "layers=3"),
        (lambda k, v, p: (k, v[:, :-1], p), "differ in shape"),
        (lambda k, v, p: (k.to(torch.int32), v, p), "dtype"),
        (lambda k, v, p: (k, v.float(), p), "differ in dtype"),
        (lambda k, v, p: (k, v, p[:-1]), "one entry per token"),
        (lambda k, v, p: (k, v, p.flip(0)), "strictly increasing"),
        (lambda k, v, p: (k, v, p.float()), "integers"),
        (lambda k, v, p: (k, v, p - 10), ">= 0"),
        (lambda k, v, p: (k[0], v[0], p), r"\[num_layers"),
        (lambda k, v, p: (k.float().numpy(), v, p), "torch.Tensor"),
        (lambda k, v, p: (k.index_fill(1, torch.tensor([50]), float("nan")), v, p), "NaN"),
    ],
)
def test_bad_input_named(synth, synth_cal, mutate, match):
    codec = KvtcCodec(synth_cal, ratio=8)
    k, v, pos = synth.sample(100)
    with pytest.raises(InputError, match=match):
        codec.encode(*mutate(k, v, pos))


def test_bad_config(synth_cal):
    with pytest.raises(ConfigError, match="available: 4, 8, 16"):
        KvtcCodec(synth_cal, ratio=12)
    with pytest.raises(ConfigError, match="window"):
        KvtcCodec(synth_cal, ratio=8, window=-1)
    with pytest.raises(ConfigError, match="tag"):
        KvtcCodec(synth_cal, ratio=8, tag="zip")


def test_wrong_calibration_refused(synth, synth_cal):
    other = calibrate(
        [synth.sample(256, start=i * 3) for i in range(4)], synth.fp, ratios=(8,), dp_tokens=512, progress=False, seed=1
    )
    assert other.id != synth_cal.id
    k, v, pos = synth.sample(200)
    blob = KvtcCodec(synth_cal, ratio=8).encode(k, v, pos)
    with pytest.raises(WrongCalibrationError, match="another|calibration"):
        KvtcCodec(other, ratio=8).decode(blob)
    # and a calibration for another model shape is refused by fingerprint
    with pytest.raises(CalibrationMismatchError, match="num_layers"):
        synth_cal.check_model(make_fp(layers=6))


def test_gpu_only_tag_refused_on_cpu(synth, synth_cal, cpu_tag):
    codec = KvtcCodec(synth_cal, ratio=8, tag=cpu_tag)
    k, v, pos = synth.sample(200)
    blob = codec.encode(k, v, pos)
    h, recs = parse_blob(blob)
    mv = memoryview(blob)
    sections = []
    for r in recs:
        chunks, off = [], r.offset
        for n in r.chunks:
            chunks.append(bytes(mv[off : off + n]))
            off += n
        tag = "ans" if r.name.endswith((".k", ".v")) else r.tag
        sections.append((r.name, tag, r.raw_len, chunks))
    relabelled = write_blob(BlobHeader.from_dict(h), sections)
    with pytest.raises(UnsupportedCodecError, match="GPU-only"):
        codec.decode(relabelled)
    with pytest.raises(ConfigError, match="GPU-only"):
        KvtcCodec(synth_cal, ratio=8, tag="ans").encode(k, v, pos)


def test_calibration_save_load_and_damage(tmp_path, synth, synth_cal):
    path = synth_cal.save(tmp_path / "cal")
    loaded = Calibration.load(path)
    assert loaded.id == synth_cal.id and loaded.ratios == synth_cal.ratios
    k, v, pos = synth.sample(300)
    blob = KvtcCodec(synth_cal, ratio=8).encode(k, v, pos)
    a, b = KvtcCodec(synth_cal, ratio=8).decode(blob), KvtcCodec(loaded, ratio=8).decode(blob)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # a torn artifact (metadata missing) is never mistaken for a finished one
    (path / "calibration.json").rename(tmp_path / "meta.json")
    with pytest.raises(CalibrationError, match="not a finished calibration"):
        Calibration.load(path)
    (tmp_path / "meta.json").rename(path / "calibration.json")
    # a flipped byte in the tensors is caught by the checksum
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (path / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(CalibrationError, match="checksum"):
        Calibration.load(path)
    # edited metadata changes the id
    synth_cal.save(path)
    meta = json.loads((path / "calibration.json").read_text())
    meta["groups"][0]["k_plans"][0]["runs"][0][2] = (
        "int2" if meta["groups"][0]["k_plans"][0]["runs"][0][2] != "int2" else "int4"
    )
    (path / "calibration.json").write_text(json.dumps(meta))
    with pytest.raises(CalibrationError, match="id mismatch"):
        Calibration.load(path)
    with pytest.raises(CalibrationError, match="does not exist"):
        Calibration.load(tmp_path / "nope")


def test_layer_groups_and_tp_shard():
    fp = make_fp(layers=6, heads=4)
    data = SyntheticKV(fp, seed=3)
    samples = [data.sample(300, start=i * 300) for i in range(4)]
    cal = calibrate(samples, fp, ratios=(8,), layer_groups=3, tp_rank=1, tp_size=2, dp_tokens=512, progress=False)
    assert [g.layers for g in cal.groups] == [(0, 2), (2, 4), (4, 6)]
    assert cal.fingerprint.num_kv_heads == 2 and cal.fingerprint.tp_rank == 1 and cal.fingerprint.total_kv_heads == 4
    k, v, pos = data.sample(200, start=50)
    shard_k, shard_v = k[:, :, 2:4].contiguous(), v[:, :, 2:4].contiguous()
    codec = KvtcCodec(cal, ratio=8, window=16)
    layers = list(codec.decode_layers(codec.encode(shard_k, shard_v, pos)))
    assert [x[0] for x in layers] == list(range(6))
    with pytest.raises(InputError, match="kv_heads=4"):
        codec.encode(k, v, pos)


def test_too_little_calibration_data(synth):
    with pytest.raises(CalibrationError, match="too short"):
        calibrate([synth.sample(20)], synth.fp, ratios=(8,), progress=False)
