"""Where calibrations live: the shipped ``calibrations/`` folder (or ``DYN_KVTC_CALIBRATIONS``), then the cache; and
which of them fits a served model — by folder name first, then by fingerprint, whatever the folder is called.

The folders come from a :class:`~dynamo_kvtc.settings.ToolSettings` (``tools``); left out, the process's
(:func:`~dynamo_kvtc.settings.tool_settings`, the one place the environment is read).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from .. import settings
from ..codec.model import ModelFingerprint
from ..errors import CalibrationError
from ..settings import ToolSettings
from .models import cache_dir

log = logging.getLogger(__name__)

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


def search_folders(tools: ToolSettings | None = None) -> tuple[Path, Path]:
    """The folders searched, in order: :func:`shipped_calibrations`, then ``<cache>/calibrations``."""
    tools = tools or settings.tool_settings()
    return shipped_calibrations(tools), cache_dir(tools) / "calibrations"


def default_calibration_dir(model: str, tools: ToolSettings | None = None) -> Path:
    """Where ``dynamo-kvtc calibrate`` writes when ``--out`` is not given: ``$DYN_KVTC_CALIBRATIONS/<normalised
    name>`` when that is set, else ``<cache>/calibrations/<normalised name>`` (both are searched by the lookup)."""
    tools = tools or settings.tool_settings()
    base = tools.calibrations or cache_dir(tools) / "calibrations"
    return base / normalise_model_name(model)


def read_fingerprint(path: Path) -> ModelFingerprint | None:
    """The model fingerprint recorded in ``path/calibration.json`` (no tensors read); None when it cannot be read."""
    try:
        return ModelFingerprint.from_dict(json.loads((Path(path) / "calibration.json").read_text())["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError, CalibrationError) as e:
        log.debug("calibration %s: no readable fingerprint (%s)", path, e)
        return None


def _whole(fp: ModelFingerprint) -> ModelFingerprint:
    """``fp`` as the whole model (every KV head, no TP shard): what a joint calibration records."""
    return replace(fp, num_kv_heads=fp.total_kv_heads or fp.num_kv_heads, tp_rank=0, tp_size=1)


def fitting(
    model: ModelFingerprint, tools: ToolSettings | None = None
) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """Scan every calibration in the search folders (one level deep) for one whose fingerprint fits ``model`` (the
    served model's, as :func:`~dynamo_kvtc.calibration.models.fingerprint_of` gives it): ``(the first that fits, or
    None; every other calibration with what differs, nearest first)``. Folder names do not matter."""
    want = _whole(model)
    fits: Path | None = None
    others: list[tuple[Path, list[str]]] = []
    for base in search_folders(tools):
        if not base.is_dir():
            continue
        for d in sorted(p for p in base.iterdir() if (p / "calibration.json").is_file()):
            fp = read_fingerprint(d)
            if fp is None:
                continue
            problems = _whole(fp).mismatches(want, strict=False)
            if not problems and fits is None:
                fits = d
            elif problems:
                others.append((d, problems))
    others.sort(key=lambda c: len(c[1]))
    return fits, others


def find_calibration(
    model: str, tools: ToolSettings | None = None, fingerprint: ModelFingerprint | None = None
) -> Path | None:
    """The calibration directory for a served model (an id, a checkpoint path or a short embedded name).

    The lookup rule (the explicit ``calibration`` setting, when set, is used before this): under
    :func:`shipped_calibrations` (``$DYN_KVTC_CALIBRATIONS``, else the repository's ``calibrations/``), then
    ``<cache>/calibrations``, the folder named :func:`normalise_model_name` (then the name as given, for folders made
    before names were normalised). With the served model's ``fingerprint``, a folder found by name must also fit it,
    and when none does every calibration in those folders is tried by fingerprint (:func:`fitting`), whatever its
    folder is called. The caller still checks the calibration it loads against the served model."""
    tools = tools or settings.tool_settings()
    names = list(dict.fromkeys((normalise_model_name(model), Path(model).name, model)))
    for base in search_folders(tools):
        for name in names:
            if name and (base / name / "calibration.json").is_file():
                found = base / name
                fp = read_fingerprint(found) if fingerprint is not None else None
                if fingerprint is None or fp is None or not _whole(fp).mismatches(_whole(fingerprint), strict=False):
                    return found
    if fingerprint is None:
        return None
    fits, _ = fitting(fingerprint, tools)
    if fits is not None:
        log.info("kvtc: calibration %s fits model %s by its fingerprint", fits, model)
    return fits


def not_found(model: str, fingerprint: ModelFingerprint | None = None, tools: ToolSettings | None = None) -> str:
    """One line for a model with no calibration: where it was looked for, the nearest calibrations and what differs,
    and the command that makes one."""
    tools = tools or settings.tool_settings()
    folders = " and ".join(str(b) for b in search_folders(tools))
    near = ""
    if fingerprint is not None:
        _, others = fitting(fingerprint, tools)
        if others:
            near = "; nearest: " + ", ".join(f"{d.name} ({'; '.join(p)})" for d, p in others[:3])
    return (
        f"no calibration fits model {model!r} (looked by name and by fingerprint in {folders}{near}): make one with "
        f"`dynamo-kvtc calibrate --model {model}` (it writes {default_calibration_dir(model, tools)}), or set "
        "the calibration setting to its folder"
    )
