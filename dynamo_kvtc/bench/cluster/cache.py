"""An LRU cache of KV prefixes counted in blocks: one entry per prefix stream (a conversation, a shared prompt).

A stream is cached as its first ``blocks`` blocks (prefix caching keeps a prefix); saving a longer prefix grows the
entry and makes it the most recently used; over capacity the least recently used entry loses blocks from its tail
(whole entries go when nothing is left), as an engine's block-level LRU does to a conversation whose blocks were all
last used together. Sizes are whole blocks of ``block_tokens`` tokens (the simulator never looks at single tokens).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["BlockLRU"]


class BlockLRU:
    """``capacity`` blocks; ``get(key)`` -> blocks cached (no reordering), ``touch``/``put`` mark a use."""

    __slots__ = ("capacity", "used", "entries", "evicted_blocks")

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self.used = 0
        self.entries: OrderedDict[object, int] = OrderedDict()
        self.evicted_blocks = 0

    def get(self, key: object) -> int:
        return self.entries.get(key, 0)

    def touch(self, key: object) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def put(self, key: object, blocks: int) -> int:
        """Hold the first ``blocks`` blocks of ``key`` (never fewer than held: a prefix only grows); returns the
        blocks newly stored (what a write-through moved)."""
        old = self.entries.get(key, 0)
        blocks = min(int(blocks), self.capacity)
        if blocks <= old:
            self.touch(key)
            return 0
        self.entries[key] = blocks
        self.entries.move_to_end(key)
        self.used += blocks - old
        self._evict()
        return blocks - old

    def _evict(self) -> None:
        entries = self.entries
        while self.used > self.capacity:
            key, n = next(iter(entries.items()))
            over = self.used - self.capacity
            if n > over:
                entries[key] = n - over
                self.used -= over
                self.evicted_blocks += over
            else:
                del entries[key]
                self.used -= n
                self.evicted_blocks += n
