"""The hand-off's shared secret: where it comes from and what an unauthenticated port means.

The secret keys an HMAC-SHA256 on every control message and reply of the hand-off channel (see
:class:`~dynamo_kvtc.transport.channel.Auth`): a request without the right MAC, outside the replay window or replayed
is refused and counted, and a reply that does not carry the MAC over its request's nonce is refused by the decode
side (a miss: vLLM recomputes). Both sides of a deployment must hold the same secret; a Kubernetes Secret mounted as a
file (``transfer_secret_file``) is the intended source, ``DYN_KVTC_TRANSFER_SECRET`` the fallback. The NIXL READ itself
is not covered (NIXL/UCX carry no authentication here): the MAC protects which blobs are staged and where they are
described, and the decode side still verifies every blob whole before it is used.
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

from ..errors import ConfigError
from .channel import Auth

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """``host`` is a loopback address (or ``localhost``)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def load_secret(path: Path | None, value: str | None) -> bytes | None:
    """The secret bytes (the file ``path`` wins over ``value``, the secret given as text; trailing whitespace of a file
    is dropped), or None."""
    if path is not None:
        try:
            return path.read_bytes().rstrip(b"\r\n\t ")
        except OSError as e:
            raise ConfigError(f"transfer_secret_file {path}: {e.strerror or e}") from None
    return value.encode() if value else None


def channel_auth(secret_file: Path | None, secret: str | None, side: str, host: str) -> Auth | None:
    """The hand-off channel's :class:`Auth` from the secret file or text, or None (unauthenticated; a warning when
    ``side`` is the serving ("prefill") side and ``host`` is not loopback)."""
    secret = load_secret(secret_file, secret)
    if secret is None:
        if side == "prefill" and not is_loopback(host):
            log.warning(
                "kvtc hand-off on %s is unauthenticated: anything that reaches the port can ask for blobs; set "
                "transfer_secret_file (a Kubernetes Secret) on both prefill and decode workers",
                host,
            )
        return None
    try:
        return Auth(secret)
    except ConfigError as e:
        raise ConfigError(f"the hand-off secret is unusable: {e}") from None
