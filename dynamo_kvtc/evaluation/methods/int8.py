"""int8 per token: each (layer, token, head) vector symmetric absmax int8 with one fp16 scale."""

from __future__ import annotations

import torch

from .base import Method


class Int8PerToken(Method):
    name = "int8-per-token"

    def compress(self, keys, values):
        def q(x):
            x = x.float()
            scale = (x.abs().amax(dim=-1, keepdim=True) / 127).to(torch.float16).float()
            inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
            return torch.round(x * inv).clamp(-127, 127) * scale

        vectors = keys.numel() // keys.shape[-1]
        return q(keys), q(values), keys.numel() + values.numel() + 2 * vectors * 2
