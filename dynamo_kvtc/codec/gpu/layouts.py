"""Where the fused codec reads and writes K/V: a dense tensor or an engine's paged blocks, and the spans to encode.

Both layouts expose the same addressing: ``layer(l) -> (k, v)`` views and ``token_offsets(seq, start, n)``, one int64
element offset per token from the view's first element, plus the head and dim strides; the stages gather and scatter
through these offsets, so paged blocks and dense tensors look the same to them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...errors import InputError
from .ops import device_tensor, flat_view


class DenseKV:
    """Keys/values ``[L, T_total, H, D]`` (one tensor each); sequence ``i`` starts at token ``seq_starts[i]``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, seq_starts: Sequence[int] = (0,)) -> None:
        if keys.shape != values.shape or keys.stride() != values.stride() or keys.dtype != values.dtype:
            raise InputError("keys and values must share shape, strides and dtype")
        self.keys, self.values = keys, values
        self.num_layers, _, self.heads, self.head_dim = keys.shape
        self.dtype, self.device = keys.dtype, keys.device
        self.stride_h, self.stride_d = keys.stride(2), keys.stride(3)
        self.seq_starts = list(seq_starts)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]

    def token_offsets(self, seq: int, start: int, n: int) -> torch.Tensor:
        t0 = self.seq_starts[seq] + start
        return torch.arange(t0, t0 + n, dtype=torch.int64, device=self.device) * self.keys.stride(1)


class PagedBlocks:
    """Engine blocks: ``layer_views(l) -> (k, v)`` each ``[num_blocks, block_size, H, D]`` (any strides, K and V
    alike); sequence ``i`` is ``block_ids[i]`` in order (token t in block ``t // block_size``)."""

    def __init__(
        self,
        layer_views: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        num_layers: int,
        block_ids: Sequence[Sequence[int]],
    ) -> None:
        k, v = layer_views(0)
        if k.stride() != v.stride() or k.shape != v.shape:
            raise InputError("paged K and V views must share shape and strides")
        self._views = layer_views
        self.num_layers = num_layers
        _, self.block_size, self.heads, self.head_dim = k.shape
        self.dtype, self.device = k.dtype, k.device
        self.stride_block, self.stride_tok, self.stride_h, self.stride_d = k.stride()
        self.block_ids = [torch.as_tensor(list(b), dtype=torch.int64) for b in block_ids]
        # every sequence's block ids on the device, from one pinned buffer (one asynchronous copy, no blocking)
        flat = [int(x) for b in self.block_ids for x in b.tolist()]
        dev_ids = device_tensor(flat, torch.int64, self.device)
        self._dev_ids, a = [], 0
        for b in self.block_ids:
            self._dev_ids.append(dev_ids[a : a + b.numel()])
            a += b.numel()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._views(layer)

    def token_offsets(self, seq: int, start: int, n: int) -> torch.Tensor:
        """Element offsets of tokens ``start..start+n-1`` of sequence ``seq``, computed on the device (no host
        synchronisation); InputError if they run past the sequence's blocks."""
        nblk = self.block_ids[seq].numel()
        if start < 0 or start + n > nblk * self.block_size:
            raise InputError(f"tokens {start}..{start + n} run past sequence {seq}'s {nblk} blocks")
        t = torch.arange(start, start + n, dtype=torch.int64, device=self.device)
        blocks = self._dev_ids[seq][t // self.block_size]
        return blocks * self.stride_block + (t % self.block_size) * self.stride_tok


@dataclass
class Span:
    """One blob to encode: tokens ``[start, start + len(positions))`` of sequence ``seq`` of the source."""

    seq: int
    start: int
    positions: torch.Tensor
    window: int | None = None


def gather_tokens(source, l0: int, l1: int, toff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[l1-l0, n, H, D]`` of the tokens at element offsets ``toff`` (same for every layer)."""
    H, D = source.heads, source.head_dim
    idx = (torch.arange(H, device=toff.device) * source.stride_h)[:, None] + (
        torch.arange(D, device=toff.device) * source.stride_d
    )[None, :]
    idx = toff[:, None, None] + idx[None]
    ks, vs = [], []
    for layer in range(l0, l1):
        k, v = source.layer(layer)
        ks.append(flat_view(k)[idx])
        vs.append(flat_view(v)[idx])
    return torch.stack(ks), torch.stack(vs)
