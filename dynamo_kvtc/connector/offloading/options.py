"""The options of the ``kvtc`` secondary tier (:mod:`.tier`): its ``secondary_tiers`` entry, parsed through the
settings table (:func:`dynamo_kvtc.settings.read_options`, the ``vllm_tier`` rows: docs/configuration.md lists every
key, its default and which other ways in read it). An error names the option as written
(``secondary_tiers[type=kvtc].<key>``); the tier's own rules (a host budget > 0, a directory for a disk tier) are
checked here; the rest of the start-up (a usable disk folder, CUDA present for ``device: cuda``, the calibration) is
the ways in's one start-up, :func:`~dynamo_kvtc.connector.startup.open_tier`, with its rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ... import settings
from ...errors import ConfigError
from ...tiers.layouts import page_layouts
from ..startup import torch_device

__all__ = ["TIER_TYPE", "WAY", "KvtcTierOptions", "option_error"]

TIER_TYPE = "kvtc"
WAY = "vllm_tier"  # the settings table's name of this way in


def option_error(key: str, msg: str) -> ConfigError:
    """The error for a bad value of option ``key`` (its message names the tier and the key)."""
    return ConfigError(f"{settings.origin(WAY, key)}: {msg}")


@dataclass(frozen=True)
class KvtcTierOptions:
    """The tier's options (the settings table's ``vllm_tier`` rows; sizes in bytes)."""

    calibration: Path | None = settings.default("calibration")
    ratio: float | str = settings.default("ratio")  # or "auto" (resolved at start-up from the calibration's check.json)
    ratio_policy: str = settings.default("ratio_policy")
    chunk_window: int = settings.default("chunk_window")
    host_bytes: int = settings.default("cpu_cache_gb")
    disk_bytes: int = settings.default("disk_cache_gb")
    disk_dir: Path | None = settings.default("disk_cache_dir")
    device: str = settings.default("device")
    page_layout: str = settings.default("page_layout")
    threads: int = settings.default("threads")
    locality: str | None = settings.default("locality")
    pool_master: str | None = settings.default("pool_master")  # the cluster-wide pool tier (tiers/pool.py)
    pool_metadata_server: str | None = settings.default("pool_metadata_server")
    pool_segment_gb: float = settings.default("pool_segment_gb")
    pool_replicas: int = settings.default("pool_replicas")
    pool_protocol: str = settings.default("pool_protocol")
    pool_device: str | None = settings.default("pool_device")
    pool_timeout_s: float = settings.default("pool_timeout_s")
    pool_queue_mb: int = settings.default("pool_queue_mb")
    pool_insecure: bool = settings.default("pool_insecure")

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> KvtcTierOptions:
        values = settings.read_options(WAY, cfg)
        opts = cls(**{settings.BY_KEY[k].field: v for k, v in values.items()})
        if opts.host_bytes <= 0:
            raise option_error("cpu_cache_gb", "must be > 0 (the tier keeps its blobs there)")
        if opts.disk_bytes > 0 and opts.disk_dir is None:
            raise option_error("disk_cache_dir", "is required when disk_cache_gb > 0")
        if opts.page_layout != "auto" and opts.page_layout not in page_layouts():  # the registry's, added ones too
            known = ", ".join(("auto", *page_layouts()))
            raise option_error("page_layout", f"must be one of {known} (a registered KV layout with pages)")
        return opts

    @property
    def torch_device(self) -> torch.device:
        return torch_device(self.device)
