"""dynamo_kvtc: KV Cache Transform Coding (arXiv 2511.01815) as a compressed KV-cache tier for NVIDIA Dynamo.

Public API::

    from dynamo_kvtc import Calibration, KvtcCodec, calibrate
    cal = calibrate(samples_or_model, ...); cal.save(path); cal = Calibration.load(path)
    codec = KvtcCodec(cal, ratio=16, device="cpu")
    blob = codec.encode(keys, values, positions); keys2, values2 = codec.decode(blob)

The names load on first use (PEP 562): ``import dynamo_kvtc`` and the errors import no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import (
    CalibrationError,
    CalibrationMismatchError,
    ConfigError,
    CorruptBlobError,
    DecodeError,
    InputError,
    KvtcError,
    ModelError,
    UnsupportedCodecError,
    WrongCalibrationError,
)
from .lazy import exports

__version__ = "0.1.0"

_LAZY = {  # name -> the module that defines it
    "Calibration": ".calibration.artifact",
    "CalibrationConfig": ".calibration.calibrate",
    "KvSample": ".calibration.calibrate",
    "calibrate": ".calibration.calibrate",
    "KvtcCodec": ".codec.kvtc",
    "ModelFingerprint": ".codec.model",
    "RotaryConfig": ".codec.rope",
}

__all__ = [
    "Calibration",
    "CalibrationConfig",
    "CalibrationError",
    "CalibrationMismatchError",
    "ConfigError",
    "CorruptBlobError",
    "DecodeError",
    "InputError",
    "KvSample",
    "KvtcCodec",
    "KvtcError",
    "ModelError",
    "ModelFingerprint",
    "RotaryConfig",
    "UnsupportedCodecError",
    "WrongCalibrationError",
    "calibrate",
]

if TYPE_CHECKING:
    from .calibration import Calibration, CalibrationConfig, KvSample, calibrate
    from .codec import KvtcCodec, ModelFingerprint, RotaryConfig

__getattr__, __dir__ = exports(__name__, _LAZY)
