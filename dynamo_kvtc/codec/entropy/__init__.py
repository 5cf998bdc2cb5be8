"""Lossless entropy stage (paper §3.3): each blob section is cut into chunks of at most 64 KiB, each coded on its own.

Every section records the tag of its coder; the coders are registered by tag in :mod:`.registry` (one module each):

- ``store``    (:mod:`.store`) no entropy coding (raw window tokens, sinks, tiny sections).
- ``deflate``  (:mod:`.deflate`) raw DEFLATE (RFC 1951): zlib on the CPU, nvCOMP ``Deflate`` on a GPU, the same
               bytes either way; the tag every reader decodes.
- ``gdeflate`` / ``ans``  (:mod:`.gdeflate`, :mod:`.ans`) GPU-only nvCOMP codecs (much faster GPU decode). A CPU-only
               reader refuses them with :class:`~dynamo_kvtc.errors.UnsupportedCodecError`.

:mod:`.base` holds what a coder is (:class:`~.base.Coder`) and the chunking rule, :mod:`.sections` the stage of one
section on one device (the reference codec's), :mod:`.nvcomp` the nvCOMP side; the fused codec's batched stage is
:mod:`dynamo_kvtc.codec.gpu.batch_entropy`. Every decoder call knows the exact decompressed length of each chunk from
the container header and never inflates past it.

Exports load lazily (``base`` and ``registry`` import no torch: the container and ``inspect`` read them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import exports

_EXPORTS = {
    "CHUNK_BYTES": "base",
    "MAX_STORED_CHUNK": "base",
    "Coder": "base",
    "chunk_sizes": "base",
    "map_chunks": "base",
    "set_cpu_threads": "base",
    "deflate_chunk": "deflate",
    "inflate_chunk": "deflate",
    "GPU_ONLY_TAGS": "registry",
    "NVCOMP_ALGO": "registry",
    "PORTABLE": "registry",
    "TAGS": "registry",
    "coder": "registry",
    "gpu_only_tags": "registry",
    "known": "registry",
    "nvcomp_tags": "registry",
    "register": "registry",
    "tags": "registry",
    "unregister": "registry",
    "nvcomp_available": "nvcomp",
    "EntropyCoder": "sections",
    "check_readable": "sections",
}

__all__ = [
    "CHUNK_BYTES",
    "Coder",
    "EntropyCoder",
    "GPU_ONLY_TAGS",
    "MAX_STORED_CHUNK",
    "NVCOMP_ALGO",
    "PORTABLE",
    "TAGS",
    "check_readable",
    "chunk_sizes",
    "coder",
    "deflate_chunk",
    "gpu_only_tags",
    "inflate_chunk",
    "known",
    "map_chunks",
    "nvcomp_available",
    "nvcomp_tags",
    "register",
    "set_cpu_threads",
    "tags",
    "unregister",
]

if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from .base import CHUNK_BYTES, MAX_STORED_CHUNK, Coder, chunk_sizes, map_chunks, set_cpu_threads
    from .deflate import deflate_chunk, inflate_chunk
    from .nvcomp import nvcomp_available
    from .registry import (
        GPU_ONLY_TAGS,
        NVCOMP_ALGO,
        PORTABLE,
        TAGS,
        coder,
        gpu_only_tags,
        known,
        nvcomp_tags,
        register,
        tags,
        unregister,
    )
    from .sections import EntropyCoder, check_readable

_getattr, __dir__ = exports(__name__, _EXPORTS)


def __getattr__(name: str):
    if name in ("TAGS", "GPU_ONLY_TAGS", "NVCOMP_ALGO"):  # read live from the registry, never cached on the package
        from . import registry

        return getattr(registry, name)
    return _getattr(name)
