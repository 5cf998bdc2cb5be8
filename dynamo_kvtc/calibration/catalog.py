"""Where calibrations live: the shipped ``calibrations/`` folder (or ``$DYN_KVTC_CALIBRATIONS``), then the cache."""

from __future__ import annotations

from pathlib import Path

from .. import settings
from .models import cache_dir


def shipped_calibrations() -> Path:
    """The repository's calibrations/ folder (or $DYN_KVTC_CALIBRATIONS)."""
    env = settings.env_value("calibrations")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "calibrations"


def find_calibration(model: str) -> Path | None:
    """The calibration directory for a model name (a short embedded name or a checkpoint folder's name)."""
    for base in (shipped_calibrations(), cache_dir() / "calibrations"):
        if (base / model / "calibration.json").is_file():
            return base / model
    return None
