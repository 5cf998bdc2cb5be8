"""Timing for ``bench gpu``: CUDA events (or a CPU stand-in for ``torch.cuda`` in the smoke run), a time budget,
and a guard that records an optional part's failure and goes on.

``cuda`` and ``PIN`` are switched once by ``bench.gpu`` (the CPU stand-in for the smoke run); other modules read them as
``gpu_timing.cuda`` at call time."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch


class CpuEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.t = time.perf_counter()

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: CpuEvent) -> float:
        return (other.t - self.t) * 1e3

    def synchronize(self) -> None:
        pass


class CpuStream:
    def __init__(self, device=None, priority: int = 0) -> None:
        pass

    def wait_event(self, ev) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuCuda:
    """Stand-in for torch.cuda in the CPU smoke run (DYN_KVTC_BENCH_SMOKE=1): exercises the benchmark's code on a
    machine without a GPU; its numbers mean nothing."""

    Event = CpuEvent
    Stream = CpuStream

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None):
        return CpuStream()

    @staticmethod
    def synchronize() -> None:
        pass

    @staticmethod
    def _sleep(n: int) -> None:
        time.sleep(0.05)

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def get_device_name(i: int = 0) -> str:
        return "cpu (smoke run)"


cuda: Any = torch.cuda
PIN = [True]


# ============================================================================================ timing helpers
def sync() -> None:
    cuda.synchronize()


def events_ms(fn, repeat: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeat):
        a, b = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def med(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


class Budget:
    """The benchmark's time budget: optional parts run while enough is left; parts named in ``skip`` never run."""

    def __init__(self, seconds: float, skip: tuple[str, ...] = ()) -> None:
        self.t0 = time.perf_counter()
        self.seconds = seconds
        self.skip = set(skip)
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def allow(self, what: str, need: float) -> bool:
        if what in self.skip:
            self.skipped.append(f"{what} (--skip)")
            return False
        if self.left() >= need:
            return True
        self.skipped.append(f"{what} (needs ~{need:.0f} s, {max(0.0, self.left()):.0f} s left)")
        print(f"  [budget] skipping {what}", flush=True)
        return False


def log_line(msg: str) -> None:
    print(msg, flush=True)


def guarded(results: dict, key: str, fn, *args):
    """Run an optional part; a failure is recorded and printed, and the run goes on."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - one part failing must not lose the others' numbers
        import traceback

        msg = f"{type(e).__name__}: {e}"
        results.setdefault("errors", {})[key] = {"error": msg, "traceback": traceback.format_exc()[-3000:]}
        log_line(f"  !! {key} failed: {msg}")
        cuda.empty_cache()
        return None
