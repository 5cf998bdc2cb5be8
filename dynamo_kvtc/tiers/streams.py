"""The CUDA streams the tiers' workers run the codec on: lowest priority, and optionally an SM-bounded partition.

With ``codec_sms=N`` (``DYN_KVTC_CODEC_SMS``, read at start-up into :class:`~.config.TierConfig`) the offload and
onboard workers' streams belong to a CUDA green context of N SMs (``torch.cuda.green_contexts``), so restores and
offloads never occupy more than N SMs and the engine's forward pass keeps the rest; the codec then runs slower, the
forward pass is stretched less (docs/performance.md has the curve). Where green contexts are unavailable (no driver
support, torch built without them) the stream is an ordinary lowest-priority one and the reason is logged once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_CONTEXTS: dict[tuple[int, int], Any] = {}  # (device index, SMs) -> green context (kept alive for its streams)
_WARNED: set[str] = set()


def green_stream(device: torch.device, sms: int) -> torch.cuda.Stream | None:
    """A new stream in a green context of ``sms`` SMs on ``device`` (contexts are shared per size), or None with the
    reason logged once when that is not possible here."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        from torch.cuda import green_contexts

        with _LOCK:
            ctx = _CONTEXTS.get((index, sms))
            if ctx is None:
                ctx = _CONTEXTS[(index, sms)] = green_contexts.GreenContext.create(sms, index)
        if hasattr(ctx, "Stream"):
            return ctx.Stream()
        ctx.make_current()  # older API: streams made while the green context is current belong to it
        try:
            return torch.cuda.Stream(device)
        finally:
            ctx.pop_current()
    except Exception as e:  # noqa: BLE001 - optional feature of the driver and of the torch build
        why = f"{type(e).__name__}: {e}"
        if why not in _WARNED:
            _WARNED.add(why)
            log.warning("kvtc: no green context of %d SMs (%s); the codec shares all SMs at low priority", sms, why)
        return None


def codec_stream(device: torch.device, sms: int = 0) -> torch.cuda.Stream | None:
    """The stream a tier worker runs the codec on (None on the CPU): in a green context of ``sms`` SMs when asked
    (the tiers' ``TierConfig.codec_sms``), else the lowest priority stream of the device."""
    if device.type != "cuda":
        return None
    if sms:
        stream = green_stream(device, int(sms))
        if stream is not None:
            return stream
    return torch.cuda.Stream(device, priority=0)
