"""Real models' shapes without their weights: a transformers config for each, from which a random-initialised model
is built directly on the device (``--model shape:llama-3.1-8b``; ``shape:NAME@LAYERS`` keeps the first LAYERS
layers, for shapes that do not fit one GPU).

A random model measures speed and memory only (its KV statistics are not a real model's). The benchmarks' synthetic
shapes (``bench/shapes.py``, ``bench/gpu_model.py``) take their dimensions from this table. No torch or transformers
at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError

PREFIX = "shape:"


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer (Llama / Mistral family) and its RoPE."""

    family: str  # "llama" or "mistral": the transformers config class
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # llama3-style scaling, as (key, value) pairs
    max_positions: int = 131072

    def with_layers(self, layers: int | None) -> ModelShape:
        if layers is None:
            return self
        if not 1 <= layers <= self.layers:
            raise ConfigError(f"a shape keeps 1..{self.layers} layers, got {layers}")
        return replace(self, layers=layers)

    def params(self) -> int:
        """Parameters (untied embedding and LM head)."""
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        return self.layers * (attn + 3 * self.hidden * self.inter + 2 * self.hidden) + 2 * self.vocab * self.hidden

    def kv_features(self) -> int:
        """Features of one calibration row (all layers x KV heads x head_dim) for K or for V."""
        return self.layers * self.kv_heads * self.head_dim

    def hf_config(self) -> Any:
        """The transformers config of this shape (imports transformers)."""
        kw: dict[str, Any] = dict(
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.inter,
            vocab_size=self.vocab,
            max_position_embeddings=self.max_positions,
            rope_theta=self.rope_theta,
            tie_word_embeddings=False,
        )
        if self.family == "llama":
            from transformers import LlamaConfig as Config

            if self.rope_scaling:
                kw["rope_scaling"] = dict(self.rope_scaling)
        elif self.family == "mistral":
            from transformers import MistralConfig as Config

            kw["sliding_window"] = None
        else:
            raise ConfigError(f"unknown model family {self.family!r}")
        cfg = Config(**kw)
        cfg.architectures = [f"{type(cfg).__name__.removesuffix('Config')}ForCausalLM"]
        return cfg


_LLAMA3_ROPE = (
    ("rope_type", "llama3"),
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192),
)

SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape("llama", 576, 30, 9, 3, 64, 1536, 49152, 1e5, max_positions=8192),
    "llama-3.1-8b": ModelShape("llama", 4096, 32, 32, 8, 128, 14336, 128256, 5e5, _LLAMA3_ROPE),
    "mistral-nemo-12b": ModelShape("mistral", 5120, 40, 32, 8, 128, 14336, 131072, 1e6),
    "llama-3.1-70b": ModelShape("llama", 8192, 80, 64, 8, 128, 28672, 128256, 5e5, _LLAMA3_ROPE),
}


def is_shape(name: object) -> bool:
    return str(name).startswith(PREFIX)


def parse_shape(spec: str) -> tuple[str, ModelShape]:
    """``shape:NAME`` or ``shape:NAME@LAYERS`` (or the same without the prefix) -> (name, shape)."""
    s = spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec
    name, _, layers = s.partition("@")
    if name not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r} (known: {', '.join(SHAPES)})")
    try:
        n = int(layers) if layers else None
    except ValueError:
        raise ConfigError(f"shape layers must be an integer, got {spec!r}") from None
    return s, SHAPES[name].with_layers(n)
