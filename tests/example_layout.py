"""A KV layout that exists only in the tests: what adding a layout takes (one class, one registration line).

``token_minor``: per layer ``[num_blocks, H, 2, D, block_size]``, each head's K then V with the token axis innermost
(no engine stores this; it is made up so that no view of another layout's helpers could pass for it). Never detected
from a tensor's shape, chosen by name; gather/scatter address it in place through strided views, and a page (one
block of one layer) is ``[H, 2, D, block_size]``.
"""

from __future__ import annotations

import torch

from dynamo_kvtc.tiers.layouts import KV, KVLayout, register


class TokenMinorLayout(KVLayout):
    name = "token_minor"

    @classmethod
    def geometry(cls, cache: torch.Tensor) -> tuple[int, int, int, int]:
        if cache.dim() != 5 or cache.shape[2] != 2:
            raise cls.wrong("[num_blocks, H, 2, D, block_size]", cache)
        nb, H, _, D, bs = cache.shape
        return nb, bs, H, D

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_heads, 2, self.head_dim, self.block_size)

    def unpage(self, pages: torch.Tensor) -> KV:
        k, v = pages[..., 0, :, :], pages[..., 1, :, :]  # [..., H, D, block_size]
        return k.permute(*range(k.dim() - 3), -1, -3, -2), v.permute(*range(v.dim() - 3), -1, -3, -2)


register(TokenMinorLayout)
