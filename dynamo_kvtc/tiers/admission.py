"""Offload filter (like KVBM's frequency filter) and the run-time ratio policy."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from ..errors import ConfigError


class OffloadFilter:
    """Admit a block for offload once its sequence hash has been seen ``min_frequency`` times (bounded memory)."""

    def __init__(self, min_frequency: int = 1, capacity: int = 1 << 20) -> None:
        self.min_frequency = min_frequency
        self.capacity = capacity
        self._counts: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, hashes: Sequence[int]) -> list[bool]:
        out = []
        with self._lock:
            for h in hashes:
                c = self._counts.pop(h, 0) + 1
                self._counts[h] = c
                out.append(c >= self.min_frequency)
            while len(self._counts) > self.capacity:
                self._counts.popitem(last=False)
        return out


class RatioPolicy:
    """Pick a DP plan per offload: the configured default, a higher ratio under host-tier pressure, never above the
    accuracy floor's ``max_ratio``; and, for the ``raw_first`` policy, whether a blob may still be stored raw."""

    def __init__(
        self, available: Sequence[float], default: float, max_ratio: float | None = None, pressure_high: float = 0.9
    ) -> None:
        self.available = sorted(float(r) for r in available)
        if isinstance(default, str):  # "auto" reaches the tiers only resolved (the connector's start-up does it)
            raise ConfigError(f"ratio {default!r} is not resolved: pass the calibration's checked ratio")
        if float(default) not in self.available:
            raise ConfigError(f"default ratio {default:g} has no plan in the calibration; available: {self.available}")
        self.default = float(default)
        self.max_ratio = float(max_ratio) if max_ratio is not None else self.default
        self.pressure_high = pressure_high

    def room_for_raw(self, host_fill: float, share: float) -> bool:
        """Whether a blob of ``share`` of the host tier's capacity, stored raw, keeps the tier below
        ``pressure_high`` (the ``raw_first`` policy stores raw while it does, and compresses once it does not)."""
        return host_fill + share < self.pressure_high

    def choose(self, host_fill: float) -> float:
        if host_fill < self.pressure_high:
            return self.default
        higher = [r for r in self.available if self.default < r <= self.max_ratio]
        if not higher:
            return self.default
        # the fuller the tier, the further up the allowed ratios
        span = (host_fill - self.pressure_high) / max(1e-9, 1 - self.pressure_high)
        return higher[min(len(higher) - 1, int(span * len(higher)))]
