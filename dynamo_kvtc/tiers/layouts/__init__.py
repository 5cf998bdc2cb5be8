"""KV layouts: how an engine's paged cache holds K and V, one small class per layout, one registry.

:mod:`.base` defines a layout (:class:`KVLayout`: detect the engine's tensor, view/gather/scatter its blocks as
``[block, token, H, D]``, pack/unpack one block as a page of vLLM's offloading chunks); :mod:`.registry` holds them by
name (:func:`register`, :func:`layout_class`, :func:`detect_layout`, :func:`page_layout_of`). Every connector, the
paged views (:class:`~dynamo_kvtc.tiers.layout.PagedKV`) and the kvtc tier's chunks use these names.

Built-in layouts, one file each (importing a file registers it; to add a layout: one file with ``@register``, one name
in the import line below):

- ``flash``      vLLM FlashAttention ``[2, num_blocks, block_size, H, D]``
- ``flashinfer`` vLLM FlashInfer ``[num_blocks, 2, block_size, H, D]``
- ``cpu``        vLLM CPU backend ``[num_blocks, H, block_size, 2*D]`` in the kernel's probed element order
- ``trtllm``     TensorRT-LLM, all layers in ``[num_blocks, L, 2, H, block_size, D]``
- ``mla``        vLLM MLA latents ``[num_blocks, block_size, C + R]`` as a K and a V half
- ``nhd``/``hnd`` vLLM's ``LBNHC``/``LBHNC`` blocks ``[block_size, H, 2*D]``/``[H, block_size, 2*D]``
"""

from __future__ import annotations

from . import cpu, flash, flashinfer, hnd, mla, nhd, trtllm  # noqa: F401 - importing a layout registers it
from .base import KV, KVLayout
from .registry import LAYOUTS, detect_layout, layout_class, page_layout_of, page_layouts, register

__all__ = ["KV", "LAYOUTS", "KVLayout", "detect_layout", "layout_class", "page_layout_of", "page_layouts", "register"]
