"""The cost model of ``bench cluster``: every per-operation cost read from a measured JSON file, none in code.

Two files:

- a ``bench gpu`` JSON (``docs/results/bench-gpu-h200.json``): one entry of ``configs`` chosen by shape, batch and
  tokens gives the recompute (prefill) time per token (``recompute.ttft_ms``), the host -> GPU restore time per token
  of raw KV (``raw_restore.ttft_ms``) and of kvtc blobs (``kvtc_restore.ttft_ms``), the raw KV bytes per token
  (``raw_bytes``), the effective compression ratio (``raw_bytes / compress.stored_bytes``: measured, not the codec's
  nominal ratio) and the decode step (``decode_step_ms``);
- a ``bench pool`` JSON (its schema: ``results.put_gbps``/``get_gbps`` per kind, ``results.stored_bytes_per_token``):
  the pool's put/get rates and the bytes it stores (and moves) per token, raw and kvtc (sealed).

A missing file or field is a :class:`~dynamo_kvtc.errors.ConfigError` naming it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError

__all__ = ["Costs", "load_costs", "token_bytes"]


@dataclass(frozen=True)
class Costs:
    """Per-token costs (seconds) and sizes (bytes) of one model on one machine, and where they came from."""

    recompute_s: float  # prefill of one token
    raw_restore_s: float  # host memory -> GPU, raw KV, one token
    kvtc_restore_s: float  # host memory -> GPU, kvtc blob decoded, one token
    decode_step_s: float  # one output token
    raw_bytes: float  # raw KV bytes of one token
    kvtc_ratio: float  # effective: raw bytes / stored bytes, measured
    pool_get_gbps: dict[str, float]  # "raw" / "kvtc": bytes the pool delivers per second (opening included for kvtc)
    pool_put_gbps: dict[str, float]
    pool_bytes: dict[str, float]  # "raw" / "kvtc": bytes the pool stores and moves per token
    sources: dict[str, str]  # file paths and the entry used

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _read(path: str | Path, what: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"the {what} cost file {p} does not exist")
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise ConfigError(f"the {what} cost file {p} is not JSON: {e}") from None


def _field(d: dict[str, Any], dotted: str, path: str | Path) -> float:
    """The number at ``a.b.c`` of ``d``; a missing or non-numeric one is an error naming the field and the file."""
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise ConfigError(f"{path}: field {dotted!r} is missing (needed by the bench cluster cost model)")
        cur = cur[part]
    if isinstance(cur, bool) or not isinstance(cur, (int, float)) or not cur > 0:
        raise ConfigError(f"{path}: field {dotted!r} is {cur!r}, a positive number was expected")
    return float(cur)


def _gpu_config(d: dict[str, Any], path: str | Path, shape: str, batch: int, tokens: int) -> dict[str, Any]:
    configs = d.get("configs")
    if not isinstance(configs, list):
        raise ConfigError(f"{path}: field 'configs' is missing (needed by the bench cluster cost model)")
    for c in configs:
        if isinstance(c, dict) and (c.get("shape"), c.get("batch"), c.get("tokens")) == (shape, batch, tokens):
            return c
    have = sorted({f"{c.get('shape')} {c.get('batch')}x{c.get('tokens')}" for c in configs if isinstance(c, dict)})
    raise ConfigError(f"{path}: no config {shape} {batch}x{tokens}; it has {', '.join(have)}")


def load_costs(
    gpu_json: str | Path, pool_json: str | Path, shape: str = "mistral-nemo-12b", batch: int = 2, tokens: int = 16384
) -> Costs:
    """The costs of ``shape`` (its ``batch`` x ``tokens`` entry of the bench gpu file) and of the pool file."""
    g = _read(gpu_json, "bench gpu")
    p = _read(pool_json, "bench pool")
    c = _gpu_config(g, gpu_json, shape, batch, tokens)
    n = batch * tokens
    raw_bytes = _field(c, "raw_bytes", gpu_json) / n
    kvtc_ratio = _field(c, "raw_bytes", gpu_json) / _field(c, "compress.stored_bytes", gpu_json)
    r = "results"
    pool_bytes = {"raw": _field(p, f"{r}.stored_bytes_per_token.raw", pool_json),
                  "kvtc": _field(p, f"{r}.stored_bytes_per_token.kvtc_sealed", pool_json)}  # fmt: skip
    measured_on = p.get(r, {}).get("raw_bytes_per_token", pool_bytes["raw"])
    if abs(measured_on - raw_bytes) > 0.01 * raw_bytes:
        # the pool file measured another model (bench pool runs a small one here): its rates (GB/s) carry over, its
        # bytes per token do not; the simulated model's come from the bench gpu file (raw, and raw over the measured
        # effective ratio; sealing adds 28 bytes per object, nothing per token)
        pool_bytes = {"raw": raw_bytes, "kvtc": raw_bytes / kvtc_ratio}
    get = {"raw": _field(p, f"{r}.get_gbps.raw", pool_json), "kvtc": _field(p, f"{r}.get_gbps.kvtc_sealed", pool_json)}
    put = {"raw": _field(p, f"{r}.put_gbps.raw", pool_json), "kvtc": _field(p, f"{r}.put_gbps.kvtc_sealed", pool_json)}
    if p.get("source") != "tcp-loopback":  # bench pool's rates move stored bytes only: add its seal/open, in series
        get["kvtc"] = 1 / (1 / get["kvtc"] + 1 / _field(p, f"{r}.open_gbps", pool_json))
        put["kvtc"] = 1 / (1 / put["kvtc"] + 1 / _field(p, f"{r}.seal_gbps", pool_json))
    return Costs(
        recompute_s=_field(c, "recompute.ttft_ms", gpu_json) / 1e3 / n,
        raw_restore_s=_field(c, "raw_restore.ttft_ms", gpu_json) / 1e3 / n,
        kvtc_restore_s=_field(c, "kvtc_restore.ttft_ms", gpu_json) / 1e3 / n,
        decode_step_s=_field(c, "decode_step_ms", gpu_json) / 1e3,
        raw_bytes=raw_bytes,
        kvtc_ratio=kvtc_ratio,
        pool_get_gbps=get,
        pool_put_gbps=put,
        pool_bytes=pool_bytes,
        sources={"gpu_json": str(gpu_json), "gpu_config": f"{shape} {batch}x{tokens}", "pool_json": str(pool_json),
                 "pool_bytes": "pool_json" if pool_bytes["raw"] == measured_on else "gpu_json (pool_json measured "
                 f"{measured_on:.0f} raw bytes per token, another model)"},
    )  # fmt: skip


def token_bytes(gpu_json: str | Path, shape: str, batch: int, tokens: int) -> tuple[float, float]:
    """Raw KV bytes per token and kvtc stored bytes per token, as measured in the bench gpu file."""
    c = _gpu_config(_read(gpu_json, "bench gpu"), gpu_json, shape, batch, tokens)
    n = batch * tokens
    return _field(c, "raw_bytes", gpu_json) / n, _field(c, "compress.stored_bytes", gpu_json) / n
