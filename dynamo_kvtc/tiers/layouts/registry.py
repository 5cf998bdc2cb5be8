"""The one registry of KV layouts: name -> :class:`~.base.KVLayout` subclass, in registration order.

``@register`` on a layout class is its registration line; :func:`detect_layout` asks every registered layout whether
an engine's tensor is its own, :func:`layout_class` finds one by name (names are what configs, logs and metrics say).
"""

from __future__ import annotations

import torch

from ...errors import ConfigError, TierError
from .base import KVLayout

LAYOUTS: dict[str, type[KVLayout]] = {}


def register(cls: type[KVLayout]) -> type[KVLayout]:
    """Register layout ``cls`` under ``cls.name`` (usable as a class decorator). A name is registered once."""
    if not cls.name or not issubclass(cls, KVLayout):
        raise ConfigError(f"{cls!r} is not a named KVLayout")
    if LAYOUTS.get(cls.name, cls) is not cls:
        raise ConfigError(f"KV layout {cls.name!r} is already registered ({LAYOUTS[cls.name].__qualname__})")
    LAYOUTS[cls.name] = cls
    return cls


def layout_class(layout: str | type[KVLayout]) -> type[KVLayout]:
    """The registered layout named ``layout`` (a class is returned as it is)."""
    if isinstance(layout, type) and issubclass(layout, KVLayout):
        return layout
    try:
        return LAYOUTS[layout]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown KV layout {layout!r}; supported: {tuple(LAYOUTS)}") from None


def detect_layout(t: torch.Tensor, num_blocks: int | None, mla: bool = False) -> str:
    """The name of the registered layout one layer's engine tensor ``t`` is in (``num_blocks``: the engine's block
    count when known; ``mla``: the model is an MLA model). TierError when none or several claim it."""
    found = [name for name, cls in LAYOUTS.items() if cls.detect(t, num_blocks, mla)]
    if len(found) == 1:
        return found[0]
    what = "for an MLA model: " if mla else ""
    if found:
        raise TierError(f"ambiguous KV cache layout {what}shape {tuple(t.shape)} matches {found}")
    raise TierError(f"unsupported KV cache layout {what}shape {tuple(t.shape)} (see docs/models.md)")


def page_layouts() -> tuple[str, ...]:
    """Names of the registered layouts with a page form (what the kvtc tier's chunks can hold)."""
    return tuple(name for name, cls in LAYOUTS.items() if cls.has_pages())


def page_layout_of(vllm_layout: str) -> str:
    """The registered layout whose pages are vLLM's ``KVCacheLayout`` ``vllm_layout`` (``LBNHC``, ...)."""
    name = vllm_layout.upper()
    for cls in LAYOUTS.values():
        if name in cls.vllm_layouts:
            return cls.name
    raise ConfigError(f"no registered KV layout has vLLM's {vllm_layout!r} pages")
