"""A blob whose bytes are still landing: the hand-off's receive buffer, read range by range as the READs complete.

:class:`ArrivingView` is a :class:`~dynamo_kvtc.codec.blob.BlobView` over ``(tensor, offset, length)`` of a receive
buffer (host or device memory) whose range a — bytes ``[ends[a-1], ends[a])`` of the blob — is in place once
``arrival.wait(a)`` returned. The fused restore waits group by group (so layer group 0 decodes while later groups
still move); every other reader calls :meth:`~dynamo_kvtc.codec.blob.BlobView.host`, which waits for every byte.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..codec.blob import BlobView
from ..errors import InputError


class Arrival(Protocol):
    """Byte ranges landing one after another (a hand-off's per-layer-group READs)."""

    def wait(self, index: int) -> None:
        """Return once ranges 0..``index`` have landed; raise (TransferError) when they never will."""

    def consumed(self, event: Any) -> None:
        """One blob's bytes were read out (on CUDA: once ``event`` completes); called once per blob."""


class ArrivingView(BlobView):
    """A blob in a receive buffer whose bytes land range by range (``ends``: where each range ends in the blob).

    Owns nothing but the view and the ranges; it never reads a byte of a range that was not confirmed landed."""

    arriving = True

    def __init__(self, tensor: torch.Tensor, offset: int, length: int, arrival: Arrival, ends: Sequence[int]) -> None:
        ends = tuple(int(e) for e in ends)
        if not ends or ends[0] < 1 or ends[-1] != length or any(b <= a for a, b in zip(ends, ends[1:])):
            raise InputError(f"arrival ranges must increase strictly up to the blob's {length} bytes, got {ends[:8]}")
        super().__init__(tensor, offset, length)
        self.arrival, self.ends, self._consumed = arrival, ends, False

    def wait_for(self, end: int) -> None:
        """Block until bytes ``[0, end)`` of the blob have landed."""
        self.arrival.wait(min(bisect.bisect_left(self.ends, end), len(self.ends) - 1))

    def consumed(self, event: Any = None) -> None:
        """Tell the arrival this blob was read out (once; later calls do nothing)."""
        if not self._consumed:
            self._consumed = True
            self.arrival.consumed(event)

    def again(self, arrival: Arrival) -> ArrivingView:
        """The same bytes landing again under another arrival (a benchmark replaying one fetch's schedule)."""
        return ArrivingView(self.tensor, self.offset, self.nbytes, arrival, self.ends)
