"""How a primary-tier chunk of vLLM's OffloadingConnector holds K and V, for the ``kvtc`` tier (:mod:`.offload_tier`).

:class:`ChunkLayout` unpacks a chunk's bytes into per-layer keys and values and packs them back; the helpers resolve
the engine's page layout, the layer index of a KV cache layer's name, the KV dtype and the CPU kernel's element order.
"""

from __future__ import annotations

import logging
import re

import torch

from ...errors import ConfigError

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
    ``blocks_per_chunk`` consecutive pages of one engine block each. A page is:

    - ``nhd``: ``[block_size, H, 2, D]`` (vLLM 0.31's logical ``[B, H, N, C]`` in the LBNHC layout, C = K then V);
    - ``hnd``: ``[H, block_size, 2, D]`` (LBHNC);
    - ``cpu``: vLLM's CPU attention block ``[H, 2, block_size * D]``, each half in the kernel's own element order
      (``k_offsets``/``v_offsets``, probed through the kernel as :func:`..tiers.layout.probe_cpu_offsets` does).

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
        self.slots = layers  # slot i of the chunk holds model layer layers[i]
        self.order = torch.tensor(sorted(range(len(layers)), key=lambda i: layers[i]))  # layer -> slot
        self.L, self.bs, self.bpc, self.H, self.D = len(layers), block_size, blocks_per_chunk, num_heads, head_dim
        self.dtype, self.kind = dtype, kind
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.page_bytes = block_size * num_heads * 2 * head_dim * self.elem
        self.bytes = self.L * self.bpc * self.page_bytes
        self.tokens = block_size * blocks_per_chunk
        self.k_offsets, self.v_offsets = k_offsets, v_offsets
        if kind == "cpu" and k_offsets is not None:
            self.k_inv = torch.argsort(k_offsets)
            self.v_inv = torch.argsort(v_offsets)

    def unpack(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``raw``: this worker's ``self.bytes`` bytes of one chunk (uint8/int8, any device)."""
        x = raw[: self.bytes].view(self.dtype)
        L, P, bs, H, D = self.L, self.bpc, self.bs, self.H, self.D
        if self.kind == "nhd":
            x = x.view(L, P, bs, H, 2, D)
            k, v = x[..., 0, :], x[..., 1, :]
        elif self.kind == "hnd":
            x = x.view(L, P, H, bs, 2, D).permute(0, 1, 3, 2, 4, 5)
            k, v = x[..., 0, :], x[..., 1, :]
        else:
            x = x.view(L, P, H, 2, bs * D)
            k, v = x[:, :, :, 0], x[:, :, :, 1]
            if self.k_offsets is not None:  # element at logical t*D+d lives at offsets[t*D+d]
                k = k[..., self.k_offsets.to(k.device)]
                v = v[..., self.v_offsets.to(v.device)]
            k = k.reshape(L, P, H, bs, D).transpose(2, 3)
            v = v.reshape(L, P, H, bs, D).transpose(2, 3)
        order = self.order.to(x.device)
        k = k.reshape(L, P * bs, H, D)[order].contiguous()
        v = v.reshape(L, P * bs, H, D)[order].contiguous()
        return k, v

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``(keys, values)`` ``[L, T, H, D]`` in model layer order -> the chunk's bytes (uint8, on their device)."""
        L, P, bs, H, D = self.L, self.bpc, self.bs, self.H, self.D
        slots = torch.tensor(self.slots, device=k.device)
        k = k.to(self.dtype)[slots].reshape(L, P, bs, H, D)
        v = v.to(self.dtype)[slots].reshape(L, P, bs, H, D)
        if self.kind == "nhd":
            x = torch.stack((k, v), dim=4)  # L P bs H 2 D
        elif self.kind == "hnd":
            x = torch.stack((k, v), dim=4).permute(0, 1, 3, 2, 4, 5)  # L P H bs 2 D
        else:
            k = k.transpose(2, 3).reshape(L, P, H, bs * D)
            v = v.transpose(2, 3).reshape(L, P, H, bs * D)
            if self.k_offsets is not None:
                k = k[..., self.k_inv.to(k.device)]
                v = v[..., self.v_inv.to(v.device)]
            x = torch.stack((k, v), dim=3)  # L P H 2 bs*D
        return x.contiguous().view(-1).view(torch.uint8)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (``bfloat16`` or ``torch.bfloat16``)."""
    name = str(name).removeprefix("torch.")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ConfigError(f"KV cache dtype {name!r} is not a torch dtype")
    return dt


def resolve_page_layout(requested: str, kv_cache_layout: str | None) -> str:
    """``auto``: vLLM's CPU attention layout on a CPU platform, else from the engine's resolved KV cache layout."""
    if requested != "auto":
        return requested
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return "cpu"
    except ImportError:  # pragma: no cover - vLLM is imported above
        pass
    name = (kv_cache_layout or "LBNHC").upper()
    if name in ("LBNHC", "NHD"):
        return "nhd"
    if name in ("LBHNC", "HND"):
        return "hnd"
    raise ConfigError(
        f"KV cache layout {kv_cache_layout!r} keeps several layers in one block; the kvtc tier reads per-layer "
        "layouts (LBNHC, LBHNC) only: set secondary_tiers[type=kvtc].page_layout explicitly if you know it"
    )


def cpu_offsets(num_heads: int, block_size: int, head_dim: int, dtype: torch.dtype):
    """Element order of vLLM's CPU attention kernel inside a block (None: plain ``[block_size, D]`` halves)."""
    from ...tiers.layout import probe_cpu_offsets

    try:  # None only when vLLM's kernel is not importable (then the plain layout is what is there)
        return probe_cpu_offsets(torch.empty(1, num_heads, block_size, 2 * head_dim, dtype=dtype), block_size)
    except Exception as e:  # read as the plain layout, keys would come out scrambled: refuse instead
        raise ConfigError(f"kvtc tier: cannot learn the element order of vLLM's CPU KV cache ({e})") from e
