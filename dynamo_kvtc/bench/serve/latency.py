"""What ``bench serve`` measures and reports: per-request token times, the step log, its stretch replay, the summary.

:class:`RequestMetrics` is one request's clock readings (TTFT, TPOT, inter-token latencies); :class:`StepLog` every
step's time and class, with a reservoir sample of each class's steps that the engine replays with the tier idle to
measure the *stretch* (how much longer steps took than the same steps without the tier's work); :func:`summarize`
turns a run's metrics into the per-run summary (hit rate, latency distributions, goodput against the SLOs), and
:class:`RunRecord` is one run as the JSON writes it. The loop that produces the readings is :mod:`.engine`.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STEP_CLASSES", "RequestMetrics", "RunRecord", "StepLog", "summarize"]


@dataclass
class RequestMetrics:
    """What one request saw: when it arrived (its dependency included), started, got its first token, finished;
    prompt and restored (hit) tokens, restore time, whether a restore failed (then recomputed), and when each of its
    tokens was generated (run clock; the first is ``first_token_s``)."""

    id: int
    session: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    start_s: float = 0.0
    first_token_s: float = 0.0
    finish_s: float = 0.0
    hit_tokens: int = 0
    restore_s: float = 0.0
    restore_failed: bool = False
    token_times: list[float] = field(default_factory=list, repr=False)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def itl_s(self) -> list[float]:
        """The gaps between consecutive tokens (inter-token latencies)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last token - first token) / (tokens - 1); None for one token."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    def to_json(self) -> dict[str, Any]:
        """The per-request record of the JSON (token times summarised as TPOT and the largest gap)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "token_times"}
        return {**d, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "itl_max_s": max(self.itl_s, default=None)}


STEP_CLASSES = ("restore", "tier", "idle")


class StepLog:
    """Every step's time and class, and a reservoir sample of each class's steps to replay with the tier idle.

    Classes: ``restore`` (a sequence of the batch waits for restored layers), ``tier`` (no restore in the batch, but
    the tier works meanwhile: an offload in flight or a restore of a sequence not in this step), ``idle`` (neither;
    its stretch is the measurement's own noise, ~1). The stretch of a class is its sampled steps' time in the run over
    their time replayed; the run's is the whole run's step time over the estimate without the tier's work
    (each class's time divided by its stretch)."""

    def __init__(self, samples: int, seed: int = 0) -> None:
        self.samples = samples
        self.rng = random.Random(seed)
        self.times: dict[str, list[float]] = {c: [] for c in STEP_CLASSES}
        self.kept: dict[str, list[tuple[list, float]]] = {c: [] for c in STEP_CLASSES}  # (batch, time in the run)
        self.replayed: dict[str, list[tuple[float, float]]] = {c: [] for c in STEP_CLASSES}  # (run, replay)

    def add(self, cls: str, batch: list, t: float) -> None:
        times, kept = self.times[cls], self.kept[cls]
        times.append(t)
        if len(kept) < self.samples:
            kept.append((batch, t))
        elif self.samples:
            j = self.rng.randrange(len(times))
            if j < self.samples:
                kept[j] = (batch, t)

    def replay(self, step) -> None:
        """``step(batch)`` -> seconds, for every kept step (then the batches are dropped)."""
        for c in STEP_CLASSES:
            self.replayed[c] = [(t, step(batch)) for batch, t in self.kept[c]]
            self.kept[c] = []

    def stretch(self, cls: str) -> float | None:
        r = self.replayed[cls]
        return sum(t for t, _ in r) / max(sum(x for _, x in r), 1e-12) if r else None

    def summary(self) -> dict[str, Any]:
        total = sum(sum(v) for v in self.times.values())
        est, known = 0.0, True
        by: dict[str, Any] = {}
        for c in STEP_CLASSES:
            ts, st = self.times[c], self.stretch(c)
            rep = [x for _, x in self.replayed[c]]
            by[c] = {
                "steps": len(ts),
                "time_s": sum(ts),
                "sampled": len(rep),
                "stretch": st,
                "time_mean_s": statistics.fmean(ts) if ts else None,
                "replay_mean_s": statistics.fmean(rep) if rep else None,
            }
            if ts:
                known = known and st is not None
                est += sum(ts) / st if st else 0.0
        all_t = [t for v in self.times.values() for t in v]
        return {
            "steps": len(all_t),
            "time_s": total,
            "time_p50_s": _pct(all_t, 0.5),
            "time_p99_s": _pct(all_t, 0.99),
            "stretch": total / est if known and est > 0 else None,
            "by_class": by,
        }


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(prefix: str, xs: list[float]) -> dict[str, float | None]:
    """``{prefix}_mean_s``, ``_p50_s``, ``_p90_s``, ``_p99_s`` of ``xs`` (None when empty)."""
    if not xs:
        return {f"{prefix}_{k}_s": None for k in ("mean", "p50", "p90", "p99")}
    return {
        f"{prefix}_mean_s": statistics.fmean(xs),
        f"{prefix}_p50_s": _pct(xs, 0.5),
        f"{prefix}_p90_s": _pct(xs, 0.9),
        f"{prefix}_p99_s": _pct(xs, 0.99),
    }


def summarize(
    ms: list[RequestMetrics], slo_s: float, slo_tpot_s: float = 0.1, steps: StepLog | None = None
) -> dict[str, Any]:
    """Per run: hit rate (restored / prompt tokens), mean/p50/p90/p99 TTFT, TPOT (per request: time per output token
    after the first) and ITL (every gap between two tokens of a request, pooled over the run: what a streaming client
    sees), output tokens/s over the run's span, goodput (requests/s whose TTFT met ``slo_s``) and the fraction that met
    it, the same for TTFT and TPOT together (``slo_tpot_s``; a one-token reply meets any TPOT SLO), mean restore
    time of the hits, and with ``steps`` the step times and the stretch (:class:`StepLog`)."""
    if not ms:
        return {}
    ttft = [m.ttft_s for m in ms]
    tpot = [t for m in ms if (t := m.tpot_s) is not None]
    itl = [g for m in ms for g in m.itl_s]
    span = max(m.finish_s for m in ms) - min(m.arrival_s for m in ms)
    ok = sum(t <= slo_s for t in ttft)
    both = sum(m.ttft_s <= slo_s and (m.tpot_s is None or m.tpot_s <= slo_tpot_s) for m in ms)
    tpot_ok = sum(m.tpot_s is None or m.tpot_s <= slo_tpot_s for m in ms)
    hits = [m for m in ms if m.hit_tokens]
    out = {
        "requests": len(ms),
        "hit_rate": sum(m.hit_tokens for m in ms) / max(1, sum(m.prompt_tokens for m in ms)),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p90_s": _pct(ttft, 0.9),
        "ttft_p99_s": _pct(ttft, 0.99),
        **_dist("tpot", tpot),
        **_dist("itl", itl),
        "itl_max_s": max(itl, default=None),
        "output_tok_s": sum(m.output_tokens for m in ms) / max(span, 1e-9),
        "goodput_rps": ok / max(span, 1e-9),
        "slo_attainment": ok / len(ms),
        "slo_s": slo_s,
        "slo_tpot_s": slo_tpot_s,
        "tpot_slo_attainment": tpot_ok / len(ms),
        "goodput_ttft_tpot_rps": both / max(span, 1e-9),
        "slo_ttft_tpot_attainment": both / len(ms),
        "restore_mean_s": statistics.fmean(m.restore_s for m in hits) if hits else 0.0,
        "restore_failures": sum(m.restore_failed for m in ms),
        "span_s": span,
    }
    if steps is not None:
        st = steps.summary()
        out["step_stretch"] = st["stretch"]
        out["steps"] = st
    return out


@dataclass
class RunRecord:
    """One (system, host budget[, arrival rate]) run: the summary and the per-request metrics (``metrics``: the same
    with every token's time, in memory only; the JSON has ``requests``)."""

    system: str
    budget_fraction: float | None
    host_bytes: int
    summary: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)
    store: dict[str, Any] = field(default_factory=dict)
    qps: float | None = None  # the workload's arrival rate, when a --qps sweep set it
    metrics: list[RequestMetrics] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "metrics"}
