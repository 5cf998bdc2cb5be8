"""kvtc: the real codec (encode -> blob -> decode), sinks in fp8, window raw; ratios from the blob itself.

``projection`` is the codec's projection precision (``fp16``: the float32 reference path, the definition of the
format; ``fp8``: the reference path emulating the fused path's e4m3 GEMM operands with row-wise scales), so the
accuracy cost of FP8 projections is measured on the CPU with the same blobs."""

from __future__ import annotations

from ...codec.kvtc import KvtcCodec
from .base import Method, Reconstruction


class Kvtc(Method):
    family = "kvtc"

    def __init__(
        self,
        calibration,
        ratio: float,
        *,
        window: int = 128,
        sinks: int = 4,
        label: str | None = None,
        projection: str = "fp16",
    ):
        super().__init__(window)
        self.codec = KvtcCodec(calibration, ratio=ratio, window=window, sinks=sinks, projection=projection)
        self.ratio_target = float(ratio)
        self.projection = projection
        self.name = label or f"kvtc-{ratio:g}x" + ("" if projection == "fp16" else f"-{projection}")

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
