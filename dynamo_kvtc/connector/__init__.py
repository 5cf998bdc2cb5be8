"""Serving integration: the vLLM ``KvtcConnector``, its KV events (heard by Dynamo's router) and Prometheus metrics.

- :mod:`.vllm` — ``KvtcConnector`` (vLLM's ``KVConnectorBase_V1``): builds exactly one of the two halves by role and
  delegates every hook to it. :mod:`.kv_events` turns the tiers' stored/removed blocks into vLLM KV events (the one
  path by which Dynamo's router hears of them).
- :mod:`.scheduler` — ``KvtcScheduler``: matching, load and save plans (:mod:`.step_plan`: what it sends the workers).
- :mod:`.worker` — ``KvtcWorker``: the store of one TP rank, layer-by-layer restore, copy-out and encode.
- :mod:`.services` — what rank 0's worker serves other processes (lookup channel, hand-off server, metrics endpoint),
  started and stopped in one place.
- :mod:`.lookup` — how the scheduler asks the worker's store (in-process, or the IPC lookup channel).
- :mod:`.handoff` — the compressed prefill→decode hand-off (policy, server, client, messages).
- :mod:`.config` — the connector's settings, parsed once at start-up from the one settings table
  (:mod:`dynamo_kvtc.settings`) and passed down.
- :mod:`.metrics` — the ``kvtc_*`` Prometheus endpoint; :mod:`.vllm_stats` the same counters as ``vllm:kvtc_*``.
- :mod:`.offload_tier` — the ``kvtc`` secondary tier of vLLM's OffloadingConnector (:mod:`.offload_options`,
  :mod:`.offload_layout`, :mod:`.offload_store` its options, chunk layouts and blob LRU; :mod:`.offload_register`
  registers it; :mod:`.offload_cpu` runs vLLM's tiered offloading on vLLM's CPU platform).
- :mod:`.lmcache_serde` — the ``kvtc`` serde for LMCache's L2 adapters (:mod:`.lmcache_server` starts LMCache's
  server with it registered).
- :mod:`.dynamo_register` — ``KvtcConnector``'s prefill->decode protocol for ``dynamo.vllm`` (a vLLM plugin).

Importing this package does not import vLLM; :mod:`.vllm` does.
"""

from .metrics import KvtcMetrics

__all__ = ["KvtcMetrics"]
