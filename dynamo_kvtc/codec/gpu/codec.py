"""The fused GPU codec behind the :class:`~dynamo_kvtc.codec.base.Codec` interface: all spans of an encode, or all
blobs of a restore, in one batch of the :class:`~.fused.FusedCodec` engine (one projection GEMM per K/V and layer, one
entropy call, device CRCs), reading from or writing straight into an engine's paged blocks where a
:class:`~dynamo_kvtc.codec.base.PagedView` is given.

It never falls back to the reference path: a failure raises (:class:`~dynamo_kvtc.codec.kvtc.KvtcCodec` decides
whether to fall back). Headers, blob checks and the configuration are its reference codec's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ...errors import DecodeError
from ..base import KV, Bad, BlobByBlob, Codec, Encoded, EncodeSpan, PagedView, Restore, RestoreRun
from ..checks import check_inputs
from .fused import FusedCodec
from .layouts import DenseKV, PagedBlocks, Span


def paged_blocks(paged: PagedView, seqs: Sequence[Sequence[int]]) -> PagedBlocks:
    """The fused kernels' view of an engine's paged cache over these block lists (one per sequence)."""
    return PagedBlocks(paged.layer_views, paged.num_layers, seqs)


class FusedKvtcCodec(Codec):
    """The fused path of one reference codec (``reference``: a :class:`~dynamo_kvtc.codec.reference.ReferenceCodec`
    of a calibration without per-layer token sets). ``strict``: a Triton stage failing raises instead of switching
    to the torch stages. ``fused`` is the engine (:class:`~.fused.FusedCodec`)."""

    def __init__(self, reference: Any, *, strict: bool = False, ops: str = "auto") -> None:
        self.reference = reference
        self.cal, self.fp, self.device = reference.cal, reference.fp, reference.device
        self.fused = FusedCodec(reference, ops=ops, strict=strict)

    @property
    def ratio(self) -> float:
        return self.reference.ratio

    def check_blob(self, blob: Any) -> tuple[dict[str, Any], list]:
        return self.reference.check_blob(blob)

    # ------------------------------------------------------------------ one blob
    def encode(self, keys: torch.Tensor, values: torch.Tensor, positions: Any, *, window: int | None = None) -> bytes:
        keys, values, pos = check_inputs(self.fp, keys, values, positions, finite=False)
        src = DenseKV(keys.to(self.device), values.to(self.device))
        blob = self.fused.encode_batch(src, [Span(0, 0, pos, window)])[0]
        self.reference.last_timings.update(self.fused.last_timings)
        return blob

    def decode_layers(self, blob: Any) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        job = self.fused.open([blob])  # parses, queues the copies; raises at once for a malformed or foreign blob
        return self._layers(job)

    def _layers(self, job) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        yield from job.layers()
        self.reference.last_timings.update(job.finish())

    # ------------------------------------------------------------------ batches
    def encode_spans(
        self,
        spans: Sequence[EncodeSpan],
        read: Callable[[int, int], KV],
        *,
        paged: PagedView | None = None,
        block_ids: Sequence[int] | None = None,
        views: bool = False,
    ) -> Encoded:
        if not spans:
            return Encoded([], True)
        off = 0
        if paged is not None and block_ids is not None:
            src = paged_blocks(paged, [list(block_ids)])
        else:
            off = spans[0].start
            k, v = read(off, spans[-1].end)
            src = DenseKV(k.to(self.device), v.to(self.device))
        batch = [Span(0, s.start - off, s.positions, s.window) for s in spans]
        blobs = self.fused.encode_batch(src, batch, views=views)
        return Encoded(blobs, True)

    def restore(self, runs: Sequence[RestoreRun], *, paged: PagedView | None = None, bad: Bad | None = None) -> Restore:
        if not runs:
            return BlobByBlob(self, [], bad)
        return FusedRestore(self.fused, list(runs), paged, bad)


class FusedRestore(Restore):
    """One fused restore: iterating it opens the job (every header checked; DecodeError at once, the bad blobs
    named) and then yields layer by layer. Its CRC verdict is taken on the device: a corrupt blob makes the job write
    nothing and surfaces after the last layer, where the bad blobs are named and reported."""

    fused = True

    def __init__(self, engine: FusedCodec, runs: list[RestoreRun], paged: PagedView | None, bad: Bad | None) -> None:
        self.engine, self.runs, self.paged = engine, runs, paged
        self.bad = bad or (lambda i, e: None)

    def __iter__(self) -> Iterator[tuple[int, list[KV] | None]]:
        try:
            job = self.engine.open([r.blob for r in self.runs])
        except DecodeError:
            for i, r in enumerate(self.runs):  # find the bad blob(s), as the reference path does
                try:
                    self.engine.open([r.blob])
                except DecodeError as e:
                    self.bad(i, e)
            raise
        return self._run(job)

    def _run(self, job) -> Iterator[tuple[int, list[KV] | None]]:
        try:
            yield from self._layers(job)
            job.finish()
        except DecodeError as e:
            for i in job.bad_blobs:
                self.bad(i, e)
            raise

    def _layers(self, job) -> Iterator[tuple[int, list[KV] | None]]:
        if self.paged is not None:
            bs = self.paged.block_size
            seqs, keep = [], []
            for i, r in enumerate(self.runs):
                first, count = r.start // bs, len(r.blocks)
                nblk = -(-job.tokens[i] // bs)
                seqs.append([r.blocks[b - first] if first <= b < first + count else 0 for b in range(nblk)])
                keep.append((r.start, r.start + r.tokens))
            dest = paged_blocks(self.paged, seqs)
            for layer in job.layers(dest=dest, targets=[(i, 0) for i in range(len(self.runs))], keep=keep):
                yield layer, None
        else:
            for layer, kbuf, vbuf in job.layers():
                parts = []
                for i, r in enumerate(self.runs):
                    a = job.bases[i] + r.start
                    parts.append((kbuf[a : a + r.tokens], vbuf[a : a + r.tokens]))
                yield layer, parts
