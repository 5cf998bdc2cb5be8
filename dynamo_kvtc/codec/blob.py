"""One type for a stored blob's bytes, wherever they are: :class:`BlobView`.

A blob reaches the codec from many places — bytes a disk read returned, a host tier's (pinned) pages read in place
under a lease, a hand-off's receive buffer in host or device memory whose bytes are still landing. The tiers and the
hand-off wrap each in a BlobView (:meth:`BlobView.of` is the one place that tells the plain forms apart); the codec
reads only BlobViews:

- ``len(view)``: the blob's size;
- :meth:`BlobView.host`: the whole blob as a host buffer (waits until every byte landed; device memory is copied);
- :attr:`BlobView.tensor` / :attr:`BlobView.offset`: the uint8 tensor holding it, for in-place reads (None for a
  plain bytes-like blob), and :meth:`BlobView.host_view`, the host bytes without waiting or copying (None in device
  memory);
- :meth:`BlobView.wait_for`: block until bytes ``[0, end)`` landed (at once for a landed blob);
  :meth:`BlobView.when_landed`: a callback once every byte landed, or once some never will;
- :meth:`BlobView.header`: the bytes holding the blob's prefix and header (of a blob still landing or in device
  memory only those, once they landed); :meth:`BlobView.tobytes`: a copy of the whole blob;
- :meth:`BlobView.consumed`: the reader is done with the bytes (a receive buffer may be reused once the device
  finished with them); :meth:`BlobView.release`: the owner's memory may go back (a host tier lease's pages).

Variants override those hooks: an arriving view (``dynamo_kvtc.transport.arriving``) waits range by range; a leased
view is built with ``on_release``. Owns no memory of its own; never copies unless :meth:`host` must.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import InputError
from .container import MAX_HEADER_BYTES, PREFIX


class BlobView:
    """The bytes of one blob: a bytes-like object, or ``length`` bytes at ``offset`` of a uint8 tensor (host, pinned
    host or device memory). ``on_release``: called once by :meth:`release` (a lease giving its pages back)."""

    arriving = False  # True for a view whose bytes are still landing (wait_for blocks)

    def __init__(
        self, source: Any, offset: int = 0, length: int | None = None, *, on_release: Callable[[], None] | None = None
    ) -> None:
        if isinstance(source, torch.Tensor):
            if source.dtype != torch.uint8 or source.dim() != 1:
                raise InputError(f"a blob tensor must be 1-D uint8, got {source.dtype} {tuple(source.shape)}")
            n = source.numel() - offset if length is None else int(length)
            if offset < 0 or n < 0 or offset + n > source.numel():
                raise InputError(f"blob bytes [{offset}, {offset + n}) outside a {source.numel()}-byte tensor")
            self.tensor: torch.Tensor | None = source
            self.offset = int(offset)
            self._mv = None if source.is_cuda else memoryview(source.numpy())[offset : offset + n]
        else:
            mv = memoryview(source).cast("B")
            n = len(mv)
            self.tensor, self.offset, self._mv = None, 0, mv
        self.nbytes = n
        self._host: Any = None  # a copy made by host() (device memory, or an arriving blob settled)
        self._on_release = on_release

    @classmethod
    def of(cls, blob: Any) -> BlobView:
        """``blob`` as a view: a BlobView as it is, ``(tensor, offset, length)``, or anything bytes-like."""
        if isinstance(blob, BlobView):
            return blob
        if isinstance(blob, tuple):
            return cls(*blob)
        return cls(blob)

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        where = "bytes" if self.tensor is None else f"{self.tensor.device}[{self.offset}:]"
        return f"{type(self).__name__}({self.nbytes} B in {where})"

    @property
    def on_device(self) -> bool:
        return self.tensor is not None and self.tensor.is_cuda

    @property
    def pinned(self) -> bool:
        """Held in pinned host memory (copies to a device run asynchronously, in place)."""
        return self.tensor is not None and not self.tensor.is_cuda and self.tensor.is_pinned()

    def slice(self) -> torch.Tensor | None:
        """The blob's bytes as a uint8 tensor view (no copy), or None for a bytes-like blob."""
        if self.tensor is None:
            return None
        return self.tensor[self.offset : self.offset + self.nbytes]

    def host_view(self) -> memoryview | None:
        """The blob's host bytes as they are now (no wait, no copy), or None when it lives in device memory."""
        return self._mv

    def wait_for(self, end: int) -> None:
        """Block until bytes ``[0, end)`` of the blob have landed (a landed blob: at once)."""

    def when_landed(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(None)`` once every byte landed, ``fn(error)`` once some never will (a landed blob: at once)."""
        fn(None)

    def consumed(self, event: Any = None) -> None:
        """The reader is done with the bytes (on CUDA: once ``event`` completes)."""

    def host(self) -> memoryview:
        """The whole blob as host bytes: waits for every byte, copies it out of device memory (once), and tells the
        owner it was read out. For host memory that already landed this is a view (no copy)."""
        if self._host is None:
            self.wait_for(self.nbytes)
            if self._mv is not None and not self.arriving:
                return self._mv
            src = self.slice()
            self._host = memoryview(src.cpu().numpy().tobytes() if src is not None else bytes(self._mv))
            self.consumed(None)
        return self._host

    def header(self) -> bytes | memoryview:
        """The bytes holding the blob's prefix and header: all of a landed host blob (no copy); of a blob still
        landing (a peer's, range by range) or in device memory, only the prefix and header, once they landed."""
        if not (self.arriving or self.on_device):
            return self.host()

        def read(n: int) -> bytes:
            self.wait_for(n)
            mv = self.host_view()
            return bytes(mv[:n]) if mv is not None else self.slice()[:n].cpu().numpy().tobytes()

        n = min(self.nbytes, PREFIX.size)
        hlen = PREFIX.unpack_from(read(n), 0)[3] if n == PREFIX.size else 0
        return read(min(self.nbytes, PREFIX.size + min(hlen, MAX_HEADER_BYTES + 1)))

    def tobytes(self) -> bytes:
        """A copy of the whole blob (waits for every byte)."""
        return bytes(self.host())

    def release(self) -> None:
        """Give the memory holding the blob back to its owner (once; later calls do nothing)."""
        cb, self._on_release = self._on_release, None
        if cb is not None:
            cb()
