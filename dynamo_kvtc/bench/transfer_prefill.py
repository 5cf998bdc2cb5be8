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
from ..calibration.synthetic import spectrum, synthetic_calibration, synthetic_kv
from ..codec.rope import apply_rope
from ..connector.config import ConnectorConfig, handoff_settings
from ..connector.handoff.server import HandoffServer
from ..errors import TransferError
from ..tiers.config import TierConfig, process_settings
from ..tiers.keys import sequence_hashes
from ..tiers.store import KvtcStore
from ..transport.channel import Limits, RepServer
from ..transport.nixl_io import PeerAgent
from .gpu_model import synthetic_calibration_gpu
from .shapes import Shape

BS = 32
RAW_LIMITS = Limits(max_message=1 << 24, max_str=1 << 16, max_bin=1 << 22, max_array=1 << 20, max_map=16)


def grouped_calibration(shape: Shape, groups: int, *, ratio: float, rank: int, device: str, name: str) -> Calibration:
    """The bench's synthetic calibration: ``groups`` consecutive layer groups (the layout ``calibrate
    --layer-groups`` writes), each with its own basis and plan. On a GPU ``bench gpu``'s
    (:func:`~.gpu_model.synthetic_calibration_gpu`: min(p_g, 10240) components per group, built on the device);
    elsewhere :func:`~dynamo_kvtc.calibration.synthetic.synthetic_calibration` per group (``rank`` components).
    Kept on the host."""
    L, H, D = shape.layers, shape.kv_heads, shape.head_dim
    if groups > 1 and torch.device(device).type == "cuda":
        cal, _ = synthetic_calibration_gpu(name, shape, (ratio,), layer_groups=groups, dev=torch.device(device))
        parts = [
            dataclasses.replace(
                g, k_mean=g.k_mean.cpu(), k_basis=g.k_basis.cpu(), v_mean=g.v_mean.cpu(), v_basis=g.v_basis.cpu()
            )
            for g in cal.groups
        ]
        return Calibration(cal.fingerprint, parts, cal.rope_removed, cal.provenance)  # id: of the content
    bounds = [round(i * L / groups) for i in range(groups + 1)]
    parts = []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        one = synthetic_calibration(
            b - a, H, D, shape.theta, ratios=(ratio,), rank=rank, dp_rows=2048, device=device, seed=i, name=name
        )
        parts.append(dataclasses.replace(one.groups[0], layers=(a, b)))
    if groups <= 1:
        return one
    fp = dataclasses.replace(one.fingerprint, num_layers=L, rotary=tuple(one.fingerprint.rotary[:1]) * L)
    return Calibration(fp, parts, provenance={"synthetic": True, "spectrum": "i^-1.1", "layer_groups": groups})


def grouped_kv(cal: Calibration, tokens: int, device: str = "cpu", seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [L, tokens, H, D] bf16 drawn from each layer group's own basis and spectrum (keys rotated); one group:
    :func:`~dynamo_kvtc.calibration.synthetic.synthetic_kv`."""
    if len(cal.groups) == 1:
        k, v, _ = synthetic_kv(cal, tokens, device=device, seed=seed)
        return k, v
    fp = cal.fingerprint
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where it is used: both processes draw the same
    pos = torch.arange(tokens, device=device)
    out: list[list[torch.Tensor]] = [[], []]
    for grp in cal.groups:
        a, b = grp.layers
        for i, (mean, basis) in enumerate(((grp.k_mean, grp.k_basis), (grp.v_mean, grp.v_basis))):
            r = basis.shape[1]
            z = torch.randn(tokens, r, generator=g, device=device) * spectrum(r).to(device).sqrt()
            x = (z @ basis.to(device).float().t() + mean.to(device)).view(tokens, b - a, fp.num_kv_heads, -1)
            for j in range(b - a):  # keys rotated at their positions, in float32 like synthetic_kv
                t = x[:, j] if i else apply_rope(x[:, j], pos, fp.rotary[a + j])
                out[i].append(t.to(torch.bfloat16))
            del z, x
    return torch.stack(out[0]), torch.stack(out[1])


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
    k, v = grouped_kv(cal, tokens, device=device)
    raw_bytes = 2 * k.numel() * k.element_size()
    tiers = TierConfig(host_bytes=raw_bytes // 2 + (64 << 20), ratio=ratio, min_tokens=0, **process_settings())
    cfg = ConnectorConfig(tiers=tiers, transfer="prefill", **handoff_settings())
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
    raw_agent = PeerAgent(cfg.nixl_backend, "kvtc-bench-raw", progress_us=cfg.nixl_progress_us)
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
