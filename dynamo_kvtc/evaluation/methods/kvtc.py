"""kvtc: the real codec (encode -> blob -> decode), sinks in fp8, window raw; ratios from the blob itself."""

from __future__ import annotations

from ...codec.kvtc import KvtcCodec
from .base import Method, Reconstruction


class Kvtc(Method):
    family = "kvtc"

    def __init__(self, calibration, ratio: float, *, window: int = 128, sinks: int = 4, label: str | None = None):
        super().__init__(window)
        self.codec = KvtcCodec(calibration, ratio=ratio, window=window, sinks=sinks)
        self.ratio_target = float(ratio)
        self.name = label or f"kvtc-{ratio:g}x"

    def reconstruct(self, keys, values, positions) -> Reconstruction:
        blob = self.codec.encode(keys, values, positions)
        k2, v2 = self.codec.decode(blob)
        st = self.codec.stats(blob)
        per_tok16 = st["raw_bytes_16bit"] // st["tokens"]
        comp_tokens = st["sink_tokens"] + st["coded_tokens"]
        stored = st["stored_bytes"]
        return Reconstruction(
            k2,
            v2,
            per_tok16 * comp_tokens,
            stored["sinks"] + stored["k"] + stored["v"],
            st["raw_bytes_16bit"],
            sum(stored.values()),
        )
