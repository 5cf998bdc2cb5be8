"""Attention-sink tokens in fp8: the ``<group>.sinks`` section of a blob (both writers and both readers use this).

Layout of one section (layer group of ``Lg`` layers, ``ns`` sink tokens, ``H`` heads, head_dim ``D``): K's E4M3 codes
``[Lg, ns, H, D]``, K's fp16 scales ``[Lg, ns, H]`` (one per vector: ``max|x| / 448``), then the same for V; size
``2 * Lg * ns * H * (D + 2)`` bytes.
"""

from __future__ import annotations

import torch

from .quant import FP8_MAX


def sink_bytes(layers: int, tokens: int, heads: int, head_dim: int) -> int:
    """Size of a sinks section."""
    return 2 * layers * tokens * heads * (head_dim + 2)


def encode_sinks(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp8 E4M3 codes [Lg, ns, H, D] + fp16 scales [Lg, ns, H] for K, then the same for V; flat uint8 on k's device."""
    parts = []
    for x in (k, v):
        xf = x.float()
        scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(max=65504.0).to(torch.float16)
        sf = scale.float()
        inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
        codes = (xf * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        parts += [codes.reshape(-1), scale.contiguous().view(torch.uint8).reshape(-1)]
    return torch.cat(parts)


def decode_sinks(buf: torch.Tensor, Lg: int, ns: int, H: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_sinks`: K and V as float32 ``[Lg, ns, H, D]`` on ``buf``'s device."""
    n_codes, n_scale = Lg * ns * H * D, Lg * ns * H * 2
    out, off = [], 0
    for _ in range(2):
        codes = buf[off : off + n_codes].view(torch.float8_e4m3fn).float().view(Lg, ns, H, D)
        off += n_codes
        scale = buf[off : off + n_scale].contiguous().view(torch.float16).float().view(Lg, ns, H, 1)
        off += n_scale
        out.append(codes * scale)
    return out[0], out[1]
