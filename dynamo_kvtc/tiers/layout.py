"""Engines' paged KV caches: gather a span of blocks into [L, T, H, D] and scatter decoded layers back.

Layouts (per layer unless noted):

- ``flash``      vLLM FlashAttention: ``[2, num_blocks, block_size, H, D]``
- ``flashinfer`` vLLM FlashInfer: ``[num_blocks, 2, block_size, H, D]``
- ``cpu``        vLLM CPU backend: ``[num_blocks, H, block_size, 2*D]``; each ``[block, head]`` slab holds a K half
                 then a V half of ``block_size*D`` elements each, whose element order is the attention kernel's own
                 (ISA-dependent: the AVX2 "vec" kernel stores K transposed, ``[D, block_size]``, and V as
                 ``[block_size, D]``). ``k_offsets``/``v_offsets`` give, for logical element ``t*D + d``, its offset
                 inside the half; :func:`probe_cpu_offsets` learns them by writing a probe through the engine's own
                 kernel.
                 Without them both halves are ``[block_size, D]``.
- ``trtllm``     TensorRT-LLM: one tensor for all layers, ``[num_blocks, L, 2, H, block_size, D]``
- ``mla``        vLLM MLA (DeepSeek-V2/V3, Kimi-K2): ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, one latent
                 "head" per token and no separate V. :func:`mla_views` cuts it in two halves of ``(C + R) / 2``:
                 V is the first half (latent only), K the second (the latent's tail, then the RoPE part, whose RoPE
                 the codec removes at ``rotary_offset = D - R``). Both are strided views of the cache, ``H = 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..codec import fp8
from ..errors import ConfigError

LAYOUTS = ("flash", "flashinfer", "cpu", "trtllm", "mla")


class PagedKV:
    """An engine's paged KV cache in one of :data:`LAYOUTS`: gathers blocks into dense [L, T, H, D] and scatters
    decoded layers back. It owns no memory (the engine's tensors) and never decides which blocks to touch."""

    def __init__(
        self,
        caches: Sequence[torch.Tensor] | torch.Tensor,
        layout: str,
        block_size: int | None = None,
        *,
        k_offsets: torch.Tensor | None = None,
        v_offsets: torch.Tensor | None = None,
        cache_dtype: str = "auto",
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
    ):
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown KV layout {layout!r}; supported: {LAYOUTS}")
        self.layout = layout
        if layout == "mla":
            self.caches = mla_caches(caches)
            nb, bs, D = self.caches[0].shape
            D //= 2
            L, H = len(self.caches), 1
        elif layout == "trtllm":
            if not isinstance(caches, torch.Tensor) or caches.dim() != 6 or caches.shape[2] != 2:
                raise ConfigError("trtllm layout needs one tensor [num_blocks, L, 2, H, block_size, D]")
            nb, L, _, H, bs, D = caches.shape
            self.caches = [caches]
        else:
            caches = list(caches)
            if not caches:
                raise ConfigError("no KV cache tensors given")
            shapes = {tuple(c.shape) for c in caches}
            if len(shapes) != 1:
                raise ConfigError(f"layers have different KV shapes: {sorted(shapes)[:3]}")
            shape = caches[0].shape
            if caches[0].dim() != 5 and layout != "cpu" or layout == "cpu" and caches[0].dim() != 4:
                raise ConfigError(f"layout {layout} expects {'4' if layout == 'cpu' else '5'}-D tensors, got {shape}")
            if layout == "flash":
                if shape[0] != 2:
                    raise ConfigError(f"flash layout needs [2, num_blocks, block_size, H, D], got {tuple(shape)}")
                _, nb, bs, H, D = shape
            elif layout == "flashinfer":
                if shape[1] != 2:
                    raise ConfigError(f"flashinfer layout needs [num_blocks, 2, block_size, H, D], got {tuple(shape)}")
                nb, _, bs, H, D = shape
            else:
                nb, H, bs, d2 = shape
                if d2 % 2:
                    raise ConfigError(f"cpu layout needs an even last dim (2*head_dim), got {tuple(shape)}")
                D = d2 // 2
            L = len(caches)
            self.caches = caches
        if block_size is not None and block_size != bs:
            raise ConfigError(f"engine block size {bs} differs from the configured {block_size}")
        self.num_layers, self.num_blocks, self.block_size, self.num_heads, self.head_dim = L, nb, bs, H, D
        self.dtype = self.caches[0].dtype  # the stored element (float8 for an FP8 cache): what raw bytes count
        self.value_dtype = self.dtype  # what gather returns and scatter takes: what the codec encodes
        self.device = self.caches[0].device
        self._fp8 = _fp8_setup(self, cache_dtype, k_scales, v_scales)
        self._offsets = None
        if layout == "cpu":
            half = bs * D
            offs = []
            for name, o in (("k_offsets", k_offsets), ("v_offsets", v_offsets)):
                o = torch.arange(half) if o is None else torch.as_tensor(o, dtype=torch.int64).flatten()
                if o.numel() != half or not torch.equal(torch.sort(o).values, torch.arange(half)):
                    raise ConfigError(f"{name} must be a permutation of range({half})")
                offs.append(o.to(self.device))
            self._offsets = (offs[0], offs[1] + half)

    @property
    def addressable(self) -> bool:
        """Whether :meth:`layer_views` can address this cache in place (every layout but ``cpu``; not an FP8 cache,
        whose values need their scales)."""
        return self.layout != "cpu" and self._fp8 is None

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views K, V of one layer as [num_blocks, block_size, H, D] (may be non-contiguous; not for ``cpu``)."""
        c = self.caches[0] if self.layout == "trtllm" else self.caches[layer]
        if self.layout == "mla":
            return mla_views(c)
        if self.layout == "flash":
            return c[0], c[1]
        if self.layout == "flashinfer":
            return c[:, 0], c[:, 1]
        return c[:, layer, 0].transpose(1, 2), c[:, layer, 1].transpose(1, 2)

    def _slabs(self, layer: int) -> torch.Tensor:
        nb, H, bs, _ = self.caches[layer].shape
        return self.caches[layer].view(nb, H, 2 * bs * self.head_dim)

    def check_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ConfigError(f"block ids outside [0, {self.num_blocks})")
        return ids

    def gather(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [L, n*block_size, H, D] of these blocks, in order."""
        ids = self.check_blocks(block_ids).to(self.device)
        n, bs, H, D = len(ids), self.block_size, self.num_heads, self.head_dim
        ks, vs = [], []
        for layer in range(self.num_layers):
            if self._offsets is not None:
                rows = self._slabs(layer).index_select(0, ids)  # [n, H, 2*bs*D]
                k = rows[..., self._offsets[0]].view(n, H, bs, D).transpose(1, 2)
                v = rows[..., self._offsets[1]].view(n, H, bs, D).transpose(1, 2)
            else:
                k, v = self.layer_views(layer)
                k, v = k.index_select(0, ids), v.index_select(0, ids)
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
        if self._offsets is not None:
            slabs = self._slabs(layer)
            rows = slabs.index_select(0, ids)
            rows[..., self._offsets[0]] = k.transpose(1, 2).reshape(n, H, bs * D)
            rows[..., self._offsets[1]] = v.transpose(1, 2).reshape(n, H, bs * D)
            slabs.index_copy_(0, ids, rows)
            return
        dk, dv = self.layer_views(layer)
        dk.index_copy_(0, ids, k)
        dv.index_copy_(0, ids, v)


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


def mla_caches(caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """MLA caches as ``[num_blocks, block_size, C + R]`` views (vLLM's CPU backend adds a head axis of 1:
    ``[num_blocks, 1, block_size, C + R]``), every layer alike, ``C + R`` even."""
    caches = [c[:, 0] if c.dim() == 4 and c.shape[1] == 1 else c for c in caches]
    if not caches:
        raise ConfigError("no KV cache tensors given")
    shapes = {tuple(c.shape) for c in caches}
    if len(shapes) != 1:
        raise ConfigError(f"layers have different KV shapes: {sorted(shapes)[:3]}")
    if caches[0].dim() != 3 or caches[0].shape[-1] % 2:
        raise ConfigError(
            f"mla layout needs [num_blocks, block_size, latent + rope] with an even last dim, got "
            f"{tuple(caches[0].shape)}"
        )
    return caches


def mla_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V views ``[num_blocks, block_size, 1, (C + R) / 2]`` of one MLA layer: V the first half of each token's
    latent, K the rest (the latent's tail and the RoPE part). Same shape and strides, so the fused kernels address
    them as any K/V pair."""
    half = cache.shape[-1] // 2
    return cache[:, :, None, half:], cache[:, :, None, :half]


PROBE_BASE = 16  # digit size of the probe: 1..16 are exact in every cache dtype the kernel writes (bf16, fp16, e4m3)


def probe_cpu_offsets(kv_cache: torch.Tensor, block_size: int, cache_dtype: str = "auto"):
    """Learn where vLLM's CPU attention kernel puts each (token, dim) element of a block's K and V halves, by writing
    token and dim indices through the kernel itself into a scratch block. Returns (k_offsets, v_offsets) for
    :class:`PagedKV`, or None when vLLM's kernel is not importable (the plain layout is then what is there).

    Indices are written one base-:data:`PROBE_BASE` digit per pass, so the probe is exact for any block size and
    head size (Gemma's head_dim 256 included) whatever the cache dtype rounds. A kernel whose writes cannot be read
    back as a permutation raises :class:`ConfigError`: reading its cache as the plain layout would hand the codec
    scrambled keys (a raw round trip would still look exact; a compressed one would not)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    _, H, bs, d2 = kv_cache.shape
    D = d2 // 2
    isa = _get_attn_isa(kv_cache.dtype, block_size, D, cache_dtype)

    def written(idx: torch.Tensor) -> torch.Tensor:
        """The index written at every element of the slab, read back digit by digit (-1 where nothing landed)."""
        total = torch.zeros(2 * bs * D, dtype=torch.int64)
        scale, top = 1, int(idx.max()) + 1
        while scale < top or scale == 1:
            scratch = torch.zeros(1, H, bs, d2, dtype=kv_cache.dtype)
            kc, vc = scratch.view(1, H, 2 * bs, D).chunk(2, dim=2)
            x = ((idx // scale) % PROBE_BASE + 1).expand(bs, H, D).to(kv_cache.dtype).contiguous()
            ops.cpu_attn_reshape_and_cache(x, x, kc, vc, torch.arange(bs, dtype=torch.int64), isa)
            digit = scratch.view(H, 2 * bs * D)[0].float().round().to(torch.int64) - 1
            if (digit < 0).any():
                return digit  # a hole: nothing was written there
            total += digit * scale
            scale *= PROBE_BASE
        return total

    tok = written(torch.arange(bs)[:, None, None])
    dim = written(torch.arange(D)[None, None, :])
    half = bs * D
    out = []
    for lo in (0, half):
        t, d = tok[lo : lo + half], dim[lo : lo + half]
        if (t < 0).any() or (d < 0).any() or (t >= bs).any() or (d >= D).any():
            raise ConfigError(
                f"vLLM's CPU cache kernel ({isa}) left a layout this connector cannot read (block {bs}, head {D})"
            )
        flat = t * D + d
        if torch.unique(flat).numel() != half:
            raise ConfigError(
                f"vLLM's CPU cache kernel ({isa}) wrote a block {bs} x head {D} slab that is not a permutation"
            )
        offsets = torch.empty(half, dtype=torch.int64)
        offsets[flat] = torch.arange(half)
        out.append(offsets)
    return out[0], out[1]
