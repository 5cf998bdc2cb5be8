"""Rotary position embedding (RoPE): the model's own rotary configuration, removal and re-application.

KVTC compresses keys *before* RoPE (paper §3.1): engines store post-RoPE keys, so the encoder undoes the rotation at
each token's absolute position and the decoder re-applies it. A :class:`RotaryConfig` records everything needed to do
that without the model object: theta, the scaling type (default, linear, llama3, yarn), partial rotary and the pairing
style (``"half"``: rotate-half as in Llama/GPT-NeoX; ``"interleaved"``: adjacent pairs as in GPT-J).

A RoPE rotation with attention scaling ``s`` (yarn) maps ``k -> s * R(theta) k``; its inverse is
``R(-theta) k' / s``. Angles follow Hugging Face's float32 convention so that removal matches the engine's rotation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from ..errors import ConfigError

STYLES = ("half", "interleaved")
SCALINGS = ("default", "linear", "llama3", "yarn", "none")


@dataclass(frozen=True)
class RotaryConfig:
    """Rotary configuration of one attention layer (all KV heads of a layer share it)."""

    head_dim: int
    theta: float = 10000.0
    rotary_dim: int | None = None  # dims rotated from the start of each head; None = head_dim
    rotary_offset: int = 0  # first rotated dim (an MLA "head" keeps its RoPE part after the latent: not 0)
    style: str = "half"
    scaling: str = "default"  # "none" = the layer applies no RoPE at all
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"rotary head_dim must be a positive even number, got {self.head_dim}")
        rd = self.dims
        if rd <= 0 or rd % 2 or rd > self.head_dim:
            raise ConfigError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {rd}")
        if self.rotary_offset < 0 or self.rotary_offset + rd > self.head_dim:
            raise ConfigError(
                f"rotary dims [{self.rotary_offset}, {self.rotary_offset + rd}) run outside head_dim {self.head_dim}"
            )
        if self.style not in STYLES:
            raise ConfigError(f"rotary style must be one of {STYLES}, got {self.style!r}")
        if self.scaling not in SCALINGS:
            raise ConfigError(
                f"rotary scaling {self.scaling!r} is not supported (supported: {', '.join(SCALINGS)}); "
                "dynamic-NTK and longrope depend on the run-time sequence length "
                "and cannot be undone from positions alone"
            )
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise ConfigError(f"rope theta must be positive and finite, got {self.theta}")
        if self.scaling in ("linear", "llama3", "yarn") and not self.factor > 0:
            raise ConfigError(f"rope scaling factor must be positive, got {self.factor}")

    @property
    def dims(self) -> int:
        return self.head_dim if self.rotary_dim is None else int(self.rotary_dim)

    # ------------------------------------------------------------------ frequencies
    def inv_freq(self) -> torch.Tensor:
        """Inverse frequencies (float32, length rotary_dim/2), as Hugging Face computes them."""
        dim = self.dims
        base = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.scaling in ("default", "none"):
            return base
        if self.scaling == "linear":
            return base / self.factor
        if self.scaling == "llama3":
            old = self.original_max_position_embeddings
            low_wl = old / self.low_freq_factor
            high_wl = old / self.high_freq_factor
            wavelen = 2 * math.pi / base
            inv = torch.where(wavelen > low_wl, base / self.factor, base)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * inv / self.factor + smooth * inv
            medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
            return torch.where(medium, smoothed, inv)
        # yarn
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extra_factor = 1 - ramp
        return interpolation * (1 - extra_factor) + extrapolation * extra_factor

    def attention_scaling(self) -> float:
        """Factor multiplied into cos and sin (yarn's mscale; 1 otherwise)."""
        if self.scaling != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return get_mscale(self.factor)

    def cos_sin(
        self, positions: torch.Tensor, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [T, rotary_dim] (float32), laid out for this config's pairing style."""
        inv = self.inv_freq().to(device=device or positions.device)
        ang = positions.to(device=inv.device, dtype=torch.float32)[:, None] * inv[None, :]
        if self.style == "half":
            ang = torch.cat((ang, ang), dim=-1)
        else:
            ang = torch.repeat_interleave(ang, 2, dim=-1)
        s = self.attention_scaling()
        return ang.cos() * s, ang.sin() * s

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        if not d["rotary_offset"]:  # absent when 0: every calibration made before MLA keeps its id
            d.pop("rotary_offset")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RotaryConfig:
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown rotary config keys: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_hf_config(cls, config: Any, layer: int | None = None) -> RotaryConfig:
        """Build from a Hugging Face config (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``).

        ``layer`` selects per-layer parameters for models that mix local and global attention (Gemma 3).
        """
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params: dict[str, Any] = {}
        rp = getattr(config, "rope_parameters", None)
        if isinstance(rp, dict) and rp:
            if all(isinstance(v, dict) for v in rp.values()):  # per attention type (Gemma 3: full / sliding)
                kind = "full_attention"
                types = getattr(config, "layer_types", None)
                if layer is not None and types:
                    kind = types[layer]
                params = dict(rp.get(kind) or next(iter(rp.values())))
            else:
                params = dict(rp)
        else:
            rs = getattr(config, "rope_scaling", None)
            params = dict(rs) if isinstance(rs, dict) else {}
            params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
            types = getattr(config, "layer_types", None)
            if layer is not None and types and types[layer] == "sliding_attention":
                local = getattr(config, "rope_local_base_freq", None)
                if local is not None:
                    params = {"rope_type": "default", "rope_theta": local}
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            raise ConfigError(
                f"model uses rope_type={rope_type!r}, which dynamo_kvtc cannot undo from positions alone "
                "(supported: default, linear, llama3, yarn)"
            )
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        rotary_dim = int(head_dim * partial)
        kw: dict[str, Any] = {
            "head_dim": int(head_dim),
            "theta": float(params.get("rope_theta", 10000.0)),
            "rotary_dim": None if rotary_dim == head_dim else rotary_dim,
            "style": "half",
            "scaling": rope_type,
        }
        if rope_type in ("linear", "llama3", "yarn"):
            kw["factor"] = float(params["factor"])
        if rope_type == "llama3":
            kw["low_freq_factor"] = float(params["low_freq_factor"])
            kw["high_freq_factor"] = float(params["high_freq_factor"])
            kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        if rope_type == "yarn":
            omp = params.get("original_max_position_embeddings") or config.max_position_embeddings
            kw["original_max_position_embeddings"] = int(omp)
            for key in ("beta_fast", "beta_slow"):
                if params.get(key) is not None:
                    kw[key] = float(params[key])
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if params.get(key) is not None:
                    kw[key] = float(params[key])
            if params.get("truncate") is not None:
                kw["truncate"] = bool(params["truncate"])
        return cls(**kw)


def _rotate(x: torch.Tensor, style: str) -> torch.Tensor:
    if style == "half":
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: RotaryConfig, inverse: bool) -> torch.Tensor:
    """Rotate ``x [..., T, H, head_dim]`` (float32) with tables from ``cfg.cos_sin`` ([T, rotary_dim])."""
    if cfg.scaling == "none":
        return x
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    a, b = cfg.rotary_offset, cfg.rotary_offset + cfg.dims
    head, rot, rest = x[..., :a], x[..., a:b], x[..., b:]
    if inverse:
        out = (rot * cos - _rotate(rot, cfg.style) * sin) / (cfg.attention_scaling() ** 2)
    else:
        out = rot * cos + _rotate(rot, cfg.style) * sin
    parts = [t for t in (head, out, rest) if t.shape[-1]]
    return torch.cat(parts, dim=-1) if len(parts) > 1 else out


def remove_rope(keys: torch.Tensor, positions: torch.Tensor, cfg: RotaryConfig) -> torch.Tensor:
    """Undo RoPE on post-RoPE keys [..., T, H, D] (float32) at absolute ``positions``."""
    cos, sin = cfg.cos_sin(positions, device=keys.device)
    return rotate(keys, cos, sin, cfg, inverse=True)


def apply_rope(keys: torch.Tensor, positions: torch.Tensor, cfg: RotaryConfig) -> torch.Tensor:
    """Apply RoPE to pre-RoPE keys [..., T, H, D] (float32) at absolute ``positions``."""
    cos, sin = cfg.cos_sin(positions, device=keys.device)
    return rotate(keys, cos, sin, cfg, inverse=False)
