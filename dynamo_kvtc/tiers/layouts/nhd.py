"""``nhd``: vLLM's ``LBNHC`` block interior, per layer ``[num_blocks, block_size, H, 2*D]`` (each token's and head's K
then V); a page is ``[block_size, H, 2*D]``. Named by vLLM's resolved KV cache layout, not told from a tensor's shape
(the kvtc tier's ``page_layout``)."""

from __future__ import annotations

import torch

from .base import KV, KVLayout
from .registry import register


@register
class NhdLayout(KVLayout):
    name = "nhd"
    vllm_layouts = ("LBNHC", "NHD")

    @classmethod
    def geometry(cls, cache: torch.Tensor) -> tuple[int, int, int, int]:
        if cache.dim() != 4 or cache.shape[-1] % 2:
            raise cls.wrong("[num_blocks, block_size, H, 2*D]", cache)
        nb, bs, H, d2 = cache.shape
        return nb, bs, H, d2 // 2

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.num_heads, 2 * self.head_dim)

    def unpage(self, pages: torch.Tensor) -> KV:
        x = pages.unflatten(-1, (2, self.head_dim))
        return x[..., 0, :], x[..., 1, :]
