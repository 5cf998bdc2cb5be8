"""dynamo_kvtc: KV Cache Transform Coding (arXiv 2511.01815) as a compressed KV-cache tier for NVIDIA Dynamo.

Public API::

    from dynamo_kvtc import Calibration, KvtcCodec, calibrate
    cal = calibrate(samples_or_model, ...); cal.save(path); cal = Calibration.load(path)
    codec = KvtcCodec(cal, ratio=16, device="cpu")
    blob = codec.encode(keys, values, positions); keys2, values2 = codec.decode(blob)
"""

from .calibration import Calibration, CalibrationConfig, KvSample, calibrate
from .codec import KvtcCodec, ModelFingerprint, RotaryConfig
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

__version__ = "0.1.0"

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
