"""``cpu``: vLLM's CPU attention backend, per layer ``[num_blocks, H, block_size, 2*D]``.

Each ``[block, head]`` slab holds a K half then a V half of ``block_size*D`` elements each, whose element order is the
attention kernel's own (ISA-dependent: the AVX2 "vec" kernel stores K transposed, ``[D, block_size]``, and V as
``[block_size, D]``). ``k_offsets``/``v_offsets`` give, for logical element ``t*D + d``, its offset inside the half;
:func:`probe_cpu_offsets` learns them by writing a probe through the engine's own kernel (bf16, fp16 and FP8 caches).
Without them both halves are ``[block_size, D]``. A page is one block, ``[H, block_size, 2*D]``; gather and scatter
copy through pages (the kernel's order is no strided view).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...codec import fp8
from ...errors import ConfigError
from .base import KV, KVLayout
from .registry import register


@register
class CpuLayout(KVLayout):
    name = "cpu"
    in_place = False

    def __init__(
        self,
        block_size: int,
        num_heads: int,
        head_dim: int,
        *,
        k_offsets: torch.Tensor | None = None,
        v_offsets: torch.Tensor | None = None,
    ) -> None:
        super().__init__(block_size, num_heads, head_dim)
        half = block_size * head_dim
        self.offsets = None
        if k_offsets is not None or v_offsets is not None:
            offs = []
            for name, o in (("k_offsets", k_offsets), ("v_offsets", v_offsets)):
                o = torch.arange(half) if o is None else torch.as_tensor(o, dtype=torch.int64).flatten()
                if o.numel() != half or not torch.equal(torch.sort(o).values, torch.arange(half)):
                    raise ConfigError(f"{name} must be a permutation of range({half})")
                offs.append(o)
            self.offsets = (offs[0], offs[1])  # physical element of logical t*D+d
            self.inverse = (torch.argsort(offs[0]), torch.argsort(offs[1]))  # logical element of each physical one

    @classmethod
    def detect(cls, t: torch.Tensor, num_blocks: int | None, mla: bool) -> bool:
        return not mla and t.dim() == 4

    @classmethod
    def geometry(cls, cache: torch.Tensor) -> tuple[int, int, int, int]:
        if cache.dim() != 4 or cache.shape[-1] % 2:
            raise cls.wrong("[num_blocks, H, block_size, 2*head_dim]", cache)
        nb, H, bs, d2 = cache.shape
        return nb, bs, H, d2 // 2

    def layer_views(self, cache: torch.Tensor) -> KV:
        raise ConfigError("the cpu layout is not addressable in place (the kernel's element order is no view)")

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.block_size, 2 * self.head_dim)

    def unpage(self, pages: torch.Tensor) -> KV:
        lead, (H, bs, D) = pages.shape[:-3], (self.num_heads, self.block_size, self.head_dim)
        x = pages.reshape(*lead, H, 2 * bs * D)
        k, v = x[..., : bs * D], x[..., bs * D :]
        if self.offsets is not None:
            k, v = k[..., self.offsets[0].to(k.device)], v[..., self.offsets[1].to(v.device)]
        return k.reshape(*lead, H, bs, D).transpose(-3, -2), v.reshape(*lead, H, bs, D).transpose(-3, -2)

    def page(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        lead, (H, bs, D) = k.shape[:-3], (self.num_heads, self.block_size, self.head_dim)
        k = k.transpose(-3, -2).reshape(*lead, H, bs * D)
        v = v.transpose(-3, -2).reshape(*lead, H, bs * D)
        if self.offsets is not None:
            k, v = k[..., self.inverse[0].to(k.device)], v[..., self.inverse[1].to(v.device)]
        return torch.cat((k, v), dim=-1).reshape(*lead, H, bs, 2 * D)


# --------------------------------------------------------------------------------------------------- the probe
PROBE_BASE = 16  # largest digit size of the probe (fewer passes); a cache dtype that holds fewer small integers
# exactly gets a smaller one (:func:`probe_base`: float8_e5m2 holds 1..8 exactly, not 9)


def probe_base(stored: torch.dtype) -> int:
    """The largest base ``b <= PROBE_BASE`` (a power of two) whose digits ``1..b`` survive a cast to ``stored``
    exactly: 16 for bf16, fp16 and float8_e4m3fn, 8 for float8_e5m2 (two mantissa bits: 9 rounds to 8)."""
    b = PROBE_BASE
    while b > 1:
        x = torch.arange(1, b + 1, dtype=torch.float32)
        if torch.equal(x.to(stored).float(), x):
            return b
        b //= 2
    raise ConfigError(f"a {stored} cache holds no probe digit exactly")


Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def vllm_cache_writer(
    block_size: int, head_dim: int, cache_dtype: str, model_dtype: torch.dtype
) -> tuple[Writer, str] | None:
    """vLLM's CPU cache-write kernel as ``write(key, value, key_cache, value_cache, slot_mapping)`` (scales 1.0), and
    its ISA; None when vLLM's kernels are not importable."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    isa = _get_attn_isa(model_dtype, block_size, head_dim, cache_dtype)

    def write(key, value, key_cache, value_cache, slots) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, 1.0, 1.0, cache_dtype)

    return write, isa


