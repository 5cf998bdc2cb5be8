"""A small random-initialised DeepSeek-V3-shaped model (MLA) for the MLA tests: no trained MLA model is reachable
offline. ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 is the only latent vLLM's CPU MLA kernel runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def deepseek_config(layers: int = 2, kv_lora_rank: int = 512, rope: int = 64, **kw):
    from transformers import DeepseekV3Config

    args = dict(
        vocab_size=49152, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=layers, kv_lora_rank=kv_lora_rank,
        q_lora_rank=None, qk_rope_head_dim=rope, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096,
        n_group=1, topk_group=1, architectures=["DeepseekV3ForCausalLM"],
    )  # fmt: skip
    args.update(kw)
    return DeepseekV3Config(**args)


def deepseek_model(dtype: torch.dtype = torch.float32, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(deepseek_config(**kw)).to(dtype).eval()


def save_deepseek(out: Path, tokenizer_dir: Path, **kw) -> Path:
    """The model saved as a bf16 Hugging Face checkpoint with the SmolLM2 tokenizer (ids < 49152), for vLLM."""
    if (out / "config.json").is_file():
        return out
    deepseek_model(torch.bfloat16, **kw).save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out
