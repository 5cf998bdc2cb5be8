"""Tier configuration: dataclass fields, ``DYN_KVTC_*`` environment variables, validation with clear errors.

| variable | field | default |
|---|---|---|
| ``DYN_KVTC_CPU_CACHE_GB`` | host_bytes | 1 GiB |
| ``DYN_KVTC_DISK_CACHE_GB`` | disk_bytes | 0 (no disk tier) |
| ``DYN_KVTC_DISK_CACHE_DIR`` | disk_dir | none |
| ``DYN_KVTC_RATIO`` | ratio | 16 |
| ``DYN_KVTC_MAX_RATIO`` | max_ratio (accuracy floor: never compress harder) | ratio |
| ``DYN_KVTC_OFFLOAD_MIN_FREQUENCY`` | min_frequency (offload a block once seen this often) | 1 |
| ``DYN_KVTC_MIN_TOKENS`` | min_tokens (shorter sequences bypass the tier) | 64 |
| ``DYN_KVTC_DISK_FSYNC`` | fsync (durability of committed disk blobs) | 1 |
| ``DYN_KVTC_PAGE_BYTES`` | page_bytes (host-tier page, a power of two >= 512) | 16384 |
| ``DYN_KVTC_NIXL_TIMEOUT_S`` | nixl_timeout_s (deadline of one disk-tier NIXL transfer) | 30 |

Every field is checked when the config is built (type, range, finiteness); a bad value raises
:class:`~dynamo_kvtc.errors.ConfigError` naming the field (or the environment variable it came from).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError

GB = 1 << 30

ENV = {
    "DYN_KVTC_CPU_CACHE_GB": ("host_bytes", "gb"),
    "DYN_KVTC_DISK_CACHE_GB": ("disk_bytes", "gb"),
    "DYN_KVTC_DISK_CACHE_DIR": ("disk_dir", "path"),
    "DYN_KVTC_RATIO": ("ratio", "float"),
    "DYN_KVTC_MAX_RATIO": ("max_ratio", "float"),
    "DYN_KVTC_OFFLOAD_MIN_FREQUENCY": ("min_frequency", "int"),
    "DYN_KVTC_MIN_TOKENS": ("min_tokens", "int"),
    "DYN_KVTC_DISK_FSYNC": ("fsync", "bool"),
    "DYN_KVTC_PAGE_BYTES": ("page_bytes", "int"),
    "DYN_KVTC_NIXL_TIMEOUT_S": ("nixl_timeout_s", "float"),
}
_INTS = ("host_bytes", "disk_bytes", "min_frequency", "min_tokens", "page_bytes", "window", "sinks")
_FLOATS = ("ratio", "max_ratio", "pressure_high", "nixl_timeout_s")


@dataclass(frozen=True)
class TierConfig:
    host_bytes: int = GB
    disk_bytes: int = 0
    disk_dir: Path | None = None
    ratio: float = 16.0
    max_ratio: float | None = None  # the accuracy floor: the policy never picks a higher ratio
    pressure_high: float = 0.9  # host-tier fill above which the policy moves to a higher ratio
    min_frequency: int = 1
    min_tokens: int = 64
    fsync: bool = True
    page_bytes: int = 16384
    window: int = 128  # tokens of a sequence's tail blob kept raw
    sinks: int = 4
    nixl_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in _INTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"tier setting {name} must be an integer, got {v!r}")
        for name in _FLOATS:
            v = getattr(self, name)
            if v is None and name == "max_ratio":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"tier setting {name} must be a finite number, got {v!r}")
        if not isinstance(self.fsync, bool):
            raise ConfigError(f"tier setting fsync must be true or false, got {self.fsync!r}")
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)) or str(self.disk_dir) == "":
                raise ConfigError(f"tier setting disk_dir must be a path, got {self.disk_dir!r}")
            object.__setattr__(self, "disk_dir", Path(self.disk_dir))
        if self.nixl_timeout_s <= 0:
            raise ConfigError(f"nixl_timeout_s must be > 0, got {self.nixl_timeout_s}")
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ConfigError("tier capacities must be >= 0")
        if self.disk_bytes and self.disk_dir is None:
            raise ConfigError("DYN_KVTC_DISK_CACHE_GB is set but DYN_KVTC_DISK_CACHE_DIR is not")
        if self.ratio <= 0 or (self.max_ratio is not None and self.max_ratio < self.ratio):
            raise ConfigError(f"ratio {self.ratio} must be positive and <= max_ratio {self.max_ratio}")
        if not 0 < self.pressure_high <= 1:
            raise ConfigError("pressure_high must be in (0, 1]")
        if self.min_frequency < 1 or self.min_tokens < 0:
            raise ConfigError("min_frequency must be >= 1 and min_tokens >= 0")
        if self.window < 0 or self.sinks < 0:
            raise ConfigError(f"window ({self.window}) and sinks ({self.sinks}) must be >= 0")
        if self.page_bytes < 512 or self.page_bytes & (self.page_bytes - 1):
            raise ConfigError(f"page_bytes must be a power of two >= 512, got {self.page_bytes}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> TierConfig:
        env = dict(os.environ if env is None else env)
        kw: dict[str, Any] = {}
        for var, (name, kind) in ENV.items():
            if var not in env or env[var] == "":
                continue
            raw = env[var]
            try:
                if kind == "gb":
                    v = float(raw)
                    if v < 0:
                        raise ValueError("negative")
                    if not math.isfinite(v):
                        raise ValueError("not a finite number")
                    kw[name] = int(v * GB)
                elif kind == "float":
                    kw[name] = float(raw)
                    if not math.isfinite(kw[name]):
                        raise ValueError("not a finite number")
                elif kind == "int":
                    kw[name] = int(raw)
                elif kind == "bool":
                    if raw.lower() not in ("0", "1", "true", "false", "yes", "no"):
                        raise ValueError("expected 0/1/true/false")
                    kw[name] = raw.lower() in ("1", "true", "yes")
                else:
                    kw[name] = Path(raw)
            except ValueError as e:
                raise ConfigError(f"{var}={raw!r} is invalid: {e}") from None
        known = {f.name for f in fields(cls)}
        bad = set(overrides) - known
        if bad:
            raise ConfigError(f"unknown tier settings: {sorted(bad)}")
        try:
            return cls(**{**kw, **overrides})
        except ConfigError as e:  # name the variable a bad value came from
            src = [var for var, (name, _) in ENV.items() if name in kw and name not in overrides and name in str(e)]
            raise ConfigError(f"{e} (from {', '.join(src)})" if src else str(e)) from None

    def with_(self, **kw: Any) -> TierConfig:
        return replace(self, **kw)
