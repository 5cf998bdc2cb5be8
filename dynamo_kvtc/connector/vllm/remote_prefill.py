"""The scheduler's remote-prefill policy: which requests hand their prompt's KV off, and which fetch it from a peer.

vLLM's disaggregation protocol, as Dynamo drives it:

1. The prefill engine gets the request with ``kv_transfer_params={"do_remote_decode": true}``. Its prompt blocks are
   saved as usual (encoded into the host tier); :meth:`RemotePrefill.handoff_params` answers ``request_finished`` with
   ``do_remote_prefill`` and where to fetch them: ``kvtc_host``, ``kvtc_port``, ``kvtc_blocks``.
2. The decode engine gets those params. :meth:`RemotePrefill.matched` asks for the prompt's full blocks as an
   asynchronous load, and :meth:`RemotePrefill.load` turns the allocation into a
   :class:`~.step_plan.LoadOp` with ``remote=(host, port)``; the worker fetches and restores it
   through its :class:`~dynamo_kvtc.connector.handoff.client.HandoffClient`.
3. Anything that goes wrong fails the receive: vLLM recomputes the prompt on the decode side.

With ``handoff_choice=policy`` (``DYN_KVTC_HANDOFF_CHOICE``) the connector sits beside vLLM's NixlConnector in a
MultiConnector on both sides. The prefill side then adds only its ``kvtc_*`` keys (NixlConnector owns
``do_remote_prefill``, ``remote_engine_id``, ...; MultiConnector refuses clashing keys), so the decode side holds both
offers; per request the :class:`~.link_choice.LinkPolicy` estimates raw (bytes / link) against compressed (bytes / link
+ restore) and :meth:`RemotePrefill.applies` either takes the request (compressed fetch) or declines it, and
NixlConnector, the next connector asked, READs the raw KV. The choice is made once per request and kept in its params
(``kvtc_choice``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ... import settings
from ..config import ConnectorConfig
from ..handoff.link_choice import COMPRESSED, RAW, LinkPolicy
from ..handoff.params import HandoffParams, check, parse, refuse_untrusted, trusted
from .step_plan import LoadOp

log = logging.getLogger(__name__)
REFUSED = "refused"  # kvtc_choice of a request whose hand-off params are malformed or untrusted: never fetched


def _params_of(request: Any) -> dict[str, Any]:
    p = getattr(request, "kv_transfer_params", None)
    return p if isinstance(p, dict) else {}


class RemotePrefill:
    """Scheduler-side hand-off rules for one engine (``transfer`` = ``prefill`` or ``decode``).

    Owns no KV and no sockets; it reads requests' ``kv_transfer_params`` and answers for the scheduler. ``port`` tells
    the prefill side the port its worker's hand-off server listens on (the configured one, or asked of the worker).
    ``link`` and ``kv_bytes_per_token`` (16-bit K+V bytes of one token over all layers of this rank) feed the
    raw-vs-compressed choice of ``handoff_choice=policy``; without them every offer is taken compressed."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        engine_id: str,
        block_size: int,
        port: Callable[[], int | None],
        *,
        link: LinkPolicy | None = None,
        kv_bytes_per_token: int = 0,
    ) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = block_size
        self._port = port
        self.choice_mode = cfg.handoff_choice
        if link is None and self.choice_mode == "policy":
            link = LinkPolicy.from_config(cfg, gpu=True)  # the decode side restores on its GPU
        self.link = link
        self.kv_bytes_per_token = kv_bytes_per_token
        self._authenticated = cfg.transfer_secret_file is not None or bool(cfg.transfer_secret)

    def applies(self, request: Any) -> bool:
        """Decode side: this request's prompt KV is to be fetched, compressed, from a prefill peer."""
        p = _params_of(request)
        if not (self.cfg.transfer == "decode" and bool(p.get("do_remote_prefill")) and "kvtc_port" in p):
            return False
        rid = getattr(request, "request_id", "?")
        hp = None if p.get("kvtc_choice") == REFUSED else parse(p, rid)
        if hp is not None and not trusted(hp.host, self.cfg.transfer_peers, self._authenticated):
            refuse_untrusted(hp.host, rid)
            hp = None
        if hp is None:  # malformed or untrusted (counted, logged once): the local tiers or a recompute, never raises
            p["kvtc_choice"] = REFUSED
            return False
        if "kvtc_choice" not in p:
            p["kvtc_choice"] = self._choose(p, hp)
        return p["kvtc_choice"] == COMPRESSED

    def declined(self, request: Any) -> bool:
        """Decode side: an offer :meth:`applies` left to NixlConnector (raw); the scheduler should then claim no
        tokens for the request at all, so NixlConnector is the connector MultiConnector assigns it to."""
        p = _params_of(request)
        return self.cfg.transfer == "decode" and p.get("kvtc_choice") == RAW

    def _choose(self, p: dict[str, Any], hp: HandoffParams) -> str:
        """``compressed`` unless the policy is on, a raw offer (NixlConnector's ``remote_block_ids``) is there too,
        the KV size is known and the link estimate says raw arrives sooner."""
        if self.choice_mode != "policy" or self.link is None or not self.kv_bytes_per_token:
            return COMPRESSED
        if not p.get("remote_block_ids"):
            return COMPRESSED  # no raw alternative: the compressed fetch or a recompute
        tokens = hp.blocks * self.block_size
        raw = tokens * self.kv_bytes_per_token
        window = min(tokens, self.cfg.tiers.window) * self.kv_bytes_per_token
        ratio = self.cfg.tiers.ratio
        if isinstance(ratio, str):  # "auto": resolved by the workers from their calibration; estimate at the default
            ratio = settings.default("ratio")
        compressed = int((raw - window) / ratio) + window
        return self.link.choose(f"{hp.host}:{hp.port}", raw, compressed).choice

    def matched(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens the peer provides beyond ``num_computed_tokens``, asynchronous) — always asynchronous."""
        prompt, hp = request.prompt_token_ids or [], check(_params_of(request))
        n = min((len(prompt) - 1) // self.block_size, hp.blocks if isinstance(hp, HandoffParams) else 0)
        ext = n * self.block_size - num_computed_tokens
        return (ext, True) if ext > 0 else (0, False)

    def load(self, request: Any, hashes: list[int], block_ids: list[int]) -> LoadOp:
        """The fetch-and-restore of ``hashes`` into ``block_ids``; consumes the request's remote-prefill flag so a
        preemption later recomputes instead of fetching again."""
        p, hp = request.kv_transfer_params, check(_params_of(request))
        if not isinstance(hp, HandoffParams) or not trusted(hp.host, self.cfg.transfer_peers, self._authenticated):
            raise ValueError(f"request {request.request_id}: malformed or untrusted hand-off params")  # not reached
        op = LoadOp(request.request_id, hashes, block_ids, True, remote=(hp.host, hp.port))
        p["do_remote_prefill"] = False
        return op

    def handoff_params(self, request: Any) -> dict[str, Any] | None:
        """Prefill side: the ``kv_transfer_params`` that tell the decode side where to fetch this prompt, or None."""
        p = _params_of(request)
        if self.cfg.transfer != "prefill" or not p.get("do_remote_decode"):
            return None
        n = (request.num_prompt_tokens - 1) // self.block_size
        port = self.cfg.transfer_port or self._port()
        if not port:
            log.warning(
                "kvtc: transfer=prefill but the worker's hand-off port is unknown (no transfer_port and no answer "
                "from the worker); request %s hands off nothing.",
                request.request_id,
            )
            return None
        if n <= 0:
            return None
        offer = {"kvtc_host": self.cfg.transfer_host, "kvtc_port": int(port), "kvtc_blocks": n}
        if self.choice_mode == "policy":
            return offer  # beside NixlConnector: it owns the standard keys (MultiConnector refuses clashes)
        return {"do_remote_prefill": True, "do_remote_decode": False, **offer, "remote_engine_id": self.engine_id}
