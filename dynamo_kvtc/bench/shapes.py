"""KV shapes of real models for synthetic benchmarks (no weights needed; dimensions from calibration/shapes.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..calibration.shapes import SHAPES as MODEL_SHAPES


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    theta: float
    rope_dim: int = 0  # MLA: K's RoPE part, interleaved, at the end of its half-row (0: RoPE over the whole head)

    def rotary(self) -> Any:
        """The RotaryConfig of every layer (an MLA shape: ``rope_dim`` interleaved dims at ``head_dim - rope_dim``)."""
        from ..codec.rope import RotaryConfig

        if not self.rope_dim:
            return RotaryConfig(self.head_dim, theta=self.theta)
        return RotaryConfig(
            self.head_dim, theta=self.theta, rotary_dim=self.rope_dim, rotary_offset=self.head_dim - self.rope_dim,
            style="interleaved",
        )  # fmt: skip


def _kv(name: str, layers: int | None = None) -> Shape:
    m = MODEL_SHAPES[name].with_layers(layers)
    return Shape(m.layers, m.kv_heads, m.head_dim, m.rope_theta, m.rope_dim)


SHAPES = {
    "smollm2-135m": _kv("smollm2-135m"),
    "llama-3.1-8b": _kv("llama-3.1-8b"),
    "mistral-nemo-12b": _kv("mistral-nemo-12b"),
    "llama-3.3-70b-pp20": _kv("llama-3.1-70b", 20),  # a middle pipeline stage: 20 of the 80 layers
    "deepseek-v3": _kv("deepseek-v3"),  # MLA latent rows (Kimi-K2: the same cache shape)
    "deepseek-v3-l4": _kv("deepseek-v3", 4),  # its first 4 layers: CPU smoke runs
}
