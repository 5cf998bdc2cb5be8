"""Entropy codec tags and the chunking rule of blob sections (torch-free: the container and the CLI read these).

- ``store``    no entropy coding (raw window tokens, sinks, tiny sections).
- ``deflate``  raw DEFLATE (RFC 1951) per chunk; readable on the CPU and the GPU.
- ``gdeflate`` / ``ans``  GPU-only nvCOMP codecs.

Every section is split into chunks of :data:`CHUNK_BYTES` raw bytes (the last one shorter), each coded on its own.
"""

from __future__ import annotations

CHUNK_BYTES = 1 << 16
TAGS = ("store", "deflate", "gdeflate", "ans")
GPU_ONLY_TAGS = frozenset({"gdeflate", "ans"})


def chunk_sizes(raw_len: int) -> list[int]:
    """Raw sizes of the chunks a section of ``raw_len`` bytes is split into."""
    full, rest = divmod(raw_len, CHUNK_BYTES)
    return [CHUNK_BYTES] * full + ([rest] if rest else [])
