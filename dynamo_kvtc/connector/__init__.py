"""Serving integration: one package per way into an engine, and what they share.

- :mod:`.vllm` — ``KvtcConnector`` (vLLM's ``KVConnectorBase_V1``, also inside Dynamo): scheduler and worker halves,
  step plans, lookup, services, vLLM stats, the prefill->decode protocol registration for ``dynamo.vllm``.
- :mod:`.offloading` — the ``kvtc`` secondary tier of vLLM's tiered OffloadingConnector.
- :mod:`.lmcache` — the ``kvtc`` serde for LMCache's L2 adapters.
- :mod:`.handoff` — the compressed prefill->decode hand-off protocol (server, client, messages, params, link choice).

Shared by them: :mod:`.config` (the connector's settings, parsed once at start-up), :mod:`.kv_events` (the tiers'
stored/removed blocks as vLLM KV events: the one path by which Dynamo's router hears of them), :mod:`.metrics` (every
``kvtc_*`` Prometheus family), :mod:`.support` (which models are served), :mod:`.host_memory`.

Importing this package does not import vLLM.
"""

from .metrics import KvtcMetrics

__all__ = ["KvtcMetrics"]
