"""The hand-off streamed layer group by layer group: where each group's bytes end in a blob (the prefill side sends
it), and the decode side's record of which byte ranges have landed.

A blob's sections are ordered by layer group (codec/container.py), so group g of a blob is one contiguous byte range
and the header sits before group 0. The decode side READs range a of every blob of a fetch in one transfer, a = 0,
1, ..., one after another, and the fused restore (:class:`~dynamo_kvtc.codec.gpu.restore.ArrivingBlob`) decodes
group g as soon as the ranges holding it landed, while later ranges still move.
"""

from __future__ import annotations

from ...codec.container import group_ends
from ...transport.arriving import GroupArrival

__all__ = ["GroupArrival", "group_ends"]  # their homes: the blob format (codec) and the arriving view (transport)
