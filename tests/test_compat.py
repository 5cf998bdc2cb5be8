"""Blobs written before a change still decode, and today's writers still write the same bytes.

The fixtures in ``tests/data/compat`` (see its ``make_fixtures.py``) were written by the reference writer of the
format (version 1, ``deflate`` and ``store`` tags) before issue 12 moved the header and framing into one place. The
calibration there makes every float operation exact or a single correctly rounded element-wise operation, so the
stored decodes are bit-identical on any CPU (the fused path is run with its torch stages on the CPU here; its Triton
kernels on a GPU round differently, so they write other bytes for two cases: the H200 check compares old and new
code there instead, see the issue-12 report). Cases: sinks + coded + raw window over two layer groups; a short span
stored raw; positions in two runs with neither sinks nor window; ``store``-tagged coded sections with fp8 groups.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dynamo_kvtc.codec.container import parse_blob

DATA = Path(__file__).resolve().parent / "data" / "compat"


def _fixtures():
    spec = importlib.util.spec_from_file_location("compat_fixtures", DATA / "make_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FIX = _fixtures()
CASES = list(FIX.CASES)


@pytest.fixture(scope="module")
def cal():
    return FIX.load_calibration()


def _codecs(cal, name):
    _, _, _, ratio, window, tag = FIX.CASES[name]
    return FIX.codecs(cal, ratio, window, tag)


def test_fixture_calibration_is_the_one_the_blobs_name(cal):
    for name in CASES:
        h, _ = parse_blob((DATA / f"{name}.kvtc").read_bytes())
        assert h["cal"] == cal.id


@pytest.mark.parametrize("name", CASES)
def test_old_blobs_decode_bit_identically(cal, name):
    blob = (DATA / f"{name}.kvtc").read_bytes()
    expect = load_file(str(DATA / f"{name}.expect.safetensors"))
    ref, fus = _codecs(cal, name)
    for prefix, codec in (("ref", ref), ("fused", fus)):
        k, v = codec.decode(blob)
        assert k.dtype == expect[f"{prefix}_keys"].dtype
        assert torch.equal(k, expect[f"{prefix}_keys"]), prefix
        assert torch.equal(v, expect[f"{prefix}_values"]), prefix
        layers = list(codec.decode_layers(blob))
        assert [i for i, _, _ in layers] == list(range(k.shape[0]))
        assert torch.equal(torch.stack([x for _, x, _ in layers]), k)
    assert torch.equal(ref.positions(blob), load_file(str(DATA / f"{name}.inputs.safetensors"))["positions"])


@pytest.mark.parametrize("name", CASES)
def test_writers_write_the_same_bytes_as_before(cal, name):
    """Both writers (reference; fused with torch stages on the CPU) reproduce the stored blob byte for byte."""
    blob = (DATA / f"{name}.kvtc").read_bytes()
    inp = FIX.load_case(name)
    ref, fus = _codecs(cal, name)
    assert ref.encode(inp["keys"], inp["values"], inp["positions"]) == blob
    assert fus.encode(inp["keys"], inp["values"], inp["positions"]) == blob


def test_fused_batch_writes_the_same_bytes_as_before(cal):
    """Several spans in one fused batch: each blob equals its stored one."""
    from dynamo_kvtc.codec.gpu import DenseKV, Span

    names = [n for n in CASES if FIX.CASES[n][3:] == FIX.CASES[CASES[0]][3:]]  # same ratio, window and tag
    _, fus = _codecs(cal, names[0])
    inps = [FIX.load_case(n) for n in names]
    keys = torch.cat([i["keys"] for i in inps], dim=1)
    values = torch.cat([i["values"] for i in inps], dim=1)
    starts = [0]
    for i in inps[:-1]:
        starts.append(starts[-1] + i["keys"].shape[1])
    src = DenseKV(keys, values, seq_starts=starts)
    blobs = fus.fused.encode_batch(src, [Span(i, 0, inp["positions"]) for i, inp in enumerate(inps)])
    assert blobs == [(DATA / f"{n}.kvtc").read_bytes() for n in names]
