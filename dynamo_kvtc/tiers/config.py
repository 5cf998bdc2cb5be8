"""Tier configuration: the :class:`TierConfig` dataclass, its validation, and reading it from the environment.

Its ``DYN_KVTC_*`` variables, types, bounds and defaults are the ``tier`` rows of :data:`dynamo_kvtc.settings.SETTINGS`
(the reference table is docs/configuration.md, generated from it), plus the process-wide knobs the tiers pass down:
the codec's (:class:`~dynamo_kvtc.codec.options.CodecOptions`: ``fused``, ``fused_strict``, ``projection``,
``gpu_entropy``) and ``codec_sms`` (the codec streams' SM budget). :meth:`TierConfig.from_env` parses them through that
table once, at start-up; nothing below reads the environment. A config built directly checks each table field with
:func:`dynamo_kvtc.settings.check` (the table's bounds and choices, not a second copy) and keeps only its cross-field
rules here; a bad value raises :class:`~dynamo_kvtc.errors.ConfigError` naming the field (or the variable it came
from).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .. import settings
from ..codec.options import CodecOptions
from ..errors import ConfigError
from ..settings import GB

_d = settings.default  # field defaults are the table's
AUTO = "auto"  # ratio: the calibration's checked safe ratio (calibration/verdict.py), resolved at start-up
CODEC_KEYS = tuple(f.name for f in fields(CodecOptions))  # the table's process keys of the same names
PROCESS_KEYS = ("codec_sms", *CODEC_KEYS)  # the process-wide knobs a TierConfig carries down
SECRET_KEYS = ("transfer_secret_file", "transfer_secret")  # the cluster secret: the hand-off's, and the pool's seal
_TABLE = {s.field: s.key for s in settings.select("tier")} | {"codec_sms": "codec_sms"}  # field -> key

__all__ = ["AUTO", "GB", "TierConfig", "codec_options"]


def codec_options(values: Mapping[str, Any]) -> CodecOptions:
    """The codec options among parsed settings (by key; the unset ones keep CodecOptions' defaults)."""
    return CodecOptions(**{k: values[k] for k in CODEC_KEYS if k in values})


def process_settings(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The process-wide knobs a TierConfig carries (``codec``, ``codec_sms``) from the environment, as keyword
    arguments: for tools that set the tier fields in code but honour the process's codec settings
    (``TierConfig(host_bytes=..., **process_settings())``)."""
    values = settings.resolve(PROCESS_KEYS, None, env)
    return {"codec": codec_options(values), "codec_sms": values.get("codec_sms", _d("codec_sms"))}


def cluster_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster secret from the environment (``DYN_KVTC_TRANSFER_SECRET_FILE`` wins over
    ``DYN_KVTC_TRANSFER_SECRET``), or None: for ways in whose options hold no secret (the vLLM ``kvtc`` tier)."""
    from ..transport.auth import load_secret

    return load_secret(settings.env_value("transfer_secret_file", env), settings.env_value("transfer_secret", env))


@dataclass(frozen=True)
class TierConfig:
    """What the compressed tiers may hold, how they choose a ratio, and how their codec runs. Owns validation of its
    own fields; never reads the environment except in :meth:`from_env`."""

    host_bytes: int = _d("cpu_cache_gb")
    disk_bytes: int = _d("disk_cache_gb")
    disk_dir: Path | None = _d("disk_cache_dir")
    ratio: float | str = _d("ratio")  # or "auto": the connector resolves it from the calibration's check verdict
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
    codec: CodecOptions = field(default_factory=CodecOptions)  # how the codec runs (process-wide, environment only)
    offload_queue_bytes: int = _d("offload_queue_gb")  # K/V copies the offload queue may hold (over: save skipped)
    codec_sms: int = _d("codec_sms")  # SMs of the codec streams' green context; 0: all, at the lowest priority
    tiers: tuple[str, ...] = ()  # registered tiers beyond host and disk to chain (tiers/registry.py), in order
    pool_master: str | None = _d("pool_master")  # the pool tier (tiers/pool.py): mooncake_master's "host:port"
    pool_metadata_server: str | None = _d("pool_metadata_server")
    pool_segment_gb: float = _d("pool_segment_gb")
    pool_replicas: int = _d("pool_replicas")
    pool_protocol: str = _d("pool_protocol")
    pool_device: str | None = _d("pool_device")
    pool_timeout_s: float = _d("pool_timeout_s")
    pool_queue_mb: int = _d("pool_queue_mb")
    pool_insecure: bool = _d("pool_insecure")
    pool_secret: bytes | None = field(default=None, repr=False)  # the cluster secret (transfer_secret_file/_secret)

    def __post_init__(self) -> None:
        for name, key in _TABLE.items():  # bounds, choices and types: the table's rule, through settings.check
            object.__setattr__(self, name, settings.check(key, getattr(self, name)))
        p = self.pressure_high
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise ConfigError(f"pressure_high must be in (0, 1], got {p!r}")
        if isinstance(self.tiers, str) or not all(isinstance(t, str) for t in self.tiers):
            raise ConfigError(f"tiers must be registered tier names, got {self.tiers!r}")
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if not isinstance(self.codec, CodecOptions):
            raise ConfigError(f"codec must be a CodecOptions, got {self.codec!r}")
        if self.disk_bytes and self.disk_dir is None:
            raise ConfigError("disk_cache_gb is set but disk_cache_dir is not (the disk tier's directory)")
        if self.max_ratio is not None and self.ratio != AUTO and self.max_ratio < self.ratio:
            raise ConfigError(f"ratio {self.ratio} must be positive and <= max_ratio {self.max_ratio}")
        if self.pool_secret is not None and not isinstance(self.pool_secret, bytes):
            raise ConfigError("pool_secret must be bytes")  # never shown: it is the secret
        if self.page_bytes & (self.page_bytes - 1):
            raise ConfigError(f"page_bytes must be a power of two >= 512, got {self.page_bytes}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> TierConfig:
        """The tier settings and the process-wide knobs the tiers carry (codec options, ``codec_sms``) from
        ``DYN_KVTC_*`` variables (``os.environ`` when ``env`` is None; unknown ones are warned about), then
        ``overrides`` (field names) on top."""
        known = {f.name for f in fields(cls)}
        bad = set(overrides) - known
        if bad:
            raise ConfigError(f"unknown tier settings: {sorted(bad)}")
        keys = ("tier", *PROCESS_KEYS, *SECRET_KEYS)
        try:
            return cls.from_values({**settings.resolve(keys, None, env), **overrides})
        except ConfigError as e:  # name the variable a bad value came from
            origins = {f: o for f, o in settings.sources(keys, None, env).items() if f not in overrides}
            raise settings.blame(e, origins) from None

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> TierConfig:
        """A config from parsed settings by field (:func:`dynamo_kvtc.settings.resolve`): the codec options become
        ``codec`` (unless ``values`` holds one), other fields that are not the tiers' are ignored."""
        own = {f.name for f in fields(cls)}
        kw = {k: v for k, v in values.items() if k in own}
        if "pool_secret" not in kw and any(values.get(k) for k in SECRET_KEYS):  # the cluster secret seals the pool
            from ..transport.auth import load_secret

            kw["pool_secret"] = load_secret(values.get("transfer_secret_file"), values.get("transfer_secret"))
        if "codec" not in kw:
            kw["codec"] = codec_options(values)
        return cls(**kw)

    def with_(self, **kw: Any) -> TierConfig:
        return replace(self, **kw)

