"""The hand-off's request parameters, parsed once and checked: the ``kvtc_*`` keys of ``kv_transfer_params``.

Those params come from the API client's request body (Dynamo forwards the prefill engine's answer, but nothing stops
a client from sending its own), and the decode engine's scheduler reads them inside its hooks. A value of the wrong
type or out of range must never raise there — on vLLM an exception in a scheduler hook takes the engine loop down
and every later request with it — so :func:`parse` answers a :class:`HandoffParams` or None (the request is then
not fetched from a peer: it is looked up in the local tiers or recomputed), counts the reason in :data:`REFUSED` and
logs one warning line naming the key, never the value's bulk.

Accepted: ``kvtc_host`` a non-empty string of at most 255 characters drawn from host names and IP literals
(letters, digits, ``.-_:[]%``), ``kvtc_port`` an integer 1..65535 (not a bool, not a string), ``kvtc_blocks`` an
integer 0..``MAX_FETCH_BLOCKS`` (the most one fetch may ask for; a larger offer would be refused by the peer anyway),
and ``kv_transfer_params`` itself a map.

Well-formed params still name a host of the client's choosing, and a hostile host could answer with KV of its choice
(checked, but its own): :func:`trusted` says whether this decode worker fetches from it at all — a host on
``transfer_peers``, or with that list empty any host when the hand-off is authenticated (a shared secret: only a
holder of it can answer) and only loopback when it is not. A request naming any other host is refused the same way
(``untrusted_peer``).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ...transport.auth import is_loopback
from .messages import MAX_FETCH_BLOCKS

log = logging.getLogger(__name__)

MAX_HOST = 255
HOST = re.compile(r"[A-Za-z0-9._:\[\]%-]{1,255}")
REFUSED: Counter[str] = Counter()  # reason -> requests whose hand-off params were refused (process-wide)
UNTRUSTED = "untrusted_peer"  # the REFUSED reason of well-formed params naming a host this worker does not fetch from


@dataclass(frozen=True)
class HandoffParams:
    """Where the decode side fetches a prompt's blobs: the prefill worker's control channel and how many blocks."""

    host: str
    port: int
    blocks: int


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def check(params: Any) -> HandoffParams | str:
    """The parsed params, or the reason they are refused (a short string naming the key); never raises."""
    if not isinstance(params, dict):
        return "not_a_map"
    host, port, blocks = params.get("kvtc_host"), params.get("kvtc_port"), params.get("kvtc_blocks", 0)
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST or HOST.fullmatch(host) is None:
        return "kvtc_host"
    if not _int(port, 1, 65535):
        return "kvtc_port"
    if not _int(blocks, 0, MAX_FETCH_BLOCKS):
        return "kvtc_blocks"
    return HandoffParams(host, port, blocks)


def parse(params: Any, request_id: Any = "?") -> HandoffParams | None:
    """:func:`check`, with a refusal counted in :data:`REFUSED` and logged once (one warning line); never raises."""
    got = check(params)
    if isinstance(got, HandoffParams):
        return got
    REFUSED[got] += 1
    log.warning(
        "kvtc: request %.64s carries malformed hand-off params (%s); it is not fetched from a peer (recompute)",
        str(request_id),
        got,
    )
    return None


def trusted(host: str, peers: str | None, authenticated: bool) -> bool:
    """Whether a decode worker whose ``transfer_peers`` setting is ``peers`` fetches from ``host``: listed (``*``:
    any host), or with no list, any host when the channel is ``authenticated`` (a secret), else only loopback."""
    allowed = {p.strip() for p in (peers or "").split(",") if p.strip()}
    if allowed:
        return "*" in allowed or host in allowed
    return authenticated or is_loopback(host.strip("[]"))


def refuse_untrusted(host: str, request_id: Any = "?") -> None:
    """Count and log (one warning line) a request naming a host this worker does not fetch from."""
    REFUSED[UNTRUSTED] += 1
    log.warning(
        "kvtc: request %.64s names hand-off peer %.64s, which is not trusted here (transfer_peers, or a secret); "
        "it is not fetched from a peer (recompute)",
        str(request_id),
        host,
    )
