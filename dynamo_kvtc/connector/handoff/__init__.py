"""Compressed prefill→decode hand-off: only KVTC blobs cross the wire, over NIXL, described by msgpack messages.

This package is the protocol only:

- :mod:`.link_choice` — raw or compressed per request, from per-peer link estimates (``handoff_choice=policy``).
- :mod:`.server` — the prefill worker serves its store's blobs from a NIXL-registered staging arena.
- :mod:`.client` — the decode worker fetches them and hands them to its store as blob runs to verify and restore.
- :mod:`.messages` — the messages and every check made on them before a byte is read.
- :mod:`.params` — the ``kvtc_*`` request params (from the API client), parsed and checked once.

The NIXL-registered memory it stages and receives in is transport's (the staging arena and receive buffer), and its
process-wide knobs (``handoff_choice``, ``handoff_memory``, link and restore rates, the secret) are fields of the
:class:`~dynamo_kvtc.connector.config.ConnectorConfig` parsed at start-up: nothing here reads the environment.

The prefill engine's blocks are free as soon as they were copied out, not after the decode side read them. Anything
that goes wrong (peer gone, timeout, NIXL error, corrupt bytes, blocks not there) fails the receive and vLLM
recomputes. NIXL's own descriptor serialisation (pickle) is not used.

Its scheduler side (which requests hand off or fetch, and the params between) is KvtcConnector's:
:mod:`dynamo_kvtc.connector.vllm.remote_prefill`.
"""

from .messages import MAX_FETCH_BLOCKS, MAX_FETCH_BYTES, MAX_MESSAGE

__all__ = ["MAX_FETCH_BLOCKS", "MAX_FETCH_BYTES", "MAX_MESSAGE"]
