"""KvtcConnector, vLLM's ``KVConnectorBase_V1``: ``kv_connector_module_path: dynamo_kvtc.connector.vllm``.

- :mod:`.connector` — ``KvtcConnector``: builds exactly one of the two halves by role and delegates every hook to it.
- :mod:`.scheduler` — ``KvtcScheduler``: matching, load and save plans (:mod:`.step_plan`: what it sends the workers);
  :mod:`.remote_prefill` its side of the compressed hand-off; :mod:`.guard` shields its hooks.
- :mod:`.worker` — ``KvtcWorker``: the store of one TP rank, layer-by-layer restore, copy-out and encode
  (:mod:`.tensor_parallel` the ranks' tiers and joint codec).
- :mod:`.services` — what rank 0's worker serves other processes (lookup channel, hand-off server, metrics endpoint);
  :mod:`.lookup` how the scheduler asks the worker's store.
- :mod:`.stats` — the store's counters through vLLM's own stats (``vllm:kvtc_*``).
- :mod:`.dynamo_register` — the prefill->decode protocol for ``dynamo.vllm`` (a vLLM plugin).

Importing this package does not import vLLM; ``KvtcConnector`` (loaded on first use, as vLLM does) does.
"""

from ...lazy import exports

__getattr__, __dir__ = exports(__name__, {"KvtcConnector": "connector"})
__all__ = ["KvtcConnector"]
