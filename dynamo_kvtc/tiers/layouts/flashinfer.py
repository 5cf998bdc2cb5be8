"""``flashinfer``: vLLM FlashInfer, per layer ``[num_blocks, 2, block_size, H, D]``; a page (one block of one layer)
is ``[2, block_size, H, D]``."""

from __future__ import annotations

import torch

from .base import KV, KVLayout
from .flash import is_flashinfer_shape
from .registry import register


@register
class FlashInferLayout(KVLayout):
    name = "flashinfer"

    @classmethod
    def detect(cls, t: torch.Tensor, num_blocks: int | None, mla: bool) -> bool:
        return not mla and is_flashinfer_shape(t, num_blocks)

    @classmethod
    def geometry(cls, cache: torch.Tensor) -> tuple[int, int, int, int]:
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise cls.wrong("[num_blocks, 2, block_size, H, D]", cache)
        nb, _, bs, H, D = cache.shape
        return nb, bs, H, D

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (2, self.block_size, self.num_heads, self.head_dim)

    def unpage(self, pages: torch.Tensor) -> KV:
        return pages[..., 0, :, :, :], pages[..., 1, :, :, :]
