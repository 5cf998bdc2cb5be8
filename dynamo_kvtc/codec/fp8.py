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


# ---------------------------------------------------------------- FP8 KV caches (the engine's storage, not the codec's)
# vLLM's --kv-cache-dtype names -> the float8 format the cache holds (its tensors may be uint8 holding those bytes)
KV_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_format(cache_dtype: str) -> torch.dtype | None:
    """The float8 dtype of vLLM cache dtype ``cache_dtype`` (``fp8``/``fp8_e4m3``/``fp8_e5m2``), None for others."""
    return KV_FORMATS.get(str(cache_dtype))


def as_fp8(t: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``t`` (uint8 bytes or already ``fmt``) viewed as ``fmt`` without a copy."""
    return t if t.dtype == fmt else t.view(fmt)


def dequantize(t: torch.Tensor, fmt: torch.dtype, scale: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Values of FP8 cache bytes ``t``: ``x * scale`` in ``dtype`` (bfloat16 holds every ``q * scale`` closely enough
    that :func:`quantize` gives back the same byte)."""
    return (as_fp8(t, fmt).to(torch.float32) * scale).to(dtype)


def quantize(x: torch.Tensor, fmt: torch.dtype, scale: float, storage: torch.dtype) -> torch.Tensor:
    """``x / scale`` rounded to ``fmt``, saturating at its largest finite value, as ``storage`` (uint8 or ``fmt``)."""
    hi = torch.finfo(fmt).max
    q = (x.to(torch.float32) / scale).clamp_(-hi, hi).to(fmt)
    return q if storage == fmt else q.view(storage)


def round_fp8(x: torch.Tensor, fmt: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as an FP8 cache with ``scale`` holds it, in ``x``'s dtype (calibrating on what the engine stores)."""
    return dequantize(quantize(x, fmt, scale, fmt), fmt, scale, x.dtype)


def source_name(fmt: torch.dtype | None) -> str | None:
    """The blob header's ``kv`` for an FP8 cache of ``fmt`` (None: a 16/32-bit cache)."""
    return {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(fmt)


def mark_kv_source(codec: object, name: str | None) -> None:
    """Make ``codec`` (and the codecs it delegates to) write ``kv=name`` into its blobs and read only such blobs."""
    seen: set[int] = set()
    todo = [codec]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        c.kv_source = name
        todo += [getattr(c, a, None) for a in ("base", "reference", "codec", "fc", "fused")]
