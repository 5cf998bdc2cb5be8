"""FP8 (e4m3) numerics both codec paths share: per-slice scales and the rounding an FP8 GEMM sees, which the reference
path emulates with ``projection="fp8"`` and the fused path's FP8 projector (:mod:`.gpu.projection`) runs."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def e4m3_scales(x: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 dequantization scales of ``x`` along ``dim`` (kept): ``amax / 448``, 1 where a slice is all zero."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=True, dtype=torch.float32)  # one read of x
    return torch.where(amax > 0, amax / E4M3_MAX, 1.0)


def fake_e4m3(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` rounded through e4m3 with one scale per slice along ``dim`` (``dim=1``: per row, ``dim=0``: per column)
    and back, in fp32: the operand an FP8 GEMM with those scales multiplies, since
    ``(A_q @ B_q) * s_a * s_b == (A_q * s_a) @ (B_q * s_b)``."""
    sc = e4m3_scales(x, dim)
    return (x.float() / sc).to(E4M3).float() * sc
