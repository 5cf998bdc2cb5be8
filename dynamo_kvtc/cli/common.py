"""Helpers shared by CLI commands: where calibrations live, machine description, JSON output."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from ..calibration.models import cache_dir


def shipped_calibrations() -> Path:
    """The repository's calibrations/ folder (or $DYN_KVTC_CALIBRATIONS)."""
    env = os.environ.get("DYN_KVTC_CALIBRATIONS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "calibrations"


def find_calibration(model: str) -> Path | None:
    for base in (shipped_calibrations(), cache_dir() / "calibrations"):
        if (base / model / "calibration.json").is_file():
            return base / model
    return None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    try:
        from nvidia import nvcomp

        info["nvcomp"] = nvcomp.__version__
    except ImportError:
        pass
    return info


def write_json(path: str | os.PathLike | None, data: Any) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=float) + "\n")
