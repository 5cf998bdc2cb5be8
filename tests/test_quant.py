"""Group quantizers and bit packing."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_kvtc.codec.plan import pack_codes, unpack_codes
from dynamo_kvtc.codec.quant import dequantize, group_cost_bits, group_sq_error, quantize


def test_int_error_within_half_step():
    x = torch.randn(64, 10, 16) * 5 + 2
    for kind, levels in (("int2", 3), ("int4", 15)):
        codes, shift, scale = quantize(x, kind)
        assert int(codes.max()) <= levels
        xh = dequantize(codes, shift, scale, kind)
        step = scale.float()[..., None]
        # half a step, plus the fp16 rounding of shift/scale that the decoder also sees
        assert bool(((xh - x).abs() <= step * 0.5 + 1e-2 * x.abs().amax() / levels + 1e-6).all())


def test_fp8_relative_error():
    x = torch.randn(128, 4, 64) * 3 + 10  # offset: the fp8 shift centres it
    codes, shift, scale = quantize(x, "fp8")
    xh = dequantize(codes, shift, scale, "fp8")
    rel = float((xh - x).norm() / (x - x.mean()).norm())
    assert rel < 0.05


def test_more_bits_less_error_and_costs():
    x = torch.randn(256, 8, 64)
    e2, e4, e8 = (float(group_sq_error(x, k).sum()) for k in ("int2", "int4", "fp8"))
    ez = float(group_sq_error(x, "none").sum())
    assert ez > e2 > e4 > e8 > 0
    assert group_cost_bits("int4", 64) == 4 * 64 + 32 and group_cost_bits("none", 1024) == 0


def test_constant_group_is_exact_enough():
    x = torch.full((4, 2, 16), 3.25)
    for kind in ("int2", "int4", "fp8"):
        codes, shift, scale = quantize(x, kind)
        assert torch.allclose(dequantize(codes, shift, scale, kind), x)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.integers(0, 300), st.integers(0, 2**31))
def test_pack_roundtrip(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.numel() == (n * bits + 7) // 8
    assert torch.equal(unpack_codes(packed, bits, n), codes)
