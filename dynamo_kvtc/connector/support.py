"""Which models the connector serves: the support table (docs/models.md mirrors it) and the one decision.

:data:`FAMILIES` is the table: architecture family, KV dtype, attention kind, status, calibration command.
:func:`decide` maps an engine's model config, KV layout, ``--kv-cache-dtype`` and TP size to its row, or raises
:class:`Unsupported` with one line saying why; the worker then disables itself (every request recomputes, metrics
still served with ``disabled_reason="model"``). ``python -m dynamo_kvtc.connector.support --write docs/models.md``
rewrites the table in the docs; a test checks that they agree.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..calibration.mla import is_mla, text_config
from ..calibration.models import layer_windows
from ..codec.rope import RotaryConfig
from ..errors import KvtcError, TierError

SERVED_MEASURED = "served, accuracy measured"
SERVED_UNMEASURED = "served, accuracy unmeasured"
REFUSED = "refused"


class Unsupported(TierError):
    """A model, KV layout or cache dtype outside the support table."""


@dataclass(frozen=True)
class Family:
    key: str
    family: str  # architecture family
    kv_dtype: str
    attention: str
    status: str  # starts with SERVED_MEASURED, SERVED_UNMEASURED or REFUSED
    note: str  # where the accuracy is, or the reason for a refusal
    calibrate: str  # the calibration command ("-" for a refused family)

    @property
    def served(self) -> bool:
        return not self.status.startswith(REFUSED)


CAL = "dynamo-kvtc calibrate --model MODEL_DIR"
FAMILIES: tuple[Family, ...] = (
    Family(
        "dense",
        "Llama, Mistral, Qwen2/Qwen3, SmolLM2 (dense decoders)",
        "bf16, fp16, fp32",
        "full attention (MHA, GQA, MQA) with RoPE",
        SERVED_MEASURED,
        "SmolLM2-135M at 16x: dNLL +0.51%, KL 0.008, passkey 10/12 (full preset, docs/accuracy.md)",
        CAL,
    ),
    Family(
        "sliding",
        "Gemma-3, gpt-oss (sliding-window hybrids)",
        "bf16, fp16, fp32",
        "sliding-window layers interleaved with full layers",
        SERVED_MEASURED,
        "Gemma-3-270M at 2-8K, sliding layers window-only, full layers' V int4: 5.3x stored (about 6x against a "
        "raw tier that also keeps only the window), passkey 7/9 = vanilla, KL 0.0029; 16x is out of reach "
        "(docs/accuracy.md)",
        CAL + " --no-shared-budget --full-attention-v int4 --full-attention-k 4",
    ),
    Family(
        "fp8",
        "any served family with --kv-cache-dtype fp8",
        "fp8 (e4m3, e5m2)",
        "as the family's",
        SERVED_MEASURED,
        "read through vLLM's per-layer k/v scales, restored as FP8 with them; SmolLM2, full preset, against FP8 "
        "vanilla: 18x of the FP8 cache dNLL +1.18%, 9x +0.61%, passkey 10/12 at both (FP8 vanilla 11/12); the same "
        "loss as the same plans with bf16 input (docs/accuracy.md)",
        CAL,
    ),
    Family(
        "mla",
        "DeepSeek-V2/V3/R1, Kimi-K2 (multi-head latent attention)",
        "bf16, fp16, fp32",
        "MLA: one latent + RoPE key row per token (kv_lora_rank + qk_rope_head_dim)",
        SERVED_UNMEASURED,
        "tested end to end on a random-initialised DeepSeek-V3-shaped model only; tensor parallelism 1",
        CAL,
    ),
    Family(
        "sparse_mla",
        "DeepSeek-V3.2, DeepSeek-V4 (sparse MLA with an indexer)",
        "any",
        "sparse MLA",
        REFUSED,
        "its FP8 latent cache and indexer keys have no layout here",
        "-",
    ),
    Family(
        "hybrid_state",
        "Mamba, Jamba, Qwen3-Next, Nemotron-H, Granite-4 (SSM / linear-attention hybrids)",
        "any",
        "recurrent state layers",
        REFUSED,
        "a recurrent state is not a per-token KV cache",
        "-",
    ),
    Family(
        "no_rope",
        "GPT-2, OPT, Bloom, MPT, ALiBi Falcon (learned or ALiBi positions)",
        "any",
        "full attention without RoPE",
        REFUSED,
        "kvtc is calibrated on pre-RoPE keys; a model without RoPE is not supported yet",
        "-",
    ),
    Family(
        "rope",
        "models with dynamic-NTK or longrope RoPE (Phi-3 long, ...)",
        "any",
        "full attention",
        REFUSED,
        "that RoPE depends on the sequence length, so it cannot be undone from positions alone",
        "-",
    ),
)
BY_KEY = {f.key: f for f in FAMILIES}

STATE_TYPES = {"mamba", "mamba2", "jamba", "qwen3_next", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba",
               "zamba2", "bamba", "plamo2", "lfm2", "minimax", "minimax_m1", "kimi_linear"}  # fmt: skip
ATTENTION_TYPES = {"full_attention", "sliding_attention"}


def _refuse(key: str, detail: str) -> Unsupported:
    f = BY_KEY[key]
    return Unsupported(f"{detail}: {f.family} is {f.status} ({f.note}); see docs/models.md")


def _has_rope(c: Any) -> bool:
    if getattr(c, "alibi", False) or getattr(c, "position_embedding_type", "rotary") not in ("rotary", "rope"):
        return False
    return any(getattr(c, a, None) is not None for a in ("rope_parameters", "rope_scaling", "rope_theta"))


def decide(config: Any, tp_size: int = 1, cache_dtype: str | None = None) -> Family:
    """The support table's row for this model, or :class:`Unsupported` with one line. ``config``: the model's
    Hugging Face config (None: a dense model, left to the calibration check). Judged from the config alone, before
    any cache tensor is touched (a hybrid model's state layers are not tensors). ``cache_dtype`` (vLLM's
    ``--kv-cache-dtype``): the FP8 row's verdict; None leaves the dtype to the worker's dtype check."""
    c = text_config(config) if config is not None else None
    model_type = str(getattr(c, "model_type", "") or "")
    types = set(getattr(c, "layer_types", None) or ())
    if c is not None and (getattr(c, "index_topk", None) or model_type in ("deepseek_v32", "deepseek_v4")):
        raise _refuse("sparse_mla", f"model type {model_type or 'with index_topk'}")
    if model_type in STATE_TYPES or types - ATTENTION_TYPES or getattr(c, "layers_block_type", None):
        raise _refuse("hybrid_state", f"model type {model_type} (layer types {sorted(types) or 'mixed'})")
    if c is not None and not _has_rope(c):
        raise _refuse("no_rope", f"model type {model_type or 'without a RoPE configuration'}")
    family = BY_KEY["dense"]
    if c is not None and is_mla(c):
        if tp_size != 1:
            raise Unsupported(f"MLA under tensor parallelism ({tp_size} ranks) is not served yet; see docs/models.md")
        family = BY_KEY["mla"]
    elif c is not None and layer_windows(c):
        family = BY_KEY["sliding"]
    if c is not None and family.key != "mla":
        try:
            for i in range(int(c.num_hidden_layers)):
                RotaryConfig.from_hf_config(c, layer=i)
        except (KvtcError, AttributeError, KeyError, TypeError, ValueError) as e:
            raise _refuse("rope", str(e).split(";")[0]) from e
    if cache_dtype is not None and str(cache_dtype).startswith("fp8") and not BY_KEY["fp8"].served:
        raise _refuse("fp8", f"--kv-cache-dtype {cache_dtype}")
    if not family.served:
        raise _refuse(family.key, model_type or family.key)
    return family


# ------------------------------------------------------------------------------------------------ the docs' table
BEGIN, END = "<!-- support-table: begin -->", "<!-- support-table: end -->"


def render_table() -> str:
    rows = ["| Family | KV dtype | Attention | Status | Calibration |", "|---|---|---|---|---|"]
    for f in FAMILIES:
        cal = f"`{f.calibrate}`" if f.calibrate != "-" else "-"
        rows.append(f"| {f.family} | {f.kv_dtype} | {f.attention} | **{f.status}**: {f.note} | {cal} |")
    return "\n".join([BEGIN, *rows, END])


def rewrite(doc: str) -> str:
    """``doc`` with the text between the table markers replaced by :func:`render_table`."""
    a, b = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:a] + render_table() + doc[b:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="print or rewrite the model support table of docs/models.md")
    p.add_argument("--write", type=Path, help="rewrite the table inside this markdown file")
    a = p.parse_args(argv)
    if a.write is None:
        print(render_table())
        return 0
    a.write.write_text(rewrite(a.write.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
