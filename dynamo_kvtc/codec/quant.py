"""Group quantization of PCA coefficients (paper §3.2): types none / int2 / int4 / fp8, fp16 shift and scale.

A *group* is a run of consecutive PCA coordinates of one token. Every coded group carries a 16-bit shift and a 16-bit
scale per token (Microscaling convention, working assumption A2), counted in the DP's bit budget.

- ``int2`` / ``int4``: KIVI-style asymmetric min/max uniform quantization. ``shift = fp16(min)``,
  ``scale = fp16((max - shift) / (2^b - 1))``, ``code = clamp(round((x - shift) / scale), 0, 2^b - 1)``,
  ``x^ = shift + code * scale``.
- ``fp8``: E4M3 of the centred group. ``shift = fp16((min + max) / 2)``,
  ``scale = fp16(max|x - shift| / 448)``, ``code = e4m3((x - shift) / scale)``, ``x^ = shift + e4m3 * scale``.
  The paper does not say how fp8 uses the shift and scale (ambiguity A3); centring uses both 16-bit fields and
  never does worse than a zero shift on a group's range.

The encoder quantizes with the fp16-rounded shift and scale the decoder will read (A4), and the DP measures the error
of exactly this function.
"""

from __future__ import annotations

import torch

KINDS = ("none", "int2", "int4", "fp8")
BITS = {"none": 0, "int2": 2, "int4": 4, "fp8": 8}
META_BITS = 32  # 16-bit shift + 16-bit scale per token per coded group
FP8_MAX = 448.0
FP16_MAX = 65504.0


def group_cost_bits(kind: str, size: int) -> int:
    """Bits per token of one group of ``size`` coordinates coded as ``kind`` (payload + shift + scale)."""
    if kind == "none":
        return 0
    return BITS[kind] * size + META_BITS


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize groups ``x [..., g]`` (float32) along the last dim.

    Returns ``codes`` (uint8, same shape as x: int codes 0..2^b-1, or E4M3 bit patterns), and ``shift``, ``scale``
    (float16, shape ``x.shape[:-1]``).
    """
    lo = x.amin(dim=-1)
    hi = x.amax(dim=-1)
    if kind in ("int2", "int4"):
        levels = (1 << BITS[kind]) - 1
        shift = _fp16(lo)
        scale = _fp16((hi - shift.float()) / levels)
        sf = scale.float()
        inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
        q = torch.round((x - shift.float()[..., None]) * inv[..., None]).clamp_(0, levels)
        return q.to(torch.uint8), shift, scale
    if kind == "fp8":
        shift = _fp16((lo + hi) * 0.5)
        centred = x - shift.float()[..., None]
        scale = _fp16(centred.abs().amax(dim=-1) / FP8_MAX)
        sf = scale.float()
        inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
        y = (centred * inv[..., None]).clamp_(-FP8_MAX, FP8_MAX)
        return y.to(torch.float8_e4m3fn).view(torch.uint8), shift, scale
    raise ValueError(f"cannot quantize kind {kind!r}")


def dequantize(codes: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """Inverse of :func:`quantize`: float32 of ``codes.shape``."""
    if kind in ("int2", "int4"):
        vals = codes.float()
    elif kind == "fp8":
        vals = codes.view(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"cannot dequantize kind {kind!r}")
    return vals * scale.float()[..., None] + shift.float()[..., None]


def group_sq_error(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Sum of squared reconstruction error of each group: ``x [T, n, g]`` -> float64 ``[n]`` (summed over T and g)."""
    if kind == "none":
        return x.double().square().sum(dim=(0, 2))
    codes, shift, scale = quantize(x, kind)
    err = (dequantize(codes, shift, scale, kind) - x).double().square()
    return err.sum(dim=(0, 2))
