"""``flash``: vLLM FlashAttention, per layer ``[2, num_blocks, block_size, H, D]`` (all K blocks, then all V blocks).
A block's K and V lie apart: no page form (the kvtc tier does not read it)."""

from __future__ import annotations

import torch

from .base import KV, KVLayout
from .registry import register


def is_flashinfer_shape(t: torch.Tensor, num_blocks: int | None) -> bool:
    return t.dim() == 5 and t.shape[1] == 2 and (num_blocks is None or t.shape[0] == num_blocks)


@register
class FlashLayout(KVLayout):
    name = "flash"

    @classmethod
    def detect(cls, t: torch.Tensor, num_blocks: int | None, mla: bool) -> bool:
        # [2, 2, bs, H, D] (two blocks) is flashinfer's [num_blocks, 2, ...] only when the block count says so
        return not mla and t.dim() == 5 and t.shape[0] == 2 and not is_flashinfer_shape(t, num_blocks)

    @classmethod
    def geometry(cls, cache: torch.Tensor) -> tuple[int, int, int, int]:
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise cls.wrong("[2, num_blocks, block_size, H, D]", cache)
        _, nb, bs, H, D = cache.shape
        return nb, bs, H, D

    def layer_views(self, cache: torch.Tensor) -> KV:
        return cache[0], cache[1]
