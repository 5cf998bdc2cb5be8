"""Where calibrations live: the shipped ``calibrations/`` folder (or ``DYN_KVTC_CALIBRATIONS``), then the cache.

The folders come from a :class:`~dynamo_kvtc.settings.ToolSettings` (``tools``); left out, the process's
(:func:`~dynamo_kvtc.settings.tool_settings`, the one place the environment is read).
"""

from __future__ import annotations

from pathlib import Path

from .. import settings
from ..settings import ToolSettings
from .models import cache_dir

REPO_CALIBRATIONS = Path(__file__).resolve().parents[2] / "calibrations"


def shipped_calibrations(tools: ToolSettings | None = None) -> Path:
    """The folder searched first: ``tools.calibrations`` (``DYN_KVTC_CALIBRATIONS``), else the repository's
    calibrations/."""
    tools = tools or settings.tool_settings()
    return tools.calibrations or REPO_CALIBRATIONS


def find_calibration(model: str, tools: ToolSettings | None = None) -> Path | None:
    """The calibration directory for a model name (a short embedded name or a checkpoint folder's name): under
    :func:`shipped_calibrations`, then ``<cache>/calibrations``."""
    tools = tools or settings.tool_settings()
    for base in (shipped_calibrations(tools), cache_dir(tools) / "calibrations"):
        if (base / model / "calibration.json").is_file():
            return base / model
    return None
