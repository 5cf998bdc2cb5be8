"""Publish compressed-tier blocks to Dynamo's KV-aware router, so routing sees compressed hits.

A :class:`RouterEvents` is a store listener: every blob committed to a tier becomes a ``stored`` event (its blocks'
token ids and sequence hashes, chained to the parent block), every blob that leaves all tiers a ``removed`` event.
Dynamo's ``KvEventPublisher`` takes *signed* 64-bit hashes while the hashes are unsigned: they are converted here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..tiers.keys import to_signed

log = logging.getLogger(__name__)


class RouterEvents:
    def __init__(self, endpoint: Any, worker_id: int, block_size: int, publisher: Any = None) -> None:
        if publisher is None:
            try:
                from dynamo.llm import KvEventPublisher
            except ImportError as e:
                raise ConfigError("router events need ai-dynamo-runtime: pip install 'dynamo-kvtc[dynamo]'") from e
            publisher = KvEventPublisher(endpoint, worker_id=worker_id, kv_block_size=block_size)
        self.publisher = publisher
        self.block_size = block_size
        self.published_stored = 0
        self.published_removed = 0

    def stored(self, hashes: Sequence[int], token_ids: Sequence[int], parent: int | None) -> None:
        bs = self.block_size
        if len(token_ids) != len(hashes) * bs:
            raise ValueError(f"{len(token_ids)} tokens for {len(hashes)} blocks of {bs}")
        self.publisher.publish_stored(
            [int(t) for t in token_ids],
            [bs] * len(hashes),
            [to_signed(h) for h in hashes],
            parent_hash=None if parent is None else to_signed(parent),
        )
        self.published_stored += len(hashes)

    def removed(self, hashes: Sequence[int]) -> None:
        if hashes:
            self.publisher.publish_removed([to_signed(h) for h in hashes])
            self.published_removed += len(hashes)

    def close(self) -> None:
        self.publisher.shutdown()
