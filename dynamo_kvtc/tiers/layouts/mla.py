"""``mla``: vLLM MLA (DeepSeek-V2/V3, Kimi-K2), per layer ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (the
CPU backend adds a head axis of 1: ``[num_blocks, 1, block_size, C + R]``), one latent "head" per token and no
separate V. :func:`mla_views` cuts each row in two halves of ``(C + R) / 2``: V the first half (latent only), K the
second (the latent's tail, then the RoPE part, whose RoPE the codec removes at ``rotary_offset = D - R``). Both are
strided views of the cache, ``H = 1``; a page is one block's rows ``[block_size, C + R]``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import ConfigError
from .base import KV, KVLayout
from .registry import register


def mla_views(cache: torch.Tensor) -> KV:
    """K, V views ``[..., block_size, 1, (C + R) / 2]`` of MLA rows ``[..., block_size, C + R]``: V the first half of
    each token's latent, K the rest (the latent's tail and the RoPE part). Same shape and strides, so the fused
    kernels address them as any K/V pair."""
    half = cache.shape[-1] // 2
    return cache[..., None, half:], cache[..., None, :half]


@register
class MlaLayout(KVLayout):
    name = "mla"

    @classmethod
    def detect(cls, t: torch.Tensor, num_blocks: int | None, mla: bool) -> bool:
        return mla and (t.dim() == 3 or t.dim() == 4 and t.shape[1] == 1)

    @classmethod
    def layers(cls, caches: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        caches = [c[:, 0] if c.dim() == 4 and c.shape[1] == 1 else c for c in caches]
        caches = super().layers(caches)
        if caches[0].dim() != 3 or caches[0].shape[-1] % 2:
            raise ConfigError(
                f"mla layout needs [num_blocks, block_size, latent + rope] with an even last dim, got "
                f"{tuple(caches[0].shape)}"
            )
        return caches

    @classmethod
    def geometry(cls, cache: torch.Tensor) -> tuple[int, int, int, int]:
        nb, bs, W = cache.shape
        return nb, bs, 1, W // 2

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.block_size, 2 * self.head_dim)

    def unpage(self, pages: torch.Tensor) -> KV:
        return mla_views(pages)
