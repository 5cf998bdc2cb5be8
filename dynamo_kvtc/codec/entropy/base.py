"""What every entropy coder is (:class:`Coder`), the chunking rule of blob sections, and the CPU coders' worker threads.

Torch-free: the container, ``dynamo-kvtc inspect`` and the settings' tests read these without torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, ClassVar

from ...errors import UnsupportedCodecError

CHUNK_BYTES = 1 << 16  # raw bytes of one chunk (the last chunk of a section is shorter); each is coded on its own
MAX_STORED_CHUNK = 2 * CHUNK_BYTES + 64  # the most stored bytes of one chunk the container accepts, for every tag


def chunk_sizes(raw_len: int) -> list[int]:
    """Raw sizes of the chunks a section of ``raw_len`` bytes is split into."""
    full, rest = divmod(raw_len, CHUNK_BYTES)
    return [CHUNK_BYTES] * full + ([rest] if rest else [])


class Coder:
    """One entropy codec of the blob format, registered under its ``tag`` (the name each section records; see
    :mod:`.registry`). A coder codes a batch of chunks (each at most :data:`CHUNK_BYTES` raw bytes, each one stream of
    its own) and says what the container and the tiers need to know of it without running it.

    A subclass sets the class attributes and, if it runs on the CPU, overrides :meth:`encode` and :meth:`decode`.
    A GPU coder names its nvCOMP algorithm: the shared nvCOMP batch path (:mod:`.nvcomp`) runs it, nothing else."""

    tag: ClassVar[str] = ""
    cpu: ClassVar[bool] = True  # encode/decode run on the CPU (False: GPU-only, the nvCOMP algorithm below)
    nvcomp: ClassVar[str | None] = None  # the nvCOMP algorithm that codes this tag on a GPU (None: the CPU only)
    nvcomp_options: ClassVar[Mapping[str, Any]] = {}  # further ``nvcomp.Codec`` arguments (the bitstream is RAW)
    max_ratio: ClassVar[int | None] = None  # decompression-bomb bound: raw bytes one stored byte may stand for
    max_expansion: ClassVar[int] = MAX_STORED_CHUNK - CHUNK_BYTES  # worst case stored minus raw bytes of one chunk

    def fits(self, stored: int, raw: int) -> bool:
        """Whether a chunk of ``stored`` bytes may decode to ``raw`` bytes: the bound the container checks on every
        chunk from the header alone, before anything is allocated (a blob never claims more than its size allows)."""
        return self.max_ratio is None or raw <= self.max_ratio * stored

    def encode(self, chunks: Sequence[memoryview]) -> list[bytes]:
        """The stored bytes of each raw chunk (the CPU encoder)."""
        raise UnsupportedCodecError(f"entropy codec {self.tag!r} is GPU-only (nvCOMP {self.nvcomp}); no CPU encoder")

    def decode(self, chunks: Sequence[bytes], sizes: Sequence[int]) -> list[bytes]:
        """Chunk ``i`` decoded to exactly ``sizes[i]`` bytes (the CPU decoder); never produces more than that, and
        raises :class:`~dynamo_kvtc.errors.CorruptBlobError` for a chunk that is not one whole stream of its size."""
        raise UnsupportedCodecError(f"entropy codec {self.tag!r} is GPU-only (nvCOMP {self.nvcomp}); no CPU decoder")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tag={self.tag!r})"


# ------------------------------------------------------------------------------------ the CPU coders' worker threads
_THREADS = [0]  # 0: one worker per CPU


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    n = _THREADS[0] or max(1, os.cpu_count() or 1)
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvtc-entropy")


def set_cpu_threads(n: int) -> None:
    """Number of CPU coder threads (0: one per CPU); benchmarks use it to pin the CPU path to N cores."""
    old = _pool() if _pool.cache_info().currsize else None
    _THREADS[0] = max(0, int(n))
    _pool.cache_clear()
    if old is not None:
        old.shutdown(wait=False)


def map_chunks(fn, items: Sequence) -> list:
    """``[fn(x) for x in items]`` on the worker threads (zlib and lzma release the GIL: threads scale across cores)."""
    if len(items) <= 2:
        return [fn(x) for x in items]
    return list(_pool().map(fn, items))
