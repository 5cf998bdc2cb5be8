"""Spans of one sequence to blobs and back, through one interface whichever path does the work.

:class:`SpanCoder` encodes several spans of a sequence into one blob each, and restores runs of blobs layer by layer.
Where the codec's fused GPU path is on (:attr:`KvtcCodec.fused <dynamo_kvtc.codec.kvtc.KvtcCodec.fused>`) all spans
or all blobs go through it in one batch (one projection GEMM per K/V and layer, one entropy call, device CRCs), reading
from or writing straight into an engine's paged blocks where a :class:`PagedView` is given; otherwise, or when the
fused path fails unexpectedly (the codec then turns it off: ``codec.disable_fused``), the reference path encodes and
decodes blob by blob. Both write and read the same blobs.

This module sits below the tiers: it knows tensors, blobs and (through :class:`PagedView`) paged blocks, never blob
ids, tiers or stores. Callers learn which blob was bad through a callback and drop it themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DecodeError, KvtcError, TierError
from .blob import BlobView

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PagedView:
    """An engine's paged cache as the fused kernels address it: ``layer_views(layer) -> (k, v)``, each
    ``[num_blocks, block_size, H, D]`` (any strides, K and V alike)."""

    layer_views: Callable[[int], KV]
    num_layers: int
    block_size: int

    def blocks(self, seqs: Sequence[Sequence[int]]) -> Any:
        """A :class:`~dynamo_kvtc.codec.gpu.PagedBlocks` over these block lists (one per sequence)."""
        from .gpu import PagedBlocks

        return PagedBlocks(self.layer_views, self.num_layers, seqs)


@dataclass
class EncodeSpan:
    """Tokens ``start .. start + len(positions)`` of the sequence, at absolute ``positions``; ``window``: trailing
    tokens kept raw (None: the codec's configured window)."""

    start: int
    positions: torch.Tensor
    window: int | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.positions)


@dataclass
class RestoreRun:
    """Tokens ``start .. start + tokens`` of ``blob`` to restore; ``blocks``: the destination blocks of those tokens
    (one per ``block_size`` tokens) when restoring into a :class:`PagedView`. ``blob``: a
    :class:`~dynamo_kvtc.codec.blob.BlobView` (or what :meth:`BlobView.of` takes), read in place where it lies
    (pinned host memory: copied to the device asynchronously, so the caller keeps those bytes unchanged until the
    restore finished)."""

    blob: Any

    def __post_init__(self) -> None:
        self.blob = BlobView.of(self.blob)

    start: int
    tokens: int
    blocks: Sequence[int] | None = None


@dataclass
class Encoded:
    """The blobs of an encode, in span order: a list made by one fused batch (``fused``), else an iterator that
    encodes each blob on the reference path as it is taken (a caller can keep each before the next is made)."""

    blobs: Iterable[bytes]
    fused: bool


class SpanCoder:
    """Chooses between the fused and the reference path for batches of spans and blobs of one codec.

    Owns nothing but the choice: the codec keeps its own state (including whether the fused path is still on). It
    never reads a tier, never names a blob id, and never writes a byte of a blob that fails verification."""

    def __init__(self, codec: Any) -> None:
        self.codec = codec

    # ------------------------------------------------------------------ encode
    def encode(
        self,
        spans: Sequence[EncodeSpan],
        read: Callable[[int, int], KV],
        *,
        paged: PagedView | None = None,
        block_ids: Sequence[int] | None = None,
        views: bool = False,
    ) -> Encoded:
        """One blob per span (see :class:`Encoded`). ``read(a, b)`` returns K/V ``[L, b - a, H, D]`` of the
        sequence's tokens a..b (a view or a gathered copy); with ``paged`` and ``block_ids`` (token t in block
        ``block_ids[t // block_size]``) the fused path reads the engine's blocks in place. ``views``: the fused
        path's blobs are memoryviews valid until the next ``views`` encode on this codec (the caller copies them
        out first; see :meth:`FusedCodec.encode_batch`)."""
        blobs = self._encode_fused(spans, read, paged, block_ids, views)
        if blobs is not None:
            return Encoded(blobs, True)
        return Encoded(self._encode_each(spans, read), False)

    def _encode_each(self, spans: Sequence[EncodeSpan], read: Callable[[int, int], KV]) -> Iterator[bytes]:
        for s in spans:
            k, v = read(s.start, s.end)
            yield self.codec.encode(k, v, s.positions, window=s.window)

    def _encode_fused(self, spans, read, paged, block_ids, views: bool = False) -> list[bytes] | None:
        fc = self.codec.fused
        if fc is None or not spans:
            return None
        from .gpu import DenseKV, Span

        dev = self.codec.device
        try:
            off = 0
            if paged is not None and block_ids is not None:
                src = paged.blocks([list(block_ids)])
            else:
                off = spans[0].start
                k, v = read(off, spans[-1].end)
                src = DenseKV(k.to(dev), v.to(dev))
            return fc.encode_batch(src, [Span(0, s.start - off, s.positions, s.window) for s in spans], views=views)
        except KvtcError:
            raise
        except Exception as e:  # noqa: BLE001 - the reference path is always there
            self.codec.disable_fused("batch encode", e)
            return None

    # ------------------------------------------------------------------ restore
    def restore(
        self,
        runs: Sequence[RestoreRun],
        *,
        paged: PagedView | None = None,
        bad: Callable[[int, DecodeError], None] | None = None,
    ) -> SpanRestore:
        """Layer by layer, every run of every blob: iterate the result for ``(layer, parts)``, ``parts`` holding
        ``(k, v)`` ``[tokens, H, D]`` per run, or None when the layer was written straight into ``paged`` (fused
        path only; runs then carry their ``blocks``). Every blob is verified before anything of it is used: the
        reference path and tensor outputs check before the first layer is yielded; writes into ``paged`` are gated
        on the device by the CRC verdict (a corrupt blob writes nothing) and the verdict surfaces when the iteration
        ends — so a restore counts as done only once the iteration completed without error. ``bad(i, error)`` is told
        of each blob found corrupt (then DecodeError is raised)."""
        return SpanRestore(self.codec, list(runs), paged, bad)


