"""Connector configuration: :class:`ConnectorConfig`, from ``kv_connector_extra_config`` keys and ``DYN_KVTC_*``
variables.

The keys, variables, types, bounds and defaults are the ``tier`` and ``connector`` rows of
:data:`dynamo_kvtc.settings.SETTINGS`; the reference table is docs/configuration.md, generated from it. The extra
config wins over the environment; both are parsed by :func:`dynamo_kvtc.settings.resolve` with errors that name the
key or variable. Tier sizes and policy become the :class:`~dynamo_kvtc.tiers.config.TierConfig`; the rest belong to
the connector.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import settings
from ..errors import ConfigError
from ..tiers.config import TierConfig, codec_options

TRANSFER_MODES = settings.BY_KEY["transfer"].choices  # "" (off), "prefill", "decode"
LOAD_FAILURE_POLICIES = settings.BY_KEY["load_failure_policy"].choices
_d = settings.default  # field defaults are the table's


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the vLLM connector is configured with: its tiers and its own settings (calibration, flushing,
    restore deadline, metrics, events, compressed transfer). Owns validation; never reads the environment except in
    :meth:`from_sources`."""

    tiers: TierConfig = field(default_factory=TierConfig)
    calibration: Path | None = _d("calibration")
    flush_tokens: int = _d("flush_tokens")
    load_timeout_s: float = _d("load_timeout_s")
    load_failure_policy: str = _d("load_failure_policy")
    metrics_port: int | None = _d("metrics_port")
    publish_events: bool = _d("publish_events")
    transfer: str = _d("transfer")
    nixl_backend: str = _d("nixl_backend")
    transfer_host: str = _d("transfer_host")
    transfer_port: int = _d("transfer_port")
    transfer_timeout_s: float = _d("transfer_timeout_s")
    transfer_staging_mb: int = _d("transfer_staging_mb")  # prefill side: NIXL-registered staging arena, MiB
    transfer_secret_file: Path | None = _d("transfer_secret_file")  # HMAC key of the hand-off (see transport.auth)

    def __post_init__(self) -> None:
        if self.flush_tokens < 1:
            raise ConfigError(f"flush_tokens must be >= 1, got {self.flush_tokens}")
        if self.load_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise ConfigError("load_timeout_s and transfer_timeout_s must be > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port {self.metrics_port} is not a port number")
        if not 0 <= self.transfer_port < 65536:
            raise ConfigError(f"transfer_port {self.transfer_port} is not a port number")
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError(f"load_failure_policy must be 'recompute' or 'fail', got {self.load_failure_policy!r}")
        if self.transfer not in TRANSFER_MODES:
            raise ConfigError(f"transfer must be one of {TRANSFER_MODES[1:]} (or unset), got {self.transfer!r}")
        mb = self.transfer_staging_mb
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise ConfigError(f"transfer_staging_mb must be an integer >= 1, got {mb!r}")

    @classmethod
    def from_sources(
        cls, extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> ConnectorConfig:
        """Build from ``kv_connector_extra_config`` (wins) and ``DYN_KVTC_*`` variables (``os.environ`` when ``env``
        is None). Unknown extra-config keys are refused."""
        scopes = ("tier", "connector")
        values = settings.resolve(scopes, extra, env)
        tier_fields = {s.field for s in settings.select("tier")}
        try:
            tiers = TierConfig(codec=codec_options(env), **{k: v for k, v in values.items() if k in tier_fields})
            return cls(tiers=tiers, **{k: v for k, v in values.items() if k not in tier_fields})
        except ConfigError as e:  # name the key or variable a bad value came from
            raise settings.blame(e, settings.sources(scopes, extra, env)) from None
