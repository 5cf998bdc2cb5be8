"""The options of the ``kvtc`` secondary tier (:mod:`.offload_tier`): parsed from its ``secondary_tiers`` entry.

Tier options (each validated here; an error names the key):

=================  =======================================================================================
``calibration``    calibration directory (default: the shipped/cached one named after the model folder)
``ratio``          compression ratio, one of the calibration's plans (default 16); ``auto``: the calibration's
                   checked safe ratio (``dynamo-kvtc check CAL --model M --write``; refused without one)
``ratio_policy``   ``fixed`` (every chunk at ``ratio``) or ``raw`` (every chunk stored uncompressed: lossless)
``window``         trailing tokens of every chunk kept raw (default 0)
``cpu_cache_gb``   host-tier budget of compressed bytes (default 4)
``disk_cache_gb``  disk-tier budget (default 0: no disk tier); needs ``disk_cache_dir``
``disk_cache_dir`` directory the disk tier owns (created 0700)
``device``         ``auto`` (CUDA when available), ``cpu`` or ``cuda``: where chunks are encoded and decoded
``page_layout``    ``auto``, or a registered KV layout with pages (``nhd``, ``hnd``, ``cpu``, ...:
                   :mod:`dynamo_kvtc.tiers.layouts`): how a layer's block is laid out in a primary chunk
``threads``        encode/decode threads (default 2)
=================  =======================================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigError
from ...tiers.layouts import page_layouts

__all__ = ["DEVICES", "PAGE_LAYOUTS", "RATIO_POLICIES", "TIER_TYPE", "KvtcTierOptions", "option_error"]


TIER_TYPE = "kvtc"
PAGE_LAYOUTS = ("auto", *page_layouts())  # the built-in ones; validation asks the registry (layouts added later too)
RATIO_POLICIES = ("fixed", "raw")
DEVICES = ("auto", "cpu", "cuda")


def option_error(key: str, msg: str) -> ConfigError:
    """The error for a bad value of option ``key`` (its message names the tier and the key)."""
    return ConfigError(f"secondary_tiers[type={TIER_TYPE}].{key}: {msg}")


@dataclass(frozen=True)
class KvtcTierOptions:
    """The tier's options, from its entry in ``secondary_tiers`` (see the module docstring for the table)."""

    calibration: str | None = None
    ratio: float | str = 16.0  # or "auto" (resolved by the tier from the calibration's check.json)
    ratio_policy: str = "fixed"
    window: int = 0
    cpu_cache_gb: float = 4.0
    disk_cache_gb: float = 0.0
    disk_cache_dir: str | None = None
    device: str = "auto"
    page_layout: str = "auto"
    threads: int = 2
    locality: str | None = None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> KvtcTierOptions:
        known = set(cls.__dataclass_fields__)
        for key in cfg:
            if key not in known:
                raise option_error(key, f"unknown option; known: {', '.join(sorted(known))}")
        out: dict[str, Any] = {}
        if isinstance(cfg.get("ratio"), str) and cfg["ratio"].strip().lower() == "auto":
            out["ratio"] = "auto"
        for key, conv in (("ratio", float), ("cpu_cache_gb", float), ("disk_cache_gb", float)):
            if key in cfg and key not in out:
                try:
                    out[key] = conv(cfg[key])
                except (TypeError, ValueError):
                    raise option_error(key, f"must be a number, got {cfg[key]!r}") from None
        for key in ("window", "threads"):
            if key in cfg:
                v = cfg[key]
                if isinstance(v, bool) or not isinstance(v, int):
                    raise option_error(key, f"must be an integer, got {v!r}")
                out[key] = v
        for key in ("calibration", "disk_cache_dir", "ratio_policy", "device", "page_layout", "locality"):
            if key in cfg and cfg[key] is not None:
                if not isinstance(cfg[key], (str, os.PathLike)):
                    raise option_error(key, f"must be a string, got {cfg[key]!r}")
                out[key] = str(cfg[key])
        opts = cls(**out)
        opts._validate()
        return opts

    def _validate(self) -> None:
        if self.ratio != "auto" and self.ratio <= 1:
            raise option_error("ratio", f"must be > 1, got {self.ratio:g}")
        if self.ratio_policy not in RATIO_POLICIES:
            raise option_error("ratio_policy", f"must be one of {', '.join(RATIO_POLICIES)}, got {self.ratio_policy!r}")
        if self.window < 0:
            raise option_error("window", f"must be >= 0, got {self.window}")
        if self.cpu_cache_gb <= 0:
            raise option_error("cpu_cache_gb", f"must be > 0, got {self.cpu_cache_gb:g}")
        if self.disk_cache_gb < 0:
            raise option_error("disk_cache_gb", f"must be >= 0, got {self.disk_cache_gb:g}")
        if self.disk_cache_gb > 0 and not self.disk_cache_dir:
            raise option_error("disk_cache_dir", "is required when disk_cache_gb > 0")
        if self.device not in DEVICES:
            raise option_error("device", f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise option_error("device", "'cuda' requested but CUDA is not available in the scheduler process")
        if self.page_layout not in ("auto", *page_layouts()):
            known = ", ".join(("auto", *page_layouts()))
            raise option_error("page_layout", f"must be one of {known}, got {self.page_layout!r}")
        if not 1 <= self.threads <= 64:
            raise option_error("threads", f"must be in 1..64, got {self.threads}")
        if self.locality is not None and self.locality not in ("LOCAL", "REMOTE"):
            raise option_error("locality", f"must be LOCAL or REMOTE, got {self.locality!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
