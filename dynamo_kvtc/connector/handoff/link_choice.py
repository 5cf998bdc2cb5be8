"""Raw KV or compressed blobs for a prefill->decode hand-off: an estimate per peer link, a choice per request.

For a prompt of ``raw`` bytes of 16-bit KV that KVTC stores in ``compressed`` bytes, over a link of ``bw`` bytes/s:

- raw time        = raw / bw                                  (vLLM's NixlConnector: one READ, all layers at once)
- compressed time = compressed / bw + compressed / staging_rate + raw / restore_rate
                                                              (the READ, the fetch's other work — control round trip,
                                                              the prefill side's staging copy, the copy out of the
                                                              receive buffer — then the restore of every layer)

and the cheaper one wins. ``bw`` is, in order: ``link_gbps`` (``DYN_KVTC_LINK_GBPS``, Gbit/s, the whole deployment's
link; read at start-up into the ConnectorConfig), else an EWMA of the bytes/s of this peer's completed READs (learned
from the transfers themselves, raw or compressed), else unknown — then the choice is compressed (the safe side across
nodes: it moves 14-17x fewer bytes). ``restore_rate`` (bytes of raw KV restored per second) is ``handoff_restore_gbs``
(``DYN_KVTC_HANDOFF_RESTORE_GBS``, GB/s), else an EWMA of observed restores, else a guess for the device (80 GB/s on a
GPU — one H200 restores 10 GiB in 124 ms; 40 MB/s on a CPU). ``staging_rate`` (compressed bytes per second of a fetch's
non-READ work) is learned from fetches (0 until then).

On one NVLink host (270-360 GB/s) raw wins by far; at 100-400 Gb/s between nodes the compressed hand-off wins for
long prompts. The first choice for a peer, and every change of it, is logged once.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

RAW, COMPRESSED = "raw", "compressed"
GPU_RESTORE_GBS = 80.0  # guess before a restore was observed: H200, NeMo-12B 8x8K (10 GiB) restored in 124 ms
CPU_RESTORE_GBS = 0.04  # the float32 reference path on two cores


@dataclass(frozen=True)
class LinkChoice:
    """One request's choice and the estimate behind it (seconds; ``link_gbps`` in Gbit/s, 0 when unknown)."""

    peer: str
    choice: str  # "raw" | "compressed"
    raw_s: float
    compressed_s: float
    link_gbps: float
    link_source: str  # "setting" | "learned" | "unknown"
    raw_bytes: int
    compressed_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Peer:
    bw: float = 0.0  # bytes/s, EWMA of observed READs
    samples: int = 0
    choices: dict[str, int] = field(default_factory=lambda: {RAW: 0, COMPRESSED: 0})
    last: LinkChoice | None = None


