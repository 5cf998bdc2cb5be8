"""How a primary-tier chunk of vLLM's OffloadingConnector holds K and V, for the ``kvtc`` tier (:mod:`.tier`).

A chunk is pages of one registered KV layout (:mod:`dynamo_kvtc.tiers.layouts`: ``nhd``, ``hnd``, ``cpu``, ...; the
layout packs and unpacks one page); :class:`ChunkLayout` is their arrangement, layer-major, in the KV group's layer
order. The helpers resolve the engine's page layout, the layer index of a KV cache layer's name, the KV dtype and the
CPU kernel's element order.
"""

from __future__ import annotations

import logging
import math
import re

import torch

from ...errors import ConfigError
from ...tiers.layouts import layout_class, page_layout_of
from ...tiers.layouts.cpu import probe_cpu_offsets

log = logging.getLogger(__name__)

__all__ = ["ChunkLayout", "cpu_offsets", "layer_index", "resolve_page_layout", "torch_dtype"]


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    m = _LAYER_INDEX.search(name) or re.search(r"\.(\d+)\.", name)
    if not m:
        raise ConfigError(f"cannot tell the layer index of KV cache layer {name!r}")
    return int(m.group(1))


class ChunkLayout:
    """How one worker's part of a primary-tier chunk holds K and V: per layer (in the KV group's layer order),
    ``blocks_per_chunk`` consecutive pages of one engine block each, every page in layout ``kind`` (a registered
    layout with pages; ``k_offsets``/``v_offsets``: the ``cpu`` layout's element order, probed by :func:`cpu_offsets`).

    :meth:`unpack` turns a chunk's bytes into ``(keys, values)`` ``[L, T, H, D]`` in model layer order,
    :meth:`pack` is its exact inverse."""

    def __init__(
        self,
        *,
        layers: list[int],
        block_size: int,
        blocks_per_chunk: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kind: str,
        k_offsets: torch.Tensor | None = None,
        v_offsets: torch.Tensor | None = None,
    ) -> None:
        if sorted(layers) != list(range(len(layers))):
            raise ConfigError(f"KV cache layers are not one of each of 0..{len(layers) - 1}: {layers}")
        cls = layout_class(kind)
        if not cls.has_pages():
            raise ConfigError(f"KV layout {kind!r} has no page form: a chunk cannot hold it")
        options = {k: o for k, o in (("k_offsets", k_offsets), ("v_offsets", v_offsets)) if o is not None}
        self.form = cls(block_size, num_heads, head_dim, **options)
        self.slots = layers  # slot i of the chunk holds model layer layers[i]
        self.order = torch.tensor(sorted(range(len(layers)), key=lambda i: layers[i]))  # layer -> slot
        self.L, self.bs, self.bpc, self.H, self.D = len(layers), block_size, blocks_per_chunk, num_heads, head_dim
        self.dtype, self.kind = dtype, kind
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.page_bytes = math.prod(self.form.page_shape) * self.elem
        self.bytes = self.L * self.bpc * self.page_bytes
        self.tokens = block_size * blocks_per_chunk

    def unpack(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``raw``: this worker's ``self.bytes`` bytes of one chunk (uint8/int8, any device)."""
        x = raw[: self.bytes].view(self.dtype).view(self.L, self.bpc, *self.form.page_shape)
        k, v = self.form.unpage(x)  # [L, P, bs, H, D]
        order = self.order.to(x.device)
        k = k.reshape(self.L, self.tokens, self.H, self.D)[order].contiguous()
        v = v.reshape(self.L, self.tokens, self.H, self.D)[order].contiguous()
        return k, v

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``(keys, values)`` ``[L, T, H, D]`` in model layer order -> the chunk's bytes (uint8, on their device)."""
        shape = (self.L, self.bpc, self.bs, self.H, self.D)
        slots = torch.tensor(self.slots, device=k.device)
        x = self.form.page(k.to(self.dtype)[slots].reshape(shape), v.to(self.dtype)[slots].reshape(shape))
        return x.contiguous().view(-1).view(torch.uint8)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (``bfloat16`` or ``torch.bfloat16``)."""
    name = str(name).removeprefix("torch.")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ConfigError(f"KV cache dtype {name!r} is not a torch dtype")
    return dt


def resolve_page_layout(requested: str, kv_cache_layout: str | None) -> str:
    """``auto``: vLLM's CPU attention layout (``cpu``) on a CPU platform, else the registered layout whose pages are
    the engine's resolved KV cache layout (``LBNHC`` -> ``nhd``, ``LBHNC`` -> ``hnd``)."""
    if requested != "auto":
        return requested
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return "cpu"
    except ImportError:  # pragma: no cover - vLLM is imported above
        pass
    try:
        return page_layout_of(kv_cache_layout or "LBNHC")
    except ConfigError:
        raise ConfigError(
            f"KV cache layout {kv_cache_layout!r} keeps several layers in one block; the kvtc tier reads per-layer "
            "layouts (LBNHC, LBHNC) only: set secondary_tiers[type=kvtc].page_layout explicitly if you know it"
        ) from None


def cpu_offsets(num_heads: int, block_size: int, head_dim: int, dtype: torch.dtype):
    """Element order of vLLM's CPU attention kernel inside a block (None: plain ``[block_size, D]`` halves)."""
    try:  # None only when vLLM's kernel is not importable (then the plain layout is what is there)
        return probe_cpu_offsets(torch.empty(1, num_heads, block_size, 2 * head_dim, dtype=dtype), block_size)
    except Exception as e:  # read as the plain layout, keys would come out scrambled: refuse instead
        raise ConfigError(f"kvtc tier: cannot learn the element order of vLLM's CPU KV cache ({e})") from e
