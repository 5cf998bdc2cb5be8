"""What every benchmark and report writes: a description of the machine, and JSON output."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["machine", "write_json"]


def machine() -> dict[str, Any]:
    """Platform, CPU, torch version and threads, GPU and nvCOMP where present."""
    import torch

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
    """Write ``data`` as indented JSON to ``path`` (parents made); nothing when ``path`` is empty."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=float) + "\n")
