"""Building NIXL agents: :func:`import_nixl` (the agent and config classes and NIXL's exception types, from ``nixl``
or ``nixl_cu13``) and :func:`new_agent` (an agent whose progress thread may wait between polls)."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError

log = logging.getLogger(__name__)


def import_nixl():
    """NIXL's agent class, its config class, and the tuple of its exception types (they share no base class)."""
    try:
        from nixl import _bindings
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu13 import _bindings
            from nixl_cu13._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise ConfigError("NIXL is not installed: pip install --no-deps nixl-cu13==1.5.1") from e
    errors = tuple(getattr(_bindings, n) for n in dir(_bindings) if n.endswith("Error"))
    return nixl_agent, nixl_agent_config, errors


_AGENT_LOCK = threading.Lock()


def new_agent(name: str, backends: Sequence[str], progress_us: int = 0):
    """A NIXL agent named ``name`` with ``backends``. ``progress_us`` > 0: its progress thread waits up to that many
    microseconds between polls of the backend. NIXL's Python wrapper always asks for 0, a thread that never sleeps
    (one busy core per UCX agent for as long as it lives); the wrapper has no option for it, so its config class is
    swapped for one that keeps ``progress_us`` while the agent is built (under a lock; nothing else changes)."""
    nixl_agent, nixl_agent_config, _ = import_nixl()
    cfg = nixl_agent_config(backends=list(backends))
    if progress_us <= 0:
        return nixl_agent(name, cfg)
    api = sys.modules[nixl_agent.__module__]
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if not hasattr(base, "pthrDelay"):  # another NIXL wrapper than the one this was written against
        log.warning("NIXL progress delay not applied: this NIXL's Python wrapper has no nixlBind.nixlAgentConfig")
        return nixl_agent(name, cfg)

    class _Delayed(base):  # the wrapper writes pthrDelay = 0 after building the config: that write keeps ours
        pthrDelay = property(lambda self: base.pthrDelay.__get__(self),
                             lambda self, _v: base.pthrDelay.__set__(self, int(progress_us)))

    class _Bind:  # the bindings module with the config class replaced
        nixlAgentConfig = _Delayed

        def __getattr__(self, attr: str) -> Any:
            return getattr(bind, attr)

    with _AGENT_LOCK:
        api.nixlBind = _Bind()
        try:
            return nixl_agent(name, cfg)
        finally:
            api.nixlBind = bind
