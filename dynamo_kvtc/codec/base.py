"""The codec interface the tiers use: :class:`Codec`, and the records that cross it.

A codec encodes the spans of a sequence into one blob each (:meth:`Codec.encode_spans`) and restores runs of blobs
layer by layer (:meth:`Codec.restore`); beside that it names its ratio and calibration and checks blobs. Three
implementations, chosen once by :func:`~dynamo_kvtc.codec.factory.make_codec`:

- the reference codec (:class:`~dynamo_kvtc.codec.reference.ReferenceCodec`: float32 on any device, the definition
  of the format), with the fused GPU path in front where the options choose it
  (:class:`~dynamo_kvtc.codec.kvtc.KvtcCodec`: the one place that falls back from the fused path to the reference
  one);
- the fused GPU codec (:class:`~dynamo_kvtc.codec.gpu.codec.FusedKvtcCodec`: all spans or all blobs in one batch,
  reading from or writing straight into an engine's paged blocks where a :class:`PagedView` is given);
- the tensor-parallel codec (:class:`~dynamo_kvtc.codec.sharded.ShardedKvtcCodec`: one rank's heads, the joint blob).

Every implementation writes and reads the same blobs. Blobs come in as :class:`~dynamo_kvtc.codec.blob.BlobView`.
This module sits below the tiers: it knows tensors, blobs and (through :class:`PagedView`) paged blocks, never blob
ids, tiers or stores. Callers learn which blob was bad through a callback and drop it themselves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DecodeError, TierError
from .blob import BlobView

KV = tuple[torch.Tensor, torch.Tensor]
Bad = Callable[[int, DecodeError], None]


@dataclass
class PagedView:
    """An engine's paged cache as the fused kernels address it: ``layer_views(layer) -> (k, v)``, each
    ``[num_blocks, block_size, H, D]`` (any strides, K and V alike)."""

    layer_views: Callable[[int], KV]
    num_layers: int
    block_size: int


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
    start: int
    tokens: int
    blocks: Sequence[int] | None = None

    def __post_init__(self) -> None:
        self.blob = BlobView.of(self.blob)


@dataclass
class Encoded:
    """The blobs of an encode, in span order: a list made by one fused batch (``fused``), else an iterator that
    encodes each blob on the reference path as it is taken (a caller can keep each before the next is made)."""

    blobs: Iterable[bytes]
    fused: bool


class Restore:
    """One restore in progress: iterate it once (on the stream the writes belong to) for ``(layer, parts)``;
    ``fused`` tells, once the first layer came out, whether the fused path did the work."""

    fused = False

    def __iter__(self) -> Iterator[tuple[int, list[KV] | None]]:
        raise NotImplementedError


class Codec(ABC):
    """What every codec offers. Implementations set ``cal`` (the calibration), ``fp`` (its fingerprint), ``device``
    and ``ratio``; ``token_sets`` is True where layers hold different token sets (reference path only)."""

    cal: Any
    fp: Any
    device: torch.device
    token_sets = False
    fused: Any = None  # the fused engine doing the work (:class:`~dynamo_kvtc.codec.gpu.FusedCodec`), or None

    @property
    @abstractmethod
    def ratio(self) -> float: ...

    @property
    def calibration_id(self) -> str:
        return self.cal.id

    @abstractmethod
    def check_blob(self, blob: Any) -> tuple[dict[str, Any], list]:
        """Parse a blob (bytes-like) and check it fits this codec (DecodeError otherwise): ``(header, sections)``."""

    @abstractmethod
    def encode(self, keys: torch.Tensor, values: torch.Tensor, positions: Any, *, window: int | None = None) -> bytes:
        """One blob of ``keys``/``values`` ``[L, T, H, D]`` at absolute ``positions``."""

    @abstractmethod
    def decode_layers(self, blob: Any) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(layer, keys, values)`` in layer order; the whole blob is verified before the first layer."""

    def decode(self, blob: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = [], []
        for _, k, v in self.decode_layers(blob):
            ks.append(k)
            vs.append(v)
        return torch.stack(ks), torch.stack(vs)

    def layer_ranges(self, blob: Any) -> list[tuple[int, int]]:
        """``(start, stop)`` token indices each layer of ``blob`` holds (every layer all of them by default)."""
        h, _ = self.check_blob(blob)
        return [(0, h["tokens"])] * h["layers"]

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
        """One blob per span (see :class:`Encoded`). ``read(a, b)`` returns K/V ``[L, b - a, H, D]`` of the
        sequence's tokens a..b (a view or a gathered copy); with ``paged`` and ``block_ids`` (token t in block
        ``block_ids[t // block_size]``) a fused codec reads the engine's blocks in place. ``views``: a fused codec's
        blobs are memoryviews valid until the next ``views`` encode on it (the caller copies them out first).
        Here: blob by blob, each encoded as it is taken."""
        return Encoded(self._each(spans, read), False)

    def _each(self, spans: Sequence[EncodeSpan], read: Callable[[int, int], KV]) -> Iterator[bytes]:
        for s in spans:
            k, v = read(s.start, s.end)
            yield self.encode(k, v, s.positions, window=s.window)

    def restore(self, runs: Sequence[RestoreRun], *, paged: PagedView | None = None, bad: Bad | None = None) -> Restore:
        """Layer by layer, every run of every blob: iterate the result for ``(layer, parts)``, ``parts`` holding
        ``(k, v)`` ``[tokens, H, D]`` per run, or None when the layer was written straight into ``paged`` (fused
        codec only; runs then carry their ``blocks``). Every blob is verified before anything of it is used; a
        restore counts as done only once the iteration completed without error. ``bad(i, error)`` is told of each
        blob found corrupt (then DecodeError is raised). Here: blob by blob through :meth:`decode_layers`."""
        return BlobByBlob(self, list(runs), bad)


class BlobByBlob(Restore):
    """The restore of a codec that decodes one blob at a time (every blob verified before the first layer)."""

    def __init__(self, codec: Codec, runs: list[RestoreRun], bad: Bad | None) -> None:
        self.codec, self.runs = codec, runs
        self.bad = bad or (lambda i, e: None)

    def __iter__(self) -> Iterator[tuple[int, list[KV] | None]]:
        gens, ranges = [], []
        for i, r in enumerate(self.runs):
            try:
                gens.append(self.codec.decode_layers(r.blob.host()))  # validates the whole blob
                # per-layer token sets: each layer holds only tokens [start, stop) of its blob
                ranges.append(self.codec.layer_ranges(r.blob.host()) if self.codec.token_sets else None)
            except DecodeError as e:
                self.bad(i, e)
                raise
        return self._layers(gens, ranges)

    def _layers(self, gens, ranges) -> Iterator[tuple[int, list[KV] | None]]:
        for layer in range(self.codec.fp.num_layers):
            parts = []
            for i, (gen, r) in enumerate(zip(gens, self.runs)):
                got_layer, k, v = next(gen)
                if got_layer != layer:
                    raise TierError(f"decoder produced layer {got_layer}, expected {layer}")
                a, stop = (0, None) if ranges[i] is None else ranges[i][layer]
                if r.start < a:
                    parts.append(_window_only(layer, i, r, a, stop, k, v))
                    continue
                parts.append((k[r.start - a : r.start - a + r.tokens], v[r.start - a : r.start - a + r.tokens]))
            yield layer, parts


def _window_only(layer: int, i: int, r: RestoreRun, a: int, stop: int | None, k: torch.Tensor, v: torch.Tensor) -> KV:
    """A sliding-window layer's part of a run that starts before the tokens the layer holds (its last window of the
    blob): served only when the run reaches the blob's end, so every token it lacks lies a whole window or more
    before the end of the restored prefix, where the layer's attention never reads; those tokens come back as
    zeros. A run ending earlier would need tokens the blob does not hold: refused (TierError), never wrong."""
    if stop is None or r.start + r.tokens != stop:
        raise TierError(
            f"layer {layer} of blob {i} holds its tokens {a}.. only (per-layer token sets); the run asks from token "
            f"{r.start} and ends before the blob's end"
        )
    pad = (a - r.start, *k.shape[1:])
    return torch.cat((k.new_zeros(pad), k)), torch.cat((v.new_zeros(pad), v))
