"""``hnd``: vLLM's ``LBHNC`` block interior, per layer ``[num_blocks, H, block_size, 2*D]`` (each token's and head's K
then V); a page is ``[H, block_size, 2*D]``. Named by vLLM's resolved KV cache layout, not told from a tensor's shape
(the same shape as ``cpu``, whose halves are a block's, not a token's)."""

from __future__ import annotations

import torch

from .base import KV, KVLayout
from .registry import register


@register
class HndLayout(KVLayout):
    name = "hnd"
    vllm_layouts = ("LBHNC", "HND")

    @classmethod
    def geometry(cls, cache: torch.Tensor) -> tuple[int, int, int, int]:
        if cache.dim() != 4 or cache.shape[-1] % 2:
            raise cls.wrong("[num_blocks, H, block_size, 2*D]", cache)
        nb, H, bs, d2 = cache.shape
        return nb, bs, H, d2 // 2

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.block_size, 2 * self.head_dim)

    def unpage(self, pages: torch.Tensor) -> KV:
        x = pages.unflatten(-1, (2, self.head_dim)).transpose(-4, -3)  # [..., block_size, H, 2, D]
        return x[..., 0, :], x[..., 1, :]
