"""The ``kvtc`` secondary tier of vLLM's tiered OffloadingConnector.

- :mod:`.tier` — the tier (vLLM's ``SecondaryTierManager``), :mod:`.options` its options, :mod:`.layout` the raw
  tier's chunk layouts, :mod:`.storage` its blobs (in a KvtcStore, KvtcConnector's store).
- :mod:`.register` — registers the tier with vLLM (a ``vllm.general_plugins`` entry point).
- :mod:`.cpu_worker` — the copy worker that runs vLLM's tiered offloading on vLLM's CPU platform.

Importing this package does not import vLLM.
"""
