"""Calibration: RoPE-free cross-layer PCA, DP bit allocation, the artifact on disk, offline models and text.

The names load on first use (PEP 562), so ``calibration.card`` and ``calibration.catalog``'s callers that need no
tensors import no torch through this package.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from ..lazy import exports

_LAZY = {
    "Calibration": ".artifact",
    "CalibrationConfig": ".calibrate",
    "KvSample": ".calibrate",
    "calibrate": ".calibrate",
    "shard_heads": ".calibrate",
    "allocate": ".dp",
    "block_errors": ".dp",
}

__all__ = ["Calibration", "CalibrationConfig", "KvSample", "allocate", "block_errors", "calibrate", "shard_heads"]

if TYPE_CHECKING:
    from .artifact import Calibration
    from .calibrate import CalibrationConfig, KvSample, calibrate, shard_heads
    from .dp import allocate, block_errors


__getattr__, __dir__ = exports(__name__, _LAZY)


class _Package(types.ModuleType):
    """Keeps ``calibration.calibrate`` the function, as the eager ``from .calibrate import calibrate`` did: loading
    the submodule of the same name sets the package attribute to the module, and this binds its function instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "calibrate" and isinstance(value, types.ModuleType) and hasattr(value, "calibrate"):
            value = value.calibrate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
