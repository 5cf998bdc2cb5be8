"""RoPE removal and re-application: exact inverses, the model's own frequencies, and clear refusals."""

from __future__ import annotations

import pytest
import torch

from dynamo_kvtc.codec.rope import RotaryConfig, apply_rope, remove_rope
from dynamo_kvtc.errors import ConfigError

CONFIGS = [
    RotaryConfig(64, theta=1e5),
    RotaryConfig(64, theta=1e4, style="interleaved"),
    RotaryConfig(64, theta=1e4, rotary_dim=32),
    RotaryConfig(
        128,
        theta=5e5,
        scaling="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    RotaryConfig(64, theta=1e4, scaling="linear", factor=4.0),
    RotaryConfig(64, theta=1e4, scaling="yarn", factor=4.0, original_max_position_embeddings=4096),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.scaling}-{c.style}-{c.dims}")
def test_remove_inverts_apply(cfg):
    x = torch.randn(300, 3, cfg.head_dim)
    pos = torch.arange(5000, 5300)
    y = apply_rope(x, pos, cfg)
    assert not torch.allclose(y, x, atol=1e-2)  # the rotation really rotates
    back = remove_rope(y, pos, cfg)
    assert torch.allclose(back, x, atol=1e-4, rtol=1e-4)
    if cfg.dims < cfg.head_dim:  # partial rotary leaves the tail untouched
        assert torch.equal(y[..., cfg.dims :], x[..., cfg.dims :])


def test_position_zero_is_identity():
    cfg = RotaryConfig(64, theta=1e5)
    x = torch.randn(1, 2, 64)
    assert torch.allclose(apply_rope(x, torch.tensor([0]), cfg), x)


@pytest.mark.parametrize(
    "params",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
        {"rope_type": "default", "rope_theta": 100000.0},
    ],
    ids=lambda p: p["rope_type"],
)
def test_inv_freq_matches_transformers(params):
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        rope_parameters=dict(params),
    )
    ours = RotaryConfig.from_hf_config(cfg)
    if params["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref = LlamaRotaryEmbedding(cfg).inv_freq
        scale = 1.0
    else:
        ref, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    assert torch.allclose(ours.inv_freq(), ref.float(), rtol=1e-6), transformers.__version__
    assert ours.attention_scaling() == pytest.approx(scale)


def test_unsupported_scaling_refused():
    from types import SimpleNamespace

    c = SimpleNamespace(hidden_size=64, num_attention_heads=1, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ConfigError, match="dynamic"):
        RotaryConfig.from_hf_config(c)
    with pytest.raises(ConfigError, match="style"):
        RotaryConfig(64, style="spiral")
    with pytest.raises(ConfigError, match="rotary_dim"):
        RotaryConfig(64, rotary_dim=65)