class SpanRestore:
    """One restore in progress (iterate it once, on the stream the writes belong to). ``fused`` tells, once the
    first layer came out, whether the fused path did the work."""

    def __init__(self, codec: Any, runs: list[RestoreRun], paged: PagedView | None, bad) -> None:
        self.codec = codec
        self.runs = runs
        self.paged = paged
        self.bad = bad or (lambda i, e: None)
        self.fused = False

    def __iter__(self) -> Iterator[tuple[int, list[KV] | None]]:
        job = self._open_fused()
        if job is None:
            return self._reference()
        self.fused = True
        return self._fused(job)

    def _open_fused(self) -> Any:
        fc = self.codec.fused  # None for a codec whose calibration has per-layer token sets (reference path only)
        if fc is None or not self.runs:
            return None
        try:
            return fc.open([r.blob for r in self.runs])
        except DecodeError:
            for i, r in enumerate(self.runs):  # find the bad blob(s), as the reference path does
                try:
                    fc.open([r.blob])
                except DecodeError as e:
                    self.bad(i, e)
            raise
        except KvtcError:
            raise
        except Exception as e:  # noqa: BLE001 - the reference path is always there
            self.codec.disable_fused("batch restore", e)
            return None

    def _fused(self, job) -> Iterator[tuple[int, list[KV] | None]]:
        """The fused restore. Its CRC verdict is taken on the device: a corrupt blob makes the job write nothing
        and surfaces from ``job.finish()`` (after the last layer), where the bad blobs are named and reported."""
        try:
            yield from self._fused_layers(job)
            job.finish()
        except DecodeError as e:
            for i in getattr(job, "bad_blobs", ()):
                self.bad(i, e)
            raise

    def _fused_layers(self, job) -> Iterator[tuple[int, list[KV] | None]]:
        if self.paged is not None:
            bs = self.paged.block_size
            seqs, keep = [], []
            for i, r in enumerate(self.runs):
                first, count = r.start // bs, len(r.blocks)
                nblk = -(-job.tokens[i] // bs)
                seqs.append([r.blocks[b - first] if first <= b < first + count else 0 for b in range(nblk)])
                keep.append((r.start, r.start + r.tokens))
            dest = self.paged.blocks(seqs)
            for layer in job.layers(dest=dest, targets=[(i, 0) for i in range(len(self.runs))], keep=keep):
                yield layer, None
        else:
            for layer, kbuf, vbuf in job.layers():
                parts = []
                for i, r in enumerate(self.runs):
                    a = job.bases[i] + r.start
                    parts.append((kbuf[a : a + r.tokens], vbuf[a : a + r.tokens]))
                yield layer, parts

    def _reference(self) -> Iterator[tuple[int, list[KV] | None]]:
        gens, ranges = [], []
        for i, r in enumerate(self.runs):
            try:
                gens.append(self.codec.decode_layers(r.blob.host()))  # validates the whole blob
                # per-layer token sets: each layer holds only tokens [start, stop) of its blob
                ranges.append(self.codec.layer_ranges(r.blob.host()) if self.codec.token_sets else None)
            except DecodeError as e:
                self.bad(i, e)
                raise
        for layer in range(self.codec.fp.num_layers):
            parts = []
            for i, (gen, r) in enumerate(zip(gens, self.runs)):
                got_layer, k, v = next(gen)
                if got_layer != layer:
                    raise TierError(f"decoder produced layer {got_layer}, expected {layer}")
                a = 0 if ranges[i] is None else ranges[i][layer][0]
                if r.start < a:  # never hand out tokens a layer does not hold
                    raise TierError(
                        f"layer {layer} of blob {i} holds its tokens {a}.. only (per-layer token sets); "
                        f"the run asks from token {r.start}"
                    )
                parts.append((k[r.start - a : r.start - a + r.tokens], v[r.start - a : r.start - a + r.tokens]))
            yield layer, parts
