"""The prefill process of ``dynamo-kvtc bench transfer`` (started by :mod:`.transfer`, one per shape and prompt).

It holds a synthetic prompt's KV on its device, encoded into its host tier (served compressed by the connector's
:class:`~dynamo_kvtc.connector.handoff.server.HandoffServer`: staged in a NIXL-registered arena, device memory on a
GPU) and raw in device memory (served as vLLM's NixlConnector does: the peer READs each layer's K and V in place).
It writes its ports and sizes to a file and serves until its stdin closes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch

from ..calibration.artifact import Calibration
from ..calibration.synthetic import synthetic_kv
from ..connector.config import ConnectorConfig
from ..connector.handoff.server import HandoffServer
from ..errors import TransferError
from ..tiers.channel import Limits, RepServer
from ..tiers.config import TierConfig
from ..tiers.keys import sequence_hashes
from ..tiers.nixl_io import PeerAgent
from ..tiers.store import KvtcStore

BS = 32
RAW_LIMITS = Limits(max_message=1 << 24, max_str=1 << 16, max_bin=1 << 22, max_array=1 << 20, max_map=16)


def prompt_tokens(n: int) -> list[int]:
    return [(i * 7919) % 32000 for i in range(n)]


def raw_descs(k: torch.Tensor, v: torch.Tensor) -> list[list[int]]:
    """``[address, length, device]`` of each layer's K, then each layer's V (NixlConnector-style, per layer)."""
    dev = (k.device.index or 0) if k.is_cuda else 0
    out = []
    for t in (k, v):
        per = t[0].numel() * t.element_size()
        out += [[t.data_ptr() + i * per, per, dev] for i in range(t.shape[0])]
    return out


def serve(cal_path: str, tokens: int, device: str, ratio: float, port_file: str) -> None:
    """Encode the prompt into the host tier, serve blobs and raw KV until stdin closes."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    cal = Calibration.load(cal_path)
    k, v, _ = synthetic_kv(cal, tokens, device=device)
    raw_bytes = 2 * k.numel() * k.element_size()
    cfg = ConnectorConfig(
        tiers=TierConfig(host_bytes=raw_bytes // 2 + (64 << 20), ratio=ratio, min_tokens=0), transfer="prefill"
    )
    store = KvtcStore(cal, cfg.tiers, device=dev, block_size=BS)
    ids = prompt_tokens(tokens)
    t = time.perf_counter()
    res = store.submit_offload(sequence_hashes(ids, BS), ids, keys=k, values=v, tail=True).result()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    encode_s = time.perf_counter() - t
    if res.stored_blocks != tokens // BS:
        raise TransferError(f"prefill side stored {res.stored_blocks} of {tokens // BS} blocks: {res.skipped}")
    staging_mb = max(cfg.transfer_staging_mb, 2 * (res.stored_bytes >> 20) + 64)  # room for two fetches in flight
    server = HandoffServer(dataclasses.replace(cfg, transfer_staging_mb=staging_mb), store)
    raw_agent = PeerAgent(cfg.nixl_backend, "kvtc-bench-raw")
    regs = [raw_agent.agent.register_memory(k), raw_agent.agent.register_memory(v)]
    mem = "VRAM" if dev.type == "cuda" else "DRAM"

    def raw_reply(msg: dict) -> dict:  # NixlConnector-style: the peer reads K and V in place
        with raw_agent.lock:
            raw_agent.add_remote(msg["agent"], msg["agent_md"])
        return {"agent": raw_agent.name, "agent_md": raw_agent.metadata(), "mem": mem, "descs": raw_descs(k, v)}

    raw = RepServer("tcp://127.0.0.1", raw_reply, RAW_LIMITS, name="kvtc-bench-raw")
    Path(port_file).write_text(
        json.dumps(
            {
                "port": server.port,
                "raw_port": raw.port,
                "encode_s": encode_s,
                "stored_bytes": res.stored_bytes,
                "raw_bytes": raw_bytes,
                "staging": server.arena("VRAM" if dev.type == "cuda" else "DRAM").mem,
            }
        )
    )
    sys.stdin.read()  # the decode side closes our stdin when done
    raw.close()
    server.close()
    for r in regs:
        raw_agent.agent.deregister_memory(r)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5])
