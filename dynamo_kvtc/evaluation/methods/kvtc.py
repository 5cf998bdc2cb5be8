"""kvtc: the real codec (encode -> blob -> decode), sinks in fp8, window raw; ratios from the blob itself.

With a calibration that has per-layer token sets a sliding-window layer gets back only the tokens it keeps (the last
ones); its earlier tokens are left zero in the reconstruction (the scoring cache drops them, as the model does), and
the ratios count the tokens the layers hold.

``projection`` is the codec's projection precision (``fp16``: the float32 reference path, the definition of the
format; ``fp8``: the reference path emulating the fused path's e4m3 GEMM operands with row-wise scales), so the
accuracy cost of FP8 projections is measured on the CPU with the same blobs."""

from __future__ import annotations

import torch

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
        device: str = "cpu",
    ):
        super().__init__(window)
        self.codec = KvtcCodec(
            calibration, ratio=ratio, device=device, window=window, sinks=sinks, projection=projection
        )
        self.ratio_target = float(ratio)
        self.projection = projection
        self.name = label or f"kvtc-{ratio:g}x" + ("" if projection == "fp16" else f"-{projection}")

    def reconstruct(self, keys, values, positions) -> Reconstruction:
        blob = self.codec.encode(keys, values, positions)
        if self.codec.token_sets:
            k2, v2 = torch.zeros_like(keys), torch.zeros_like(values)
            for layer, (kl, vl) in enumerate(self.codec.decode_ragged(blob)):  # each layer's own last tokens
                k2[layer, keys.shape[1] - kl.shape[0] :] = kl
                v2[layer, keys.shape[1] - vl.shape[0] :] = vl
        else:
            k2, v2 = self.codec.decode(blob)
        st = self.codec.stats(blob)
        stored = st["stored_bytes"]
        return Reconstruction(
            k2,
            v2,
            st["held_compressed_bytes_16bit"],  # sinks and coded tokens, as the layers hold them
            stored["sinks"] + stored["k"] + stored["v"],
            st["held_bytes_16bit"],
            sum(stored.values()),
        )
