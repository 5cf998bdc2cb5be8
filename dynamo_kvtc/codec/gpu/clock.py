"""Stage timings of the fused codec: CUDA events on the stream (no synchronisation) or the host clock."""

from __future__ import annotations

import time
from typing import Any

import torch


class Clock:
    """Stage marks on the stream (CUDA events: no synchronisation) or the host clock (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def stages(self) -> dict[str, float]:
        """Seconds between consecutive marks, keyed by the later mark's name (summed when a name repeats)."""
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[name] = out.get(name, 0.0) + dt
        return out

    def since_start(self, name: str) -> float | None:
        first = self.marks[0][1]
        for n, ev in self.marks:
            if n == name:
                return first.elapsed_time(ev) / 1e3 if self.cuda else ev - first
        return None
