"""The entropy coders by tag: every place that needs to know a tag asks here (torch-free).

A coder is one class in its own module (a :class:`~.base.Coder` subclass); one :func:`register` line below makes
its tag known to the container (which sections parse, the decompression-bomb bound), to both codecs' writers and
readers, to the options' choice of a GPU coder, and to ``dynamo-kvtc inspect``. ``TAGS``, ``GPU_ONLY_TAGS`` and
``NVCOMP_ALGO`` are read from the registry when asked for (so they include a coder registered later).
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError, KvtcError, UnsupportedCodecError
from .ans import Ans
from .base import CHUNK_BYTES, MAX_STORED_CHUNK, Coder
from .deflate import Deflate
from .gdeflate import GDeflate
from .store import Store

PORTABLE = "deflate"  # the tag every reader decodes (CPU and GPU): new blobs' default
_CODERS: dict[str, Coder] = {}


def register(c: Coder) -> Coder:
    """Make ``c`` the coder of its tag; ConfigError for a tag already taken or a coder the format cannot hold."""
    tag = c.tag
    if not isinstance(tag, str) or not tag or len(tag) > 64:
        raise ConfigError(f"entropy coder {c!r}: its tag must be a non-empty string of at most 64 characters")
    if tag in _CODERS:
        raise ConfigError(f"entropy codec tag {tag!r} is already registered ({_CODERS[tag]!r})")
    if not (c.cpu or c.nvcomp):
        raise ConfigError(f"entropy coder {c!r} has neither a CPU path nor an nvCOMP algorithm")
    if not 0 <= c.max_expansion <= MAX_STORED_CHUNK - CHUNK_BYTES:
        raise ConfigError(f"entropy coder {c!r}: max_expansion {c.max_expansion} exceeds the format's chunk limit")
    _CODERS[tag] = c
    return c


def unregister(tag: str) -> None:
    """Forget a tag (tests that register a coder of their own clean up with this)."""
    _CODERS.pop(tag, None)


register(Store())
register(Deflate())
register(GDeflate())
register(Ans())


def coder(tag: str, error: type[KvtcError] = UnsupportedCodecError) -> Coder:
    """The coder of ``tag``; ``error`` (a reader's UnsupportedCodecError unless a writer's configuration asks for
    ConfigError) naming the unknown tag and the known ones."""
    c = _CODERS.get(tag) if isinstance(tag, str) else None
    if c is None:
        raise error(f"unknown entropy codec tag {tag!r}; known: {', '.join(_CODERS)}")
    return c


def known(tag: Any) -> bool:
    """Whether ``tag`` (any value, e.g. from an untrusted header) names a registered coder."""
    return isinstance(tag, str) and tag in _CODERS


def tags() -> tuple[str, ...]:
    """Every registered tag, in registration order."""
    return tuple(_CODERS)


def gpu_only_tags() -> frozenset[str]:
    """Tags only nvCOMP decodes (a CPU reader refuses them)."""
    return frozenset(t for t, c in _CODERS.items() if not c.cpu)


def nvcomp_tags() -> tuple[str, ...]:
    """Tags nvCOMP codes on a GPU: the choices of the GPU's entropy codec (``gpu_entropy``)."""
    return tuple(t for t, c in _CODERS.items() if c.nvcomp)


def __getattr__(name: str) -> Any:  # the constants of earlier versions, read live
    if name == "TAGS":
        return tags()
    if name == "GPU_ONLY_TAGS":
        return gpu_only_tags()
    if name == "NVCOMP_ALGO":
        return {t: c.nvcomp for t, c in _CODERS.items() if c.nvcomp}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
