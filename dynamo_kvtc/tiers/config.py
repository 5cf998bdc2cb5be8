"""Tier configuration: the :class:`TierConfig` dataclass, its validation, and reading it from the environment.

Its ``DYN_KVTC_*`` variables, types, bounds and defaults are the ``tier`` rows of :data:`dynamo_kvtc.settings.SETTINGS`
(the reference table is docs/configuration.md, generated from it); :meth:`TierConfig.from_env` parses through that
table. Every field is checked when the config is built (type, range, finiteness); a bad value raises
:class:`~dynamo_kvtc.errors.ConfigError` naming the field (or the environment variable it came from).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .. import settings
from ..codec.options import CodecOptions
from ..errors import ConfigError
from ..settings import GB

_INTS = ("host_bytes", "disk_bytes", "min_frequency", "min_tokens", "page_bytes", "window", "sinks", "disk_min_uses")
_FLOATS = ("ratio", "max_ratio", "pressure_high", "nixl_timeout_s")
_d = settings.default  # field defaults are the table's
RATIO_POLICIES = ("fixed", "raw_first", "raw")

__all__ = ["GB", "TierConfig", "codec_options"]


@dataclass(frozen=True)
class TierConfig:
    """What the compressed tiers may hold and how they choose a ratio. Owns validation of its own fields; never
    reads the environment except in :meth:`from_env`."""

    host_bytes: int = _d("cpu_cache_gb")
    disk_bytes: int = _d("disk_cache_gb")
    disk_dir: Path | None = _d("disk_cache_dir")
    ratio: float = _d("ratio")
    max_ratio: float | None = _d("max_ratio")  # the accuracy floor: the policy never picks a higher ratio
    pressure_high: float = 0.9  # host-tier fill above which the policy moves to a higher ratio
    min_frequency: int = _d("offload_min_frequency")
    min_tokens: int = _d("min_tokens")
    fsync: bool = _d("disk_fsync")
    disk_min_uses: int = _d("disk_min_uses")  # disk admission: uses before a host eviction is written to disk
    page_bytes: int = _d("page_bytes")
    window: int = _d("window")  # tokens of a sequence's tail blob kept raw
    sinks: int = _d("sinks")
    nixl_timeout_s: float = _d("nixl_timeout_s")
    ratio_policy: str = _d("ratio_policy")  # fixed | raw_first (store raw while the host tier has room) | raw
    codec: CodecOptions = field(default_factory=CodecOptions)  # how the codec runs (process-wide settings)

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
        if self.disk_min_uses < 1:
            raise ConfigError(f"disk_min_uses must be >= 1, got {self.disk_min_uses}")
        if self.window < 0 or self.sinks < 0:
            raise ConfigError(f"window ({self.window}) and sinks ({self.sinks}) must be >= 0")
        if self.ratio_policy not in RATIO_POLICIES:
            raise ConfigError(f"ratio_policy must be one of {', '.join(RATIO_POLICIES)}, got {self.ratio_policy!r}")
        if self.page_bytes < 512 or self.page_bytes & (self.page_bytes - 1):
            raise ConfigError(f"page_bytes must be a power of two >= 512, got {self.page_bytes}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> TierConfig:
        """The tier settings from ``DYN_KVTC_*`` variables (``os.environ`` when ``env`` is None), then ``overrides``
        (field names) on top."""
        known = {f.name for f in fields(cls)}
        bad = set(overrides) - known
        if bad:
            raise ConfigError(f"unknown tier settings: {sorted(bad)}")
        kw = settings.resolve("tier", None, env)
        kw["codec"] = codec_options(env)
        try:
            return cls(**{**kw, **overrides})
        except ConfigError as e:  # name the variable a bad value came from
            origins = {f: o for f, o in settings.sources("tier", None, env).items() if f not in overrides}
            raise settings.blame(e, origins) from None

    def with_(self, **kw: Any) -> TierConfig:
        return replace(self, **kw)


def codec_options(env: Mapping[str, str] | None = None) -> CodecOptions:
    """The process-wide codec settings (``DYN_KVTC_FUSED``, ``_FUSED_STRICT``, ``_PROJECTION``, ``_GPU_ENTROPY``;
    ``os.environ`` when ``env`` is None) as :class:`~dynamo_kvtc.codec.options.CodecOptions`. An unset
    ``gpu_entropy`` stays None (a store with a disk tier then writes Deflate)."""
    kw = settings.resolve(["fused", "fused_strict", "projection"], None, env)
    gpu = settings.env_value("gpu_entropy", env) if settings.env_is_set("gpu_entropy", env) else None
    return CodecOptions(gpu_entropy=gpu, **kw)
