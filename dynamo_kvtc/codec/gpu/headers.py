"""A blob's header where the host can read it, for the fused restore: a host blob is read in place; a blob in device
memory (a hand-off's receive buffer) through two small copies; a blob still landing is waited for up to the end of
its header first."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..blob import BlobView
from ..container import MAX_HEADER_BYTES, PREFIX


def header_end(prefix: Any, n: int) -> int:
    """Where a blob's header ends, from its first bytes (clamped to the blob: parsing rejects what does not fit)."""
    if len(prefix) < PREFIX.size:
        return n
    hlen = PREFIX.unpack_from(prefix, 0)[3]
    return min(n, PREFIX.size + min(hlen, MAX_HEADER_BYTES + 1))


def header_view(b: BlobView) -> memoryview:
    """A host view of a blob that the header checks can read: the blob itself on the host; for device memory a
    zero-filled host array of the blob's length holding its prefix and header (two small copies; calloc'ed, so only
    the header's pages are touched: parsing reads nothing else). A blob still landing is waited for up to its header
    end first."""
    n, head = len(b), min(len(b), PREFIX.size)
    mv = b.host_view()
    b.wait_for(head)
    if mv is not None:
        b.wait_for(header_end(mv[:head], n))
        return mv
    t = b.slice()
    end = header_end(t[:head].cpu().numpy(), n)
    b.wait_for(end)
    out = np.zeros(n, dtype=np.uint8)
    out[:end] = t[:end].cpu().numpy()
    return memoryview(out)
