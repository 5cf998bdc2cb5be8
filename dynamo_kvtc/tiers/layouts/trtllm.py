"""``trtllm``: TensorRT-LLM, one tensor for all layers ``[num_blocks, L, 2, H, block_size, D]``; a page (one block
of one layer) is ``[2, H, block_size, D]``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import ConfigError
from .base import KV, KVLayout
from .registry import register


@register
class TrtllmLayout(KVLayout):
    name = "trtllm"

    @classmethod
    def layers(cls, caches: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        if not isinstance(caches, torch.Tensor) or caches.dim() != 6 or caches.shape[2] != 2:
            raise ConfigError("trtllm layout needs one tensor [num_blocks, L, 2, H, block_size, D]")
        return [caches[:, layer] for layer in range(caches.shape[1])]  # views: [num_blocks, 2, H, block_size, D]

    @classmethod
    def geometry(cls, cache: torch.Tensor) -> tuple[int, int, int, int]:
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise cls.wrong("[num_blocks, 2, H, block_size, D] per layer", cache)
        nb, _, H, bs, D = cache.shape
        return nb, bs, H, D

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (2, self.num_heads, self.block_size, self.head_dim)

    def unpage(self, pages: torch.Tensor) -> KV:
        return pages[..., 0, :, :, :].transpose(-3, -2), pages[..., 1, :, :, :].transpose(-3, -2)
