"""Registers ``KvtcConnector`` as a prefill->decode connector with Dynamo's vLLM worker (``dynamo.vllm`` 1.6.1).

``dynamo.vllm`` resolves the PD protocol of the engine's top-level ``kv_connector`` in the module-level dict
``dynamo.vllm.kv_connector_protocols.KV_CONNECTOR_PROTOCOLS`` and refuses every prefill request of a connector it does
not list. Dynamo 1.6.1 has no entry point or API to add one; the dict is the only hook. ``KvtcConnector`` follows
``NixlConnectorProtocol``'s pull-based contract (``do_remote_decode`` in, its own ``kv_transfer_params`` out), so
:func:`register` maps it there.

It registers only where ``KvtcConnector`` *is* the PD connector: the worker's own ``--kv-transfer-config`` names it
as the top-level ``kv_connector``. Registered globally it would break the other deployment (``MultiConnector`` with
``KvtcConnector`` and ``NixlConnector`` children): Dynamo then sees two PD-capable children and refuses every prefill.

vLLM runs :func:`register` through the ``vllm.general_plugins`` entry point of the installed ``dynamo-kvtc``:
``dynamo.vllm`` imports ``kv_connector_protocols`` before it builds its ``EngineArgs``, whose ``__post_init__`` loads
vLLM's general plugins, so the connector is registered before the first request, with ``python3 -m dynamo.vllm``
unchanged. In any other process (plain vLLM, engine cores, workers) ``dynamo.vllm`` is not imported and this does
nothing: it never imports Dynamo itself. (If ``VLLM_PLUGINS`` is set, it must name ``dynamo_kvtc_pd_protocol``.)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

CONNECTOR = "KvtcConnector"
PROTOCOLS_MODULE = "dynamo.vllm.kv_connector_protocols"


def top_level_connector(argv: Sequence[str]) -> str | None:
    """The ``kv_connector`` of the ``--kv-transfer-config`` JSON on a command line, if any."""
    for i, arg in enumerate(argv):
        value = None
        if arg == "--kv-transfer-config" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--kv-transfer-config="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                cfg = json.loads(value)
            except ValueError:
                return None
            return cfg.get("kv_connector") if isinstance(cfg, dict) else None
    return None


def register(argv: Sequence[str] | None = None) -> bool:
    """Add ``KvtcConnector`` to Dynamo's PD protocols if ``dynamo.vllm`` runs in this process with ``KvtcConnector``
    as its top-level connector; True if it is registered."""
    mod = sys.modules.get(PROTOCOLS_MODULE)
    if mod is None or top_level_connector(sys.argv if argv is None else argv) != CONNECTOR:
        return False
    mod.KV_CONNECTOR_PROTOCOLS.setdefault(CONNECTOR, mod.NixlConnectorProtocol)
    return True
