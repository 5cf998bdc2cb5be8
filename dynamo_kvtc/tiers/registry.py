"""The kinds of blob tier a store can chain, each registered with one line: :func:`register` (:class:`TierKind`).

A kind names its :class:`~dynamo_kvtc.tiers.base.BlobTier` class, the settings rows it reads (keys of
:data:`dynamo_kvtc.settings.SETTINGS`, checked to exist) and its factory: ``build(cfg)`` makes the tier from a
:class:`~dynamo_kvtc.tiers.config.TierConfig`, or returns None when the configuration asks for no such tier.
:func:`build_chain` builds a store's chain in registration order (first = fastest): ``host`` always, ``disk`` when
``disk_cache_gb`` is set, then any other registered kind whose factory builds one (e.g. one named in
``TierConfig.tiers``). ``min_uses(cfg)``: the kind's admission rule, how often a victim of the tier above must have
been used before it is written into this one (1: every victim).

To add a tier: one module with its BlobTier class, and one ``register(TierKind(...))`` line at the end of this file
(or, for a tier that lives outside the package such as the tests' ``tests/tier_plugins.py``, in its own module).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .. import settings
from ..errors import ConfigError
from .base import BlobTier
from .config import TierConfig
from .disk import DiskTier
from .host import HostTier
from .pool import PoolTier
from .stats import PEER


@dataclass(frozen=True)
class TierKind:
    """One kind of tier: its name (the stats' and metrics' key), class, settings rows, factory and admission rule."""

    name: str
    cls: type[BlobTier]
    build: Callable[[TierConfig], BlobTier | None]
    settings: tuple[str, ...] = ()
    min_uses: Callable[[TierConfig], int] = lambda cfg: 1


_KINDS: dict[str, TierKind] = {}


def register(kind: TierKind) -> TierKind:
    """Add a kind of tier (after those registered before it in the chain's order); registering a name again
    replaces that kind in place."""
    unknown = [k for k in kind.settings if k not in settings.BY_KEY]
    if unknown:
        raise ConfigError(f"tier {kind.name!r} names settings that are not in the table: {unknown}")
    if kind.cls.name != kind.name:
        raise ConfigError(f"tier kind {kind.name!r} registers {kind.cls.__name__}, whose name is {kind.cls.name!r}")
    _KINDS[kind.name] = kind
    return kind


def kinds() -> tuple[TierKind, ...]:
    """The registered kinds, in chain order."""
    return tuple(_KINDS.values())


def names() -> tuple[str, ...]:
    return tuple(_KINDS)


def sources() -> tuple[str, ...]:
    """Where restored blocks may come from: every registered tier, then a peer (the metrics' ``tier`` labels)."""
    return (*_KINDS, PEER)


def build_chain(cfg: TierConfig, given: Mapping[str, BlobTier | None] | None = None) -> list[BlobTier]:
    """The tiers ``cfg`` asks for, fastest first; ``given``: tiers already built, by kind (a None builds none)."""
    unknown = set(cfg.tiers) - set(_KINDS)
    if unknown:
        raise ConfigError(f"unknown tiers {sorted(unknown)}; registered: {sorted(_KINDS)}")
    given = given or {}
    chain = []
    for kind in _KINDS.values():
        tier = given[kind.name] if kind.name in given else kind.build(cfg)
        if tier is not None:
            chain.append(tier)
    if not chain or chain[0].name != "host":
        raise ConfigError("the first tier of a chain must be the host tier")
    return chain


def admission(cfg: TierConfig) -> dict[str, int]:
    """Each kind's admission rule under ``cfg``: tier name -> uses before a victim is written into it."""
    return {k.name: k.min_uses(cfg) for k in _KINDS.values()}


def _disk(cfg: TierConfig) -> DiskTier | None:  # also nixl_timeout_s
    if not cfg.disk_bytes:
        return None
    return DiskTier(cfg.disk_dir, cfg.disk_bytes, fsync=cfg.fsync, timeout_s=cfg.nixl_timeout_s)


def _disk_min_uses(cfg: TierConfig) -> int:  # disk_min_uses: one-off prompts spend no SSD writes
    return cfg.disk_min_uses


# the built-in tiers, fastest first: one line each
register(TierKind("host", HostTier, lambda c: HostTier(c.host_bytes, c.page_bytes), ("cpu_cache_gb", "page_bytes")))
register(TierKind("disk", DiskTier, _disk, ("disk_cache_gb", "disk_cache_dir", "disk_fsync"), _disk_min_uses))


def _pool(cfg: TierConfig) -> PoolTier | None:  # also pool_metadata_server ... pool_insecure, and the cluster secret
    return PoolTier(cfg) if cfg.pool_master else None


_POOL = ("pool_master", "pool_metadata_server", "pool_segment_gb", "pool_replicas", "pool_protocol", "pool_device",
         "pool_timeout_s", "pool_queue_mb", "pool_insecure")  # fmt: skip
register(TierKind("pool", PoolTier, _pool, _POOL))
