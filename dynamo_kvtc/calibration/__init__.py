"""Calibration: RoPE-free cross-layer PCA, DP bit allocation, the artifact on disk, offline models and text."""

from .artifact import Calibration
from .calibrate import CalibrationConfig, KvSample, calibrate, shard_heads
from .dp import allocate, block_errors

__all__ = ["Calibration", "CalibrationConfig", "KvSample", "allocate", "block_errors", "calibrate", "shard_heads"]
