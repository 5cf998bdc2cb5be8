"""An FP8 KV cache as the input of any method (``dynamo-kvtc eval --kv-dtype fp8``): the context's K and V are rounded
through the cache's float8 format with one scale (vLLM's per-layer default without checkpoint scales: 1.0) before the
method sees them, and what the method gives back is written to FP8 again (a restore into an FP8 cache). Its ``vanilla``
row is the FP8-KV baseline. Byte counts are stated against the FP8 cache: one byte per element, half the 16-bit
accounting (the ``raw16_*`` fields then hold FP8 bytes); the kvtc blob keeps its window at 16 bits, as the
connector's blobs do."""

from __future__ import annotations

from dataclasses import replace

import torch

from ...codec import fp8
from .base import Method, Reconstruction


class Fp8Input(Method):
    def __init__(self, inner: Method, cache_dtype: str = "fp8", scale: float = 1.0) -> None:
        super().__init__(inner.window)
        self.inner, self.scale = inner, float(scale)
        self.fmt = fp8.kv_format(cache_dtype)
        self.name, self.family = inner.name, inner.family
        self.lossless = False  # the scores are compared with the FP8 vanilla row, which is scored too

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        return fp8.round_fp8(x, self.fmt, self.scale)

    def reconstruct(self, keys, values, positions) -> Reconstruction:
        rec = self.inner.reconstruct(self._round(keys), self._round(values), positions)
        return replace(
            rec,
            keys=self._round(rec.keys),
            values=self._round(rec.values),
            raw16_compressed=rec.raw16_compressed // 2,
            raw16_total=rec.raw16_total // 2,
        )
