"""No exception of ours reaches vLLM's engine loop from a scheduler hook.

vLLM calls the connector's scheduler-side hooks (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``request_finished``) inside its scheduler step; an exception there ends the engine's busy
loop and with it every request in flight and every later one. A cache tier has no business doing that: whatever went
wrong in our code (a bug, a malformed request parameter that slipped past :mod:`.handoff.params`), the request is to
be answered as a miss and recomputed. :func:`shielded` wraps a hook: an ``Exception`` raised inside it is counted in
:data:`FAULTS` (per hook), logged (one warning line with the traceback at debug level), and answered by the hook's
``fallback``, which says what "a miss" means for that hook. ``BaseException`` s that are not ``Exception`` s
(``KeyboardInterrupt``, ``SystemExit``) pass through.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
FAULTS: Counter[str] = Counter()  # hook name -> exceptions answered by its fallback (process-wide)
F = TypeVar("F", bound=Callable[..., Any])


def shielded(fallback: Callable[..., Any], default: Any = None) -> Callable[[F], F]:
    """Decorate a method: on an ``Exception`` return ``fallback(self, *args, **kwargs)`` instead (``default`` if the
    fallback fails too; a type or function is called for a fresh value). The fallback must answer as if our code had
    found nothing (a miss, nothing planned)."""

    def wrap(hook: F) -> F:
        name = hook.__name__

        @functools.wraps(hook)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return hook(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the engine loop must never see our exceptions
                FAULTS[name] += 1
                log.warning("kvtc: %s failed (%s: %.300s); answering a miss (the request recomputes)", name,
                            type(e).__name__, e)  # fmt: skip
                log.debug("kvtc: %s failure", name, exc_info=True)
            try:
                return fallback(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001
                FAULTS[f"{name}_fallback"] += 1
                log.error("kvtc: the fallback of %s failed too (%s: %.300s)", name, type(e).__name__, e)
                return default() if callable(default) else default

        return guarded  # type: ignore[return-value]

    return wrap
