"""What one KV layout is: :class:`KVLayout`, the small class every layout of :mod:`dynamo_kvtc.tiers.layouts` is.

A layout says how an engine's cache holds one layer's K and V, in two forms:

- the engine's **per-layer tensor** (what vLLM hands ``register_kv_caches``): :meth:`KVLayout.detect` recognises it,
  :meth:`KVLayout.geometry` reads its sizes, :meth:`KVLayout.layer_views` views it as K, V ``[num_blocks, block_size,
  H, D]`` (the fused GPU kernels address those views in place, :mod:`dynamo_kvtc.codec.gpu.layouts`);
  :meth:`KVLayout.gather_layer`/:meth:`KVLayout.scatter_layer` copy blocks out and back;
- one **page**: one block of one layer, as a block-major engine tensor holds it and as vLLM's OffloadingConnector
  copies it into a chunk (:attr:`KVLayout.page_shape`, :meth:`KVLayout.unpage`, :meth:`KVLayout.page`: the kvtc
  tier's chunk pack/unpack). A layout whose block's K and V lie apart (``flash``) has no page form.

A subclass sets :attr:`name`, :meth:`detect`, :meth:`geometry` and either :meth:`unpage` (+ :attr:`page_shape`) or
:meth:`layer_views`; the rest follows. It knows nothing of dtypes (an FP8 cache's scales are
:class:`~dynamo_kvtc.tiers.layout.PagedKV`'s) and never decides which blocks to touch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ...errors import ConfigError

KV = tuple[torch.Tensor, torch.Tensor]


class KVLayout:
    """One KV layout; an instance is its geometry: ``block_size`` tokens per block, ``num_heads`` x ``head_dim``."""

    name: ClassVar[str] = ""
    vllm_layouts: ClassVar[tuple[str, ...]] = ()  # vLLM KVCacheLayout names whose pages this is (the kvtc tier's auto)
    in_place: ClassVar[bool] = True  # layer_views are views of the cache (else gather/scatter copy through pages)

    def __init__(self, block_size: int, num_heads: int, head_dim: int, **options: Any) -> None:
        if options:
            raise ConfigError(f"layout {self.name} takes no options, got {sorted(options)}")
        self.block_size, self.num_heads, self.head_dim = block_size, num_heads, head_dim

    # ------------------------------------------------------------------ the engine's tensors
    @classmethod
    def detect(cls, t: torch.Tensor, num_blocks: int | None, mla: bool) -> bool:
        """Whether one layer's engine tensor ``t`` is in this layout (``mla``: the model is an MLA model). A layout
        that cannot be told from the tensor answers False and is chosen by name."""
        return False

    @classmethod
    def layers(cls, caches: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        """The engine's caches as one tensor per layer, every layer alike (a layout holding all layers in one
        tensor cuts it here)."""
        if isinstance(caches, torch.Tensor):
            raise ConfigError(f"layout {cls.name} takes one tensor per layer")
        caches = list(caches)
        if not caches:
            raise ConfigError("no KV cache tensors given")
        shapes = {tuple(c.shape) for c in caches}
        if len(shapes) != 1:
            raise ConfigError(f"layers have different KV shapes: {sorted(shapes)[:3]}")
        return caches

    @classmethod
    def geometry(cls, cache: torch.Tensor) -> tuple[int, int, int, int]:
        """(num_blocks, block_size, H, D) of one layer's tensor; ConfigError when it is not in this layout."""
        raise NotImplementedError

    @classmethod
    def wrong(cls, expected: str, cache: torch.Tensor) -> ConfigError:
        return ConfigError(f"{cls.name} layout needs {expected}, got {tuple(cache.shape)}")

    def layer_views(self, cache: torch.Tensor) -> KV:
        """K, V of one layer's tensor as ``[num_blocks, block_size, H, D]`` views (any strides, K and V alike)."""
        return self.unpage(cache)

    def gather_layer(self, cache: torch.Tensor, ids: torch.Tensor) -> KV:
        """K, V ``[n, block_size, H, D]`` of blocks ``ids`` (int64, on the cache's device), in order."""
        if not self.in_place:
            return self.unpage(cache.index_select(0, ids))
        k, v = self.layer_views(cache)
        return k.index_select(0, ids), v.index_select(0, ids)

    def scatter_layer(self, cache: torch.Tensor, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K, V ``[n, block_size, H, D]`` (the cache's dtype and device) into blocks ``ids``."""
        if not self.in_place:
            cache.index_copy_(0, ids, self.page(k, v))
            return
        dk, dv = self.layer_views(cache)
        dk.index_copy_(0, ids, k)
        dv.index_copy_(0, ids, v)

    # ------------------------------------------------------------------ pages (one block of one layer)
    @classmethod
    def has_pages(cls) -> bool:
        """Whether this layout has a page form (a kvtc tier ``page_layout``)."""
        return cls.unpage is not KVLayout.unpage

    @property
    def page_shape(self) -> tuple[int, ...] | None:
        """One block of one layer as stored (a chunk page of the kvtc tier); None: no page form."""
        return None

    def unpage(self, pages: torch.Tensor) -> KV:
        """K, V ``[..., block_size, H, D]`` of pages ``[..., *page_shape]`` (views where the layout allows)."""
        raise ConfigError(f"layout {self.name} has no page form: a block's K and V are not one contiguous page")

    def page(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Pages ``[..., *page_shape]`` holding K, V ``[..., block_size, H, D]``: the exact inverse of
        :meth:`unpage` (written through :meth:`unpage`'s views of a new tensor)."""
        if self.page_shape is None:
            self.unpage(k)  # raises: no page form
        out = torch.empty(*k.shape[:-3], *self.page_shape, dtype=k.dtype, device=k.device)
        dk, dv = self.unpage(out)
        dk.copy_(k)
        dv.copy_(v)
        return out
