"""KIVI (Liu et al. 2024) as the kvtc paper configures it: keys quantized per channel in groups of ``group`` tokens,
values per token in groups of ``group`` channels, asymmetric min/max with fp16 scale and zero point, ``bits`` 2 or 4.
Tokens that do not fill a whole key group stay 16-bit (KIVI's residual; the recent ``window`` of 128 is kept exact
by the harness like KIVI's residual length 128)."""

from __future__ import annotations

import torch

from .base import Method


def _minmax(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Fake-quantize along the last dim with fp16 zero point and scale."""
    levels = (1 << bits) - 1
    lo = x.amin(dim=-1, keepdim=True).to(torch.float16).float()
    scale = ((x.amax(dim=-1, keepdim=True) - lo) / levels).to(torch.float16).float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return torch.round((x - lo) * inv).clamp(0, levels) * scale + lo


class Kivi(Method):
    def __init__(self, bits: int = 2, group: int = 32, window: int = 128) -> None:
        super().__init__(window)
        self.bits = bits
        self.group = group
        self.name = f"kivi-{bits}bit"

    def compress(self, keys, values):
        L, T, H, D = keys.shape
        g = self.group
        full = T // g * g
        k = keys.float().clone()
        if full:
            kb = k[:, :full].reshape(L, full // g, g, H, D).permute(0, 1, 3, 4, 2)  # groups of tokens per channel
            k[:, :full] = _minmax(kb, self.bits).permute(0, 1, 4, 2, 3).reshape(L, full, H, D)
        v = values.float()
        vq = _minmax(v.reshape(L, T, H, D // g, g), self.bits).reshape(L, T, H, D) if D % g == 0 else v
        n = keys.numel()
        k_bytes = (L * full * H * D * self.bits) // 8 + (L * (full // g) * H * D) * 4 + (L * (T - full) * H * D) * 2
        v_bytes = (n * self.bits) // 8 + (n // g) * 4 if D % g == 0 else n * 2
        return k, vq, k_bytes + v_bytes
