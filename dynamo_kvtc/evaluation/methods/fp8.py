"""FP8 E4M3 cache: a direct cast (values clamped to +-448), 2x by construction."""

from __future__ import annotations

import torch

from ...codec.quant import FP8_MAX
from .base import Method


class Fp8(Method):
    name = "fp8-e4m3"

    def compress(self, keys, values):
        def q(x):
            return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()

        return q(keys), q(values), keys.numel() + values.numel()
