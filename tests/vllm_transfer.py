"""Compressed prefill->decode transfer with two real vLLM engines in two processes (tests/test_connector_vllm.py).

    python tests/vllm_transfer.py prefill WORKDIR PORT
    python tests/vllm_transfer.py decode WORKDIR

The prefill process computes the prompt (max_tokens=1, ``do_remote_decode``), keeps serving its compressed blobs over
NIXL (UCX) until the decode process writes WORKDIR/done. The decode process pulls them, restores them layer by layer,
generates, and compares with a full recompute of the same prompt; it also asks a peer that is not there, fetches a
second prompt whose blobs the prefill side corrupted after storing them (the decode side must refuse them and
recompute), and knocks with the wrong shared secret (both processes hold DYN_KVTC_TRANSFER_SECRET; the prefill side
must refuse and count it).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

from replies import greedy, top_of  # tests/replies.py (this script's folder is first on sys.path)

from dynamo_kvtc.calibration.catalog import find_calibration
from dynamo_kvtc.calibration.data import heldout_texts
from dynamo_kvtc.calibration.models import resolve_model
from dynamo_kvtc.connector.config import ConnectorConfig
from dynamo_kvtc.connector.handoff.client import HandoffClient
from dynamo_kvtc.demo.engine import EngineConfig, _vllm, build_engine, chat, worker_of
from dynamo_kvtc.errors import TransferError

MODEL = "smollm2-135m-instruct"


def messages(start: int = 1000) -> list[dict]:
    doc = " ".join("\n\n".join(heldout_texts()).split()[start : start + 700])
    return [{"role": "user", "content": f"Read this essay.\n\n{doc}\n\nWhat is its main point?"}]


def _engine(extra: dict):
    cal = find_calibration(MODEL)
    return build_engine(EngineConfig(model=str(resolve_model(MODEL)), extra={"calibration": str(cal), **extra}))


def prefill(work: Path, port: int) -> None:
    _, _, SamplingParams, _ = _vllm()
    llm = _engine({"transfer": "prefill", "transfer_port": port})
    w = worker_of(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    t = time.perf_counter()
    out = llm.chat(messages(), sp, use_tqdm=False)[0]
    prefill_s = time.perf_counter() - t
    w.wait_idle()
    before = set(w.store.host.ids())
    out2 = llm.chat(messages(5000), sp, use_tqdm=False)[0]  # a second prompt, whose blobs go bad while stored
    w.wait_idle()
    corrupted = 0
    for blob_id in set(w.store.host.ids()) - before:
        start, length = w.store.host.extents(blob_id)[-1]  # the last page: inside the coded sections
        w.store.host.arena[start + length // 2] ^= 0x5A
        corrupted += 1
    info = {
        "params": out.kv_transfer_params,
        "params_corrupt": out2.kv_transfer_params,
        "corrupted_blobs": corrupted,
        "prompt_tokens": len(out.prompt_token_ids),
        "prefill_s": prefill_s,
    }
    (work / "prefill.json").write_text(json.dumps(info))
    deadline = time.monotonic() + 600
    while not (work / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    srv = w.handoff_server
    (work / "prefill-stats.json").write_text(
        json.dumps(
            {
                "served": srv.served,
                "refused": srv.refused,
                "auth_refused": srv.auth_refused,
                "leases_open": srv.open_leases,
            }
        )
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replies(case: str, out, ref) -> dict:
    """A recomputed reply and its reference: texts, token ids and each step's top logprobs (tests/replies.py)."""
    a, b = out.outputs[0], ref.outputs[0]
    return {
        f"{case}_reply": a.text,
        f"{case}_reference_reply": b.text,
        f"{case}_tokens": list(a.token_ids),
        f"{case}_reference_tokens": list(b.token_ids),
        f"{case}_top": top_of(a),
        f"{case}_reference_top": top_of(b),
    }


def decode(work: Path) -> None:
    _, _, SamplingParams, _ = _vllm()
    llm = _engine({"transfer": "decode", "transfer_timeout_s": 3})
    w = worker_of(llm)
    deadline = time.monotonic() + 600
    while not (work / "prefill.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    pre = json.loads((work / "prefill.json").read_text())
    params = dict(pre["params"])
    sp = SamplingParams(temperature=0.0, max_tokens=16, extra_args={"kv_transfer_params": dict(params)})
    t = time.perf_counter()
    out = llm.chat(messages(), sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t
    restore = w.restores[-1] if w.restores else None
    bytes_moved = w.peer.bytes_moved  # this fetch's (later fetches add theirs)
    ref, ref_wall = chat(llm, messages(), 16, recompute=True)
    # a prefill peer that is gone (another prompt, so this side's tier cannot help): the fetch fails, the decode
    # engine recomputes the prompt
    gone = {**params, "kvtc_port": _free_port()}
    n_fail = w.stats["fallback_load_error"]
    sp_gone = greedy(16, extra_args={"kv_transfer_params": gone})
    out_gone = llm.chat(messages(3000), sp_gone, use_tqdm=False)[0]
    ref_gone = llm.chat(messages(3000), greedy(16, recompute=True), use_tqdm=False)[0]
    gone_fallbacks = w.stats["fallback_load_error"] - n_fail
    # blobs that went bad on the prefill side: fetched, refused by the decoder before any layer, recomputed
    n_fail = w.stats["fallback_load_error"]
    sp_bad = greedy(16, extra_args={"kv_transfer_params": pre["params_corrupt"]})
    out_bad = llm.chat(messages(5000), sp_bad, use_tqdm=False)[0]
    ref_bad = llm.chat(messages(5000), greedy(16, recompute=True), use_tqdm=False)[0]
    bad_fallbacks = w.stats["fallback_load_error"] - n_fail
    # the wrong shared secret: refused at the CURVE handshake, before the prefill side sees a request
    secret = work / "wrong-secret"
    secret.write_text("not-the-deployment-secret-0123")
    intruder = HandoffClient(ConnectorConfig(transfer="decode", transfer_timeout_s=3, transfer_secret_file=secret))
    try:
        intruder.fetch(params["kvtc_host"], params["kvtc_port"], w.restores[0]["hashes"] if w.restores else [1])
        wrong_secret_refused = False
    except TransferError:
        wrong_secret_refused = True
    intruder.close()
    result = {
        "params": params,
        "prompt_tokens": len(out.prompt_token_ids),
        "restored_tokens": int(out.num_cached_tokens or 0),
        "restore": restore,
        "bytes_moved": bytes_moved,
        "tokens": list(out.outputs[0].token_ids),
        "reference_tokens": list(ref.outputs[0].token_ids),
        "reply": out.outputs[0].text,
        "reference_reply": ref.outputs[0].text,
        "wall_s": wall,
        "reference_wall_s": ref_wall,
        "prefill_s": pre["prefill_s"],
        **_replies("gone", out_gone, ref_gone),
        "gone_fallbacks": gone_fallbacks,
        **_replies("corrupt", out_bad, ref_bad),
        "corrupt_fallbacks": bad_fallbacks,
        "corrupted_blobs": pre["corrupted_blobs"],
        "wrong_secret_refused": wrong_secret_refused,
        "stats": dict(w.stats),
        "kept_in_host_tier": w.store.snapshot()["host_blocks"],
    }
    (work / "decode.json").write_text(json.dumps(result))
    (work / "done").write_text("1")


if __name__ == "__main__":
    role, work = sys.argv[1], Path(sys.argv[2])
    if role == "prefill":
        prefill(work, int(sys.argv[3]))
    else:
        decode(work)
