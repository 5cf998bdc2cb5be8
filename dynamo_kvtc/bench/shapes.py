"""KV shapes of real models for synthetic benchmarks (no weights needed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    theta: float


SHAPES = {
    "smollm2-135m": Shape(30, 3, 64, 1e5),
    "llama-3.1-8b": Shape(32, 8, 128, 5e5),
    "mistral-nemo-12b": Shape(40, 8, 128, 1e6),
    "llama-3.3-70b-pp20": Shape(20, 8, 128, 5e5),
}
