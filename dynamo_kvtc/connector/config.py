"""Connector configuration: ``kv_connector_extra_config`` keys, each with a ``DYN_KVTC_*`` environment variable.

The extra config wins over the environment; both are validated here with errors that name the key. Tier sizes and
policy are the :class:`~dynamo_kvtc.tiers.config.TierConfig` fields; the rest belong to the connector:

| key | variable | meaning | default |
|---|---|---|---|
| ``calibration`` | ``DYN_KVTC_CALIBRATION`` | calibration dir (TP: a ``rank<r>`` folder per rank) | the shipped one |
| ``cpu_cache_gb`` | ``DYN_KVTC_CPU_CACHE_GB`` | compressed host tier size | 1 |
| ``disk_cache_gb`` | ``DYN_KVTC_DISK_CACHE_GB`` | compressed disk tier size (0 = none) | 0 |
| ``disk_cache_dir`` | ``DYN_KVTC_DISK_CACHE_DIR`` | disk tier directory (owned by the store, 0700) | none |
| ``ratio`` | ``DYN_KVTC_RATIO`` | default compression ratio (a plan of the calibration) | 16 |
| ``max_ratio`` | ``DYN_KVTC_MAX_RATIO`` | accuracy floor: never compress harder, even under pressure | ratio |
| ``min_tokens`` | ``DYN_KVTC_MIN_TOKENS`` | sequences shorter than this bypass the tiers | 64 |
| ``offload_min_frequency`` | ``DYN_KVTC_OFFLOAD_MIN_FREQUENCY`` | offload a block once seen this often | 1 |
| ``window`` | ``DYN_KVTC_WINDOW`` | most recent tokens of a saved prompt kept raw | 128 |
| ``sinks`` | ``DYN_KVTC_SINKS`` | first tokens of a sequence kept in fp8 (attention sinks) | 4 |
| ``disk_fsync`` | ``DYN_KVTC_DISK_FSYNC`` | fsync committed disk blobs | true |
| ``flush_tokens`` | ``DYN_KVTC_FLUSH_TOKENS`` | while decoding, offload once this many new tokens filled blocks | 256 |
| ``load_timeout_s`` | ``DYN_KVTC_LOAD_TIMEOUT_S`` | longest wait for one layer's restore before falling back | 30 |
| ``load_failure_policy`` | ``DYN_KVTC_LOAD_FAILURE_POLICY`` | vLLM's kv_load_failure_policy | recompute |
| ``metrics_port`` | ``DYN_KVTC_METRICS_PORT`` | Prometheus endpoint on the worker (rank 0), 0 = any free port | off |
| ``publish_events`` | ``DYN_KVTC_PUBLISH_EVENTS`` | tier events into vLLM's KV event stream (router) | true |
| ``transfer`` | ``DYN_KVTC_TRANSFER`` | compressed prefill→decode transfer: ``prefill`` or ``decode`` | off |
| ``nixl_backend`` | ``DYN_KVTC_NIXL_BACKEND`` | NIXL backend of the transfer | ``UCX`` |
| ``transfer_host`` | ``DYN_KVTC_TRANSFER_HOST`` | address the prefill side serves blobs on | 127.0.0.1 |
| ``transfer_port`` | ``DYN_KVTC_TRANSFER_PORT`` | port of the prefill side's control channel (0 = any) | 0 |
| ``transfer_timeout_s`` | ``DYN_KVTC_TRANSFER_TIMEOUT_S`` | control-channel and NIXL deadline | 10 |
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..tiers.config import GB, TierConfig

# key -> (TierConfig field or None, kind)
TIER_KEYS = {
    "cpu_cache_gb": ("host_bytes", "gb"),
    "disk_cache_gb": ("disk_bytes", "gb"),
    "disk_cache_dir": ("disk_dir", "path"),
    "ratio": ("ratio", "float"),
    "max_ratio": ("max_ratio", "float"),
    "min_tokens": ("min_tokens", "int"),
    "offload_min_frequency": ("min_frequency", "int"),
    "disk_fsync": ("fsync", "bool"),
    "window": ("window", "int"),
    "sinks": ("sinks", "int"),
}
OWN_KEYS = {
    "calibration": "path",
    "flush_tokens": "int",
    "load_timeout_s": "float",
    "load_failure_policy": "str",
    "metrics_port": "int",
    "publish_events": "bool",
    "transfer": "str",
    "nixl_backend": "str",
    "transfer_host": "str",
    "transfer_port": "int",
    "transfer_timeout_s": "float",
}
TRANSFER_MODES = ("", "prefill", "decode")


def _parse(key: str, raw: Any, kind: str) -> Any:
    try:
        if kind in ("gb", "float"):
            if isinstance(raw, bool):
                raise ValueError("expected a number")
            v = float(raw)
            if v < 0:
                raise ValueError("must be >= 0")
            return int(v * GB) if kind == "gb" else v
        if kind == "int":
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError("expected an integer")
            return int(raw)
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s not in ("0", "1", "true", "false", "yes", "no"):
                raise ValueError("expected true/false")
            return s in ("1", "true", "yes")
        if kind == "path":
            return Path(str(raw)).expanduser()
        return str(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"KvtcConnector setting {key}={raw!r} is invalid: {e}") from None


@dataclass(frozen=True)
class ConnectorConfig:
    tiers: TierConfig = field(default_factory=TierConfig)
    calibration: Path | None = None
    flush_tokens: int = 256
    load_timeout_s: float = 30.0
    load_failure_policy: str = "recompute"
    metrics_port: int | None = None
    publish_events: bool = True
    transfer: str = ""
    nixl_backend: str = "UCX"
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0
    transfer_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.flush_tokens < 1:
            raise ConfigError(f"flush_tokens must be >= 1, got {self.flush_tokens}")
        if self.load_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise ConfigError("load_timeout_s and transfer_timeout_s must be > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port {self.metrics_port} is not a port number")
        if not 0 <= self.transfer_port < 65536:
            raise ConfigError(f"transfer_port {self.transfer_port} is not a port number")
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(f"load_failure_policy must be 'recompute' or 'fail', got {self.load_failure_policy!r}")
        if self.transfer not in TRANSFER_MODES:
            raise ConfigError(f"transfer must be one of {TRANSFER_MODES[1:]} (or unset), got {self.transfer!r}")

    @classmethod
    def from_sources(cls, extra: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> ConnectorConfig:
        """Build from ``kv_connector_extra_config`` (wins) and ``DYN_KVTC_*`` variables."""
        extra = dict(extra or {})
        env = dict(os.environ if env is None else env)
        known = set(TIER_KEYS) | set(OWN_KEYS)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config keys for KvtcConnector: {unknown}; known: {sorted(known)}"
            )
        values: dict[str, tuple[str, Any]] = {}
        for key in known:
            var = "DYN_KVTC_" + key.upper()
            if key in extra and extra[key] is not None:
                values[key] = (key, extra[key])
            elif env.get(var, "") != "":
                values[key] = (var, env[var])
        tier_kw = {}
        for key, (fname, kind) in TIER_KEYS.items():
            if key in values:
                tier_kw[fname] = _parse(values[key][0], values[key][1], kind)
        own = {key: _parse(values[key][0], values[key][1], kind) for key, kind in OWN_KEYS.items() if key in values}
        # variables only the tier config knows (page size, NIXL deadline) still apply
        passthrough = ("DYN_KVTC_PAGE_BYTES", "DYN_KVTC_NIXL_TIMEOUT_S")
        tiers = TierConfig.from_env({k: v for k, v in env.items() if k in passthrough}, **tier_kw)
        return cls(tiers=tiers, **own)
