"""An engine's paged KV cache: gather a span of blocks into [L, T, H, D] and scatter decoded layers back.

:class:`PagedKV` is the engine's per-layer tensors in one layout of :mod:`dynamo_kvtc.tiers.layouts` (the registry:
``flash``, ``flashinfer``, ``cpu``, ``trtllm``, ``mla``, ``nhd``, ``hnd``, and any layout registered there), plus what
is not the layout's business: an FP8 cache's format and per-layer scales.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..codec import fp8
from ..errors import ConfigError
from .layouts import KVLayout, layout_class


class PagedKV:
    """An engine's paged KV cache in a registered layout: gathers blocks into dense [L, T, H, D] and scatters decoded
    layers back. It owns no memory (the engine's tensors) and never decides which blocks to touch. ``k_offsets`` /
    ``v_offsets``: the ``cpu`` layout's element order (:func:`~dynamo_kvtc.tiers.layouts.cpu.probe_cpu_offsets`)."""

    def __init__(
        self,
        caches: Sequence[torch.Tensor] | torch.Tensor,
        layout: str | type[KVLayout],
        block_size: int | None = None,
        *,
        k_offsets: torch.Tensor | None = None,
        v_offsets: torch.Tensor | None = None,
        cache_dtype: str = "auto",
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
    ):
        cls = layout_class(layout)
        self.layout = cls.name
        self.caches = cls.layers(caches)
        nb, bs, H, D = cls.geometry(self.caches[0])
        if block_size is not None and block_size != bs:
            raise ConfigError(f"engine block size {bs} differs from the configured {block_size}")
        options = {k: o for k, o in (("k_offsets", k_offsets), ("v_offsets", v_offsets)) if o is not None}
        self.form: KVLayout = cls(bs, H, D, **options)
        self.num_layers, self.num_blocks, self.block_size = len(self.caches), nb, bs
        self.num_heads, self.head_dim = H, D
        self.dtype = self.caches[0].dtype  # the stored element (float8 for an FP8 cache): what raw bytes count
        self.value_dtype = self.dtype  # what gather returns and scatter takes: what the codec encodes
        self.device = self.caches[0].device
        self._fp8 = _fp8_setup(self, cache_dtype, k_scales, v_scales)

    @property
    def addressable(self) -> bool:
        """Whether :meth:`layer_views` can address this cache in place (not ``cpu``, whose element order is no view;
        not an FP8 cache, whose values need their scales)."""
        return self.form.in_place and self._fp8 is None

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views K, V of one layer as [num_blocks, block_size, H, D] (may be non-contiguous; :attr:`addressable`)."""
        return self.form.layer_views(self.caches[layer])

    def check_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ConfigError(f"block ids outside [0, {self.num_blocks})")
        return ids

    def gather(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [L, n*block_size, H, D] of these blocks, in order."""
        ids = self.check_blocks(block_ids).to(self.device)
        H, D = self.num_heads, self.head_dim
        ks, vs = [], []
        for layer in range(self.num_layers):
            k, v = self.form.gather_layer(self.caches[layer], ids)
            if self._fp8 is not None:
                k, v = _fp8_values(self, layer, k, v)
            ks.append(k.reshape(-1, H, D))
            vs.append(v.reshape(-1, H, D))
        return torch.stack(ks), torch.stack(vs)

    def scatter_layer(self, layer: int, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K, V [n*block_size, H, D] of one layer into these blocks."""
        ids = self.check_blocks(block_ids).to(self.device)
        n, bs, H, D = len(ids), self.block_size, self.num_heads, self.head_dim
        if self._fp8 is not None:
            k, v = _fp8_stored(self, layer, k.to(self.device), v.to(self.device))
        k = k.to(self.device, self.caches[0].dtype).reshape(n, bs, H, D)
        v = v.to(self.device, self.caches[0].dtype).reshape(n, bs, H, D)
        self.form.scatter_layer(self.caches[layer], ids, k, v)


def _fp8_setup(kv: PagedKV, cache_dtype: str, k_scales, v_scales):
    """An FP8 cache (vLLM ``--kv-cache-dtype fp8*``; tensors uint8 or float8): its format and per-layer scales, and
    ``kv.dtype``/``kv.value_dtype`` set to the float8 element and bfloat16. None for any other cache."""
    fmt = fp8.kv_format(cache_dtype)
    stored = kv.caches[0].dtype
    if fmt is None:
        if stored in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
            raise ConfigError(f"KV cache of {stored} needs an fp8 cache dtype, got {cache_dtype!r}")
        return None
    if stored not in (torch.uint8, fmt):
        raise ConfigError(f"cache dtype {cache_dtype} needs uint8 or {fmt} tensors, got {stored}")
    scales = []
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        s = [1.0] * kv.num_layers if s is None else [float(x) for x in s]
        if len(s) != kv.num_layers or not all(x > 0 and x < float("inf") for x in s):
            raise ConfigError(f"{name} needs one finite positive scale per layer ({kv.num_layers}), got {s[:4]}")
        scales.append(s)
    kv.dtype, kv.value_dtype = fmt, torch.bfloat16
    kv.caches = [c.view(torch.uint8) for c in kv.caches]  # the same memory; CPU index_copy_ has no float8 kernel
    return fmt, scales[0], scales[1]


def _fp8_values(kv: PagedKV, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fmt, ks, vs = kv._fp8
    return fp8.dequantize(k, fmt, ks[layer], kv.value_dtype), fp8.dequantize(v, fmt, vs[layer], kv.value_dtype)


def _fp8_stored(kv: PagedKV, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fmt, ks, vs = kv._fp8
    return fp8.quantize(k, fmt, ks[layer], torch.uint8), fp8.quantize(v, fmt, vs[layer], torch.uint8)
