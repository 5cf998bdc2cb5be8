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


def normalise_model_name(model: str) -> str:
    """The folder name a model's calibration is kept under: the last path component of the model id or checkpoint
    path, lowercased (``meta-llama/Llama-3.1-8B-Instruct`` -> ``llama-3.1-8b-instruct``)."""
    name = Path(str(model).rstrip("/\\")).name or str(model)
    return name.lower()


def find_calibration(model: str, tools: ToolSettings | None = None) -> Path | None:
    """The calibration directory for a served model (an id, a checkpoint path or a short embedded name).

    The lookup rule (the explicit ``calibration`` setting, when set, is used before this): under
    :func:`shipped_calibrations` (``$DYN_KVTC_CALIBRATIONS``, else the repository's ``calibrations/``), then
    ``<cache>/calibrations``, the folder named :func:`normalise_model_name` (then the name as given, for folders made
    before names were normalised). The caller still checks the calibration's fingerprint against the served model."""
    tools = tools or settings.tool_settings()
    names = list(dict.fromkeys((normalise_model_name(model), Path(model).name, model)))
    for base in (shipped_calibrations(tools), cache_dir(tools) / "calibrations"):
        for name in names:
            if name and (base / name / "calibration.json").is_file():
                return base / name
    return None
