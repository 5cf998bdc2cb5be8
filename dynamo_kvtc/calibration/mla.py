"""MLA models (DeepSeek-V2/V3, Kimi-K2): their KV cache as the codec's K/V pair.

An MLA layer caches, per token, one latent ``c`` of ``kv_lora_rank`` (C) features (``kv_a_proj_with_mqa``'s output
after ``kv_a_layernorm``) and one post-RoPE key part ``k_pe`` of ``qk_rope_head_dim`` (R) features, shared by every
attention head. vLLM stores ``[c | k_pe]`` (``C + R`` wide, e.g. 576) as one "head" per token and layer, with the
RoPE of ``k_pe`` in interleaved pairs (GPT-J style). The codec sees that row cut in two halves of ``D = (C + R) / 2``
(:func:`dynamo_kvtc.tiers.layouts.mla.mla_views`): V the first half (latent only), K the second (the latent's tail, then
``k_pe``), one KV head each; K's RoPE sits at ``rotary_offset = D - R``. Raw bytes per token are then exactly the
cache's (``2 * L * D`` elements). The PCA runs across layers over these features as for any model.

Transformers' DeepSeek attention caches ``c`` as the layer's keys and ``k_pe`` as its values. DeepSeek-V2 rotates
``k_pe`` in place (complex pairs: vLLM's order already); DeepSeek-V3 (``rope_interleave``) returns it de-interleaved
(even dims, then odd dims), which :func:`mla_kv` puts back in vLLM's order.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..codec.model import ModelFingerprint, dtype_name
from ..codec.rope import RotaryConfig
from ..errors import ModelError


def text_config(config: Any) -> Any:
    c = getattr(config, "config", config)
    return getattr(c, "text_config", None) or c


def is_mla(config: Any) -> bool:
    """Whether a (Hugging Face or vLLM-held) model config describes multi-head latent attention."""
    c = text_config(config)
    return bool(getattr(c, "kv_lora_rank", None)) and bool(getattr(c, "qk_rope_head_dim", None))


def mla_dims(config: Any) -> tuple[int, int, int]:
    """(kv_lora_rank C, qk_rope_head_dim R, half D = (C + R) / 2); ModelError when the cache row cannot be halved
    with the RoPE part inside K."""
    c = text_config(config)
    C, R = int(c.kv_lora_rank), int(c.qk_rope_head_dim)
    if (C + R) % 2 or R > (C + R) // 2:
        raise ModelError(f"MLA cache row of kv_lora_rank {C} + rope {R} cannot be cut into K/V halves")
    return C, R, (C + R) // 2


def deinterleaved_pe(config: Any) -> bool:
    """Whether transformers caches this model's rotated ``k_pe`` de-interleaved (DeepSeek-V3 style)."""
    c = text_config(config)
    return getattr(c, "model_type", "") != "deepseek_v2" and getattr(c, "rope_interleave", True) is not False


def mla_rotary(config: Any) -> RotaryConfig:
    """The RoPE of K's half: ``R`` interleaved dims at ``D - R``, with the model's theta and scaling (yarn)."""
    c = text_config(config)
    if getattr(c, "model_type", "") != "deepseek_v2" and getattr(c, "rope_interleave", True) is False:
        raise ModelError("MLA model with rope_interleave=False: vLLM rotates DeepSeek keys in interleaved pairs only")
    _, R, D = mla_dims(c)
    base = RotaryConfig.from_hf_config(c)
    return replace(base, head_dim=D, rotary_dim=R, rotary_offset=D - R, style="interleaved")


def mla_fingerprint(config: Any, *, tokenizer: str = "", model_name: str = "", kv_dtype=torch.bfloat16):
    """Fingerprint of an MLA model's cache seen as one K/V head of ``(C + R) / 2`` per layer."""
    c = text_config(config)
    layers = int(c.num_hidden_layers)
    _, _, D = mla_dims(c)
    rot = mla_rotary(c)
    arch = (getattr(c, "architectures", None) or [type(config).__name__])[0]
    return ModelFingerprint(
        architecture=arch,
        num_layers=layers,
        num_kv_heads=1,
        head_dim=D,
        dtype=dtype_name(kv_dtype),
        rotary=(rot,) * layers,
        tokenizer=tokenizer,
        model_name=model_name,
        total_kv_heads=1,
    )


def is_mla_fingerprint(fp: ModelFingerprint) -> bool:
    """Whether a calibration was made for an MLA model (only the MLA halving puts RoPE at an offset)."""
    return any(r.rotary_offset for r in fp.rotary)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[..., 1, D]`` of cache rows ``[..., C + R]`` (as :func:`~dynamo_kvtc.tiers.layouts.mla.mla_views`)."""
    D = rows.shape[-1] // 2
    return rows[..., None, D:], rows[..., None, :D]


def join_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Cache rows ``[..., C + R]`` of K, V ``[..., 1, D]``."""
    return torch.cat((v[..., 0, :], k[..., 0, :]), dim=-1)


def interleave_pe(k_rot: torch.Tensor) -> torch.Tensor:
    """Transformers' de-interleaved rotated ``k_pe`` (``[x_even.. | x_odd..]``) in vLLM's interleaved order."""
    h = k_rot.shape[-1] // 2
    return torch.stack((k_rot[..., :h], k_rot[..., h:]), dim=-1).flatten(-2)


def hf_cache_layers(config: Any, k: torch.Tensor, v: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The inverse of :func:`mla_kv`: per layer (latent ``[1, 1, T, C]``, k_pe ``[1, 1, T, R]``) as transformers'
    DeepSeek attention caches them, from K, V ``[L, T, 1, D]`` (what the evaluation harness feeds the model)."""
    c = text_config(config)
    C, _, _ = mla_dims(c)
    out = []
    for layer in range(k.shape[0]):
        row = join_rows(k[layer], v[layer])  # [T, C + R]
        pe = row[:, C:]
        if deinterleaved_pe(c):
            pe = torch.cat((pe[..., 0::2], pe[..., 1::2]), dim=-1)
        out.append((row[None, None, :, :C], pe[None, None]))
    return out


def mla_kv(
    config: Any, layers: list[tuple[torch.Tensor, torch.Tensor]], kv_dtype: torch.dtype, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[L, T, 1, D]`` as vLLM's MLA cache holds them (``[c | k_pe]`` halved), in ``kv_dtype`` on ``device``,
    from transformers' per-layer cache of a DeepSeek model: (latent ``[1, 1, T, C]``, rotated k_pe ``[1, 1, T, R]``)."""
    c = text_config(config)
    C, R, _ = mla_dims(c)
    rows = []
    for latent, k_rot in layers:
        if latent.shape[-1] != C or k_rot.shape[-1] != R:
            raise ModelError(f"the model's cache is not MLA's latent {C} + rope {R}: {tuple(latent.shape)}")
        if deinterleaved_pe(c):
            k_rot = interleave_pe(k_rot)
        rows.append(torch.cat((latent[0, 0], k_rot[0, 0]), dim=-1).to(device, kv_dtype))
    k, v = split_rows(torch.stack(rows))  # rows [L, T, C + R]
    return k.contiguous(), v.contiguous()
