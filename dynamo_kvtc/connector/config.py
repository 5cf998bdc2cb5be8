"""Connector configuration: :class:`ConnectorConfig`, from ``kv_connector_extra_config`` keys and ``DYN_KVTC_*``
variables.

The keys, variables, types, bounds and defaults are the ``tier`` and ``connector`` rows of
:data:`dynamo_kvtc.settings.SETTINGS`, plus the process-wide knobs the connector passes down (the hand-off's:
``handoff_choice``, ``handoff_memory``, ``link_gbps``, ``handoff_restore_gbs``, ``nixl_progress_us``,
``transfer_secret``; the tiers': codec options and ``codec_sms``); the reference table is docs/configuration.md,
generated from it. The extra config wins over the environment (process-wide knobs are environment only: the extra
config refuses them); everything is parsed once, at start-up, by :func:`dynamo_kvtc.settings.resolve` with errors that
name the key or variable, and an unknown ``DYN_KVTC_*`` variable is warned about. Tier sizes, policy and codec options
become the :class:`~dynamo_kvtc.tiers.config.TierConfig`; the rest belong to the connector.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .. import settings
from ..errors import ConfigError
from ..tiers.config import PROCESS_KEYS as TIER_PROCESS_KEYS
from ..tiers.config import SECRET_KEYS, TierConfig

HANDOFF_KEYS = (
    "handoff_choice", "handoff_memory", "link_gbps", "handoff_restore_gbs", "nixl_progress_us", "transfer_secret"
)
_d = settings.default  # field defaults are the table's


def handoff_settings(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The hand-off's process-wide knobs from the environment, as keyword arguments: for tools that set the connector
    fields in code but honour the process's hand-off settings (``ConnectorConfig(..., **handoff_settings())``)."""
    return settings.resolve(HANDOFF_KEYS, None, env)


SCOPES = ("tier", "connector", *TIER_PROCESS_KEYS, *HANDOFF_KEYS)


def from_environment(extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The keys whose value :meth:`ConnectorConfig.from_sources` takes from a ``DYN_KVTC_*`` variable (not the extra
    config): the start-up rule names the variable for those, the extra-config key for the others."""
    origins = settings.sources(SCOPES, extra, env)
    return frozenset(s.key for s in settings.select(SCOPES) if origins.get(s.field, "").startswith("DYN_KVTC_"))


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the vLLM connector is configured with: its tiers and its own settings (calibration, flushing,
    restore deadline, metrics, events, compressed transfer and the hand-off's process-wide knobs). Owns validation;
    never reads the environment except in :meth:`from_sources`."""

    tiers: TierConfig = field(default_factory=TierConfig)
    calibration: Path | None = _d("calibration")
    flush_tokens: int = _d("flush_tokens")
    load_timeout_s: float = _d("load_timeout_s")
    load_failure_policy: str = _d("load_failure_policy")
    metrics_port: int | None = _d("metrics_port")
    metrics_host: str = _d("metrics_host")
    publish_events: bool = _d("publish_events")
    transfer: str = _d("transfer")
    nixl_backend: str = _d("nixl_backend")
    transfer_host: str = _d("transfer_host")
    transfer_port: int = _d("transfer_port")
    transfer_timeout_s: float = _d("transfer_timeout_s")
    transfer_staging_mb: int = _d("transfer_staging_mb")  # prefill side: NIXL-registered staging arena, MiB
    transfer_secret_file: Path | None = _d("transfer_secret_file")  # HMAC key of the hand-off (see transport.auth)
    transfer_peers: str | None = _d("transfer_peers")  # decode side: hosts fetched from (None: see params.trusted)
    # the hand-off's process-wide knobs (environment only)
    handoff_choice: str = _d("handoff_choice")  # compressed | policy (beside NixlConnector: raw or compressed)
    handoff_memory: str = _d("handoff_memory")  # auto | host | device: where staging and receive buffers live
    link_gbps: float = _d("link_gbps")  # 0: learned per peer
    handoff_restore_gbs: float = _d("handoff_restore_gbs")  # 0: learned from restores
    nixl_progress_us: int = _d("nixl_progress_us")  # 0: NIXL's never-sleeping progress thread
    transfer_secret: str | None = field(default=_d("transfer_secret"), repr=False)  # never logged

    def __post_init__(self) -> None:
        if not isinstance(self.tiers, TierConfig):
            raise ConfigError(f"tiers must be a TierConfig, got {self.tiers!r}")
        for s in settings.select(("connector", *HANDOFF_KEYS)):  # the table's rule, not a second copy
            if s.key != "transfer_secret":
                object.__setattr__(self, s.field, settings.check(s.key, getattr(self, s.field)))
        if self.transfer_secret is not None and not isinstance(self.transfer_secret, str):
            raise ConfigError("transfer_secret must be a string")  # never shown: it is the secret

    @classmethod
    def from_sources(
        cls, extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> ConnectorConfig:
        """Build from ``kv_connector_extra_config`` (wins) and ``DYN_KVTC_*`` variables (``os.environ`` when ``env``
        is None). Unknown extra-config keys are refused, unknown variables warned about."""
        scopes = SCOPES
        values = settings.resolve(scopes, extra, env)
        own = {f.name for f in fields(cls)} - {"tiers"}
        try:
            tiers = TierConfig.from_values({k: v for k, v in values.items() if k not in own or k in SECRET_KEYS})
            return cls(tiers=tiers, **{k: v for k, v in values.items() if k in own})
        except ConfigError as e:  # name the key or variable a bad value came from
            raise settings.blame(e, settings.sources(scopes, extra, env)) from None