def probe_cpu_offsets(
    kv_cache: torch.Tensor,
    block_size: int,
    cache_dtype: str = "auto",
    model_dtype: torch.dtype | None = None,
    write: Writer | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Learn where vLLM's CPU attention kernel puts each (token, dim) element of a block's K and V halves, by writing
    token and dim indices through the kernel itself into a scratch block. Returns (k_offsets, v_offsets) for
    :class:`CpuLayout`, or None when vLLM's kernel is not importable (the plain layout is then what is there).

    ``cache_dtype``: vLLM's ``--kv-cache-dtype``; an FP8 cache (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) is written as
    vLLM's FP8 path writes it, values of ``model_dtype`` (default bf16) cast to the float8 format in uint8 bytes, scale
    1. ``write``: the cache-write kernel (default vLLM's, :func:`vllm_cache_writer`).

    Indices are written one digit per pass, base :func:`probe_base` of what the cache stores, so every digit survives
    the cache's cast exactly and the probe is exact for any block size and head size (Gemma's head_dim 256
    included). A kernel whose writes cannot be read back as a permutation raises :class:`ConfigError`: reading its
    cache as the plain layout would hand the codec scrambled keys (a raw round trip would still look exact; a
    compressed one would not)."""
    fmt = fp8.kv_format(cache_dtype)
    _, H, bs, d2 = kv_cache.shape
    D = d2 // 2
    value_dtype = model_dtype or (torch.bfloat16 if fmt is not None else kv_cache.dtype)
    stored = torch.uint8 if fmt is not None else kv_cache.dtype  # vLLM's FP8 path writes uint8 bytes
    isa: Any = "given"
    if write is None:
        found = vllm_cache_writer(block_size, D, str(cache_dtype), value_dtype)
        if found is None:
            return None
        write, isa = found
    base = probe_base(fmt or stored)

    def written(idx: torch.Tensor) -> torch.Tensor:
        """The index written at every element of the slab, read back digit by digit (-1 where nothing landed)."""
        total = torch.zeros(2 * bs * D, dtype=torch.int64)
        scale, top = 1, int(idx.max()) + 1
        while scale < top or scale == 1:
            scratch = torch.zeros(1, H, bs, d2, dtype=stored)
            kc, vc = scratch.view(1, H, 2 * bs, D).chunk(2, dim=2)
            x = ((idx // scale) % base + 1).expand(bs, H, D).to(value_dtype).contiguous()
            write(x, x, kc, vc, torch.arange(bs, dtype=torch.int64))
            back = scratch.view(fmt) if fmt is not None else scratch
            digit = back.view(H, 2 * bs * D)[0].float().round().to(torch.int64) - 1
            if (digit < 0).any():
                return digit  # a hole: nothing was written there
            total += digit * scale
            scale *= base
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
