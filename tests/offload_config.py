"""vLLM's tiered offloading manager built the way the engine builds it, for tests of the ``kvtc`` secondary tier
without an engine: an ``OffloadingConfig`` of a served model (vLLM's own classes), one secondary tier, and
:class:`~dynamo_kvtc.connector.offloading.cpu_worker.KvtcTieringSpec`'s manager."""

from __future__ import annotations

import uuid
from typing import Any


def tiering_manager(
    model: str, layers: int, kv_bytes: int, tier: dict[str, Any], *, bs: int, bpc: int, chunks: int,
    events: bool = False, engine: str = "test",
) -> tuple[Any, Any]:  # fmt: skip
    """The manager of a primary CPU tier of ``chunks`` chunks (``bpc`` blocks of ``bs`` tokens, ``kv_bytes`` of K and
    V per chunk) and the secondary tier ``tier`` (its config map), for a model ``model`` of ``layers`` layers in bf16;
    returns ``(config, manager)``."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from dynamo_kvtc.connector.offloading import register
    from dynamo_kvtc.connector.offloading.cpu_worker import KvtcTieringSpec

    register.register()
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(bs, tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers)), 0),),
        worker_kv_bytes_per_block=kv_bytes // bpc,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": chunks * (kv_bytes + 4096), "secondary_tiers": [tier]},
        engine_id=f"{engine}-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(model, "bfloat16"),
        cache=OffloadingCacheConfig(bs, bpc),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )
    return cfg, KvtcTieringSpec(cfg).get_manager()