class LinkPolicy:
    """Per-peer link estimates and the raw-vs-compressed choice made from them.

    Owns the estimates only (thread-safe); it moves no bytes and never sees KV. Callers report completed READs
    (:meth:`observe`) and restores (:meth:`observe_restore`) and ask :meth:`choose` before a hand-off."""

    def __init__(
        self, link_gbps: float | None = None, restore_gbs: float | None = None, *, gpu: bool = True, alpha: float = 0.3
    ) -> None:
        if link_gbps is not None and not link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0, got {link_gbps!r}")
        if restore_gbs is not None and not restore_gbs > 0:
            raise ValueError(f"restore_gbs must be > 0, got {restore_gbs!r}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.link_bps = link_gbps * 1e9 / 8 if link_gbps else None  # bytes/s
        self._restore_fixed = restore_gbs * 1e9 if restore_gbs else None
        self._restore = 0.0
        self._staging = 0.0  # bytes/s of a fetch's work besides the READ; 0: not observed yet
        self._restore_guess = (GPU_RESTORE_GBS if gpu else CPU_RESTORE_GBS) * 1e9
        self.alpha = alpha
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: Any, *, gpu: bool) -> LinkPolicy:
        """The policy of a ConnectorConfig's ``link_gbps`` and ``handoff_restore_gbs`` (``DYN_KVTC_LINK_GBPS``,
        ``DYN_KVTC_HANDOFF_RESTORE_GBS``, parsed at start-up; 0: learn)."""
        return cls(cfg.link_gbps or None, cfg.handoff_restore_gbs or None, gpu=gpu)

    # ------------------------------------------------------------------ learning
    def observe(self, peer: str, nbytes: int, seconds: float) -> None:
        """A completed READ of ``nbytes`` from ``peer`` that took ``seconds`` (wire time, no staging)."""
        if nbytes <= 0 or not seconds > 0:
            return
        rate = nbytes / seconds
        with self._lock:
            p = self._peers.setdefault(peer, _Peer())
            p.bw = self._ewma(p.bw if p.samples else 0.0, rate)
            p.samples += 1

    def observe_restore(self, raw_bytes: int, seconds: float) -> None:
        """A compressed restore that produced ``raw_bytes`` of 16-bit KV in ``seconds`` (all layers)."""
        if raw_bytes <= 0 or not seconds > 0:
            return
        with self._lock:
            self._restore = self._ewma(self._restore, raw_bytes / seconds)

    def observe_staging(self, nbytes: int, seconds: float) -> None:
        """A fetch of ``nbytes`` compressed bytes spent ``seconds`` besides its READ (control, staging, copies)."""
        if nbytes <= 0 or not seconds > 0:
            return
        with self._lock:
            self._staging = self._ewma(self._staging, nbytes / seconds)

    def _ewma(self, old: float, rate: float) -> float:
        """The running estimate after one more observed ``rate`` (the first observation, ``old`` 0, is taken as is)."""
        return rate if old == 0 else (1 - self.alpha) * old + self.alpha * rate

    # ------------------------------------------------------------------ estimates
    def link(self, peer: str) -> tuple[float, str]:
        """(bytes/s, where it comes from) of the link to ``peer``; (0, "unknown") before anything is known."""
        if self.link_bps:
            return self.link_bps, "setting"
        with self._lock:
            p = self._peers.get(peer)
            if p is not None and p.samples:
                return p.bw, "learned"
        return 0.0, "unknown"

    @property
    def restore_rate(self) -> float:
        """Bytes of raw KV the compressed path restores per second (setting, else learned, else the guess)."""
        return self._restore_fixed or self._restore or self._restore_guess

    def estimate(self, peer: str, raw_bytes: int, compressed_bytes: int) -> LinkChoice:
        """The two estimated times and the choice, without recording it."""
        bw, src = self.link(peer)
        restore = raw_bytes / self.restore_rate + (compressed_bytes / self._staging if self._staging else 0.0)
        if bw > 0:
            raw_s, comp_s = raw_bytes / bw, compressed_bytes / bw + restore
            choice = RAW if raw_s <= comp_s else COMPRESSED
        else:
            raw_s, comp_s, choice = float("inf"), float("inf"), COMPRESSED
        return LinkChoice(peer, choice, raw_s, comp_s, bw * 8 / 1e9, src, raw_bytes, compressed_bytes)

    def choose(self, peer: str, raw_bytes: int, compressed_bytes: int) -> LinkChoice:
        """:meth:`estimate`, counted per peer (metrics) and logged the first time and whenever it changes."""
        c = self.estimate(peer, raw_bytes, compressed_bytes)
        with self._lock:
            p = self._peers.setdefault(peer, _Peer())
            p.choices[c.choice] += 1
            changed = p.last is None or p.last.choice != c.choice
            p.last = c
        if changed:
            log.info(
                "kvtc hand-off to/from %s: %s (link %.1f Gb/s %s; est. raw %.1f ms, compressed %.1f ms for %d -> %d "
                "bytes)",
                peer, c.choice, c.link_gbps, c.link_source, 1e3 * c.raw_s, 1e3 * c.compressed_s,
                raw_bytes, compressed_bytes,
            )  # fmt: skip
        return c

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per peer: ``link_gbps``, ``samples``, ``choices`` (counts) and ``last`` (the last choice as a dict)."""
        with self._lock:
            peers = {k: (p.bw, p.samples, dict(p.choices), p.last) for k, p in self._peers.items()}
        out = {}
        for k, (bw, n, choices, last) in peers.items():
            out[k] = {
                "link_gbps": (self.link_bps or bw) * 8 / 1e9,
                "samples": n,
                "choices": choices,
                "last": last.to_dict() if last is not None else None,
            }
        return out
