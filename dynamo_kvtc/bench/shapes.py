"""KV shapes of real models for synthetic benchmarks (no weights needed; dimensions from calibration/shapes.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..calibration.shapes import SHAPES as MODEL_SHAPES


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    theta: float


def _kv(name: str, layers: int | None = None) -> Shape:
    m = MODEL_SHAPES[name].with_layers(layers)
    return Shape(m.layers, m.kv_heads, m.head_dim, m.rope_theta)


SHAPES = {
    "smollm2-135m": _kv("smollm2-135m"),
    "llama-3.1-8b": _kv("llama-3.1-8b"),
    "mistral-nemo-12b": _kv("mistral-nemo-12b"),
    "llama-3.3-70b-pp20": _kv("llama-3.1-70b", 20),  # a middle pipeline stage: 20 of the 80 layers
}
