"""Registers the ``kvtc`` secondary tier with vLLM's tiered offloading (``SecondaryTierFactory``).

Importing this module registers nothing by itself beyond calling :func:`register`, which only records the tier's
module path and class name in vLLM's registry (the tier, torch and the codec load when vLLM first builds the tier).
vLLM calls :func:`register` in every process through the ``vllm.general_plugins`` entry point of the installed
``dynamo-kvtc`` package, so ``{"type": "kvtc"}`` works in ``secondary_tiers`` with no import on the user's side.
Calling it twice is harmless.
"""

from __future__ import annotations

TIER_TYPE = "kvtc"
MODULE = "dynamo_kvtc.connector.offloading.tier"
CLASS = "KvtcSecondaryTier"


def register() -> bool:
    """Register ``kvtc`` with vLLM's ``SecondaryTierFactory``; False when vLLM (0.31+ tiering) is not installed."""
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError:
        return False
    if TIER_TYPE not in SecondaryTierFactory._registry:
        SecondaryTierFactory.register_tier(TIER_TYPE, MODULE, CLASS)
    return True


register()
