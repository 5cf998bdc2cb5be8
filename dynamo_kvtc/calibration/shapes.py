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
    """The dimensions of a decoder-only transformer (Llama / Mistral / DeepSeek-V3 family) and its RoPE.

    An MLA shape (``kv_lora_rank`` > 0) caches one row of ``kv_lora_rank + rope_dim`` per token and layer; its
    ``kv_heads`` / ``head_dim`` are the codec's view of that row (1 head of half the row, calibration/mla.py)."""

    family: str  # "llama", "mistral" or "deepseek_v3": the transformers config class
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
    kv_lora_rank: int = 0  # MLA: the latent's width (0: not MLA)
    rope_dim: int = 0  # MLA: the RoPE key part's width
    q_lora_rank: int = 0
    experts: int = 0  # routed experts (MoE layers), each of ``expert_inter``
    expert_inter: int = 0
    dense_layers: int = 0  # the first layers with a dense MLP of ``inter``

    def with_layers(self, layers: int | None) -> ModelShape:
        if layers is None:
            return self
        if not 1 <= layers <= self.layers:
            raise ConfigError(f"a shape keeps 1..{self.layers} layers, got {layers}")
        return replace(self, layers=layers)

    def params(self) -> int:
        """Parameters (untied embedding and LM head)."""
        if self.kv_lora_rank:
            return self._mla_params()
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        return self.layers * (attn + 3 * self.hidden * self.inter + 2 * self.hidden) + 2 * self.vocab * self.hidden

    def _mla_params(self) -> int:
        nope = v = 128  # DeepSeek-V3's per-head no-RoPE query/key and value widths
        h, nh, q = self.hidden, self.heads, self.q_lora_rank
        attn = h * q + q * nh * (nope + self.rope_dim) + h * (self.kv_lora_rank + self.rope_dim)
        attn += self.kv_lora_rank * nh * (nope + v) + nh * v * h
        dense = min(self.dense_layers, self.layers)
        moe = (self.experts + 1) * 3 * h * self.expert_inter + h * self.experts  # routed + one shared, the router
        mlp = dense * 3 * h * self.inter + (self.layers - dense) * moe
        return self.layers * (attn + 2 * h) + mlp + 2 * self.vocab * h

    def kv_features(self) -> int:
        """Features of one calibration row (all layers x KV heads x head_dim) for K or for V."""
        return self.layers * self.kv_heads * self.head_dim

    def hf_config(self) -> Any:
        """The transformers config of this shape (imports transformers)."""
        if self.family == "deepseek_v3":
            return self._deepseek_config()
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

    def _deepseek_config(self) -> Any:
        from transformers import DeepseekV3Config

        rope = {"rope_theta": self.rope_theta, **dict(self.rope_scaling)}
        cfg = DeepseekV3Config(
            hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.heads, intermediate_size=self.inter, moe_intermediate_size=self.expert_inter,
            n_routed_experts=self.experts, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
            first_k_dense_replace=self.dense_layers, kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
            qk_rope_head_dim=self.rope_dim, qk_nope_head_dim=128, v_head_dim=128, vocab_size=self.vocab,
            max_position_embeddings=self.max_positions, rope_parameters=rope, tie_word_embeddings=False,
        )  # fmt: skip
        cfg.architectures = ["DeepseekV3ForCausalLM"]
        return cfg


_LLAMA3_ROPE = (
    ("rope_type", "llama3"),
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 8192),
)

_DEEPSEEK_V3_ROPE = (
    ("rope_type", "yarn"),
    ("factor", 40.0),
    ("original_max_position_embeddings", 4096),
    ("beta_fast", 32.0),
    ("beta_slow", 1.0),
    ("mscale", 1.0),
    ("mscale_all_dim", 1.0),
)

SHAPES: dict[str, ModelShape] = {
    "smollm2-135m": ModelShape("llama", 576, 30, 9, 3, 64, 1536, 49152, 1e5, max_positions=8192),
    "llama-3.1-8b": ModelShape("llama", 4096, 32, 32, 8, 128, 14336, 128256, 5e5, _LLAMA3_ROPE),
    "mistral-nemo-12b": ModelShape("mistral", 5120, 40, 32, 8, 128, 14336, 131072, 1e6),
    "llama-3.1-70b": ModelShape("llama", 8192, 80, 64, 8, 128, 28672, 128256, 5e5, _LLAMA3_ROPE),
    # MLA: one 576-wide latent row per token and layer (512 + RoPE 64), seen by the codec as 1 head of 288
    "deepseek-v3": ModelShape(
        "deepseek_v3",
        7168,
        61,
        128,
        1,
        288,
        18432,
        129280,
        1e4,
        _DEEPSEEK_V3_ROPE,
        163840,
        kv_lora_rank=512,
        rope_dim=64,
        q_lora_rank=1536,
        experts=256,
        expert_inter=2048,
        dense_layers=3,
    ),  # fmt: skip
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
