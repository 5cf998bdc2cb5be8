"""``KvtcConnector``: dynamo_kvtc as a vLLM KV connector (``KVConnectorBase_V1``, vLLM 0.31 API; loads on 0.32/0.33).

Use it from vLLM or from ``python -m dynamo.vllm``::

    --kv-transfer-config '{"kv_connector": "KvtcConnector", "kv_connector_module_path": "dynamo_kvtc.connector.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_cache_gb": 8, "ratio": 16}}'

The class is a thin delegate: :class:`~dynamo_kvtc.connector.scheduler.KvtcScheduler` (scheduler role) and
:class:`~dynamo_kvtc.connector.worker.KvtcWorker` (worker role) hold the logic, and
:mod:`~dynamo_kvtc.connector.handoff` the compressed prefill→decode hand-off. Layer-wise restore needs eager mode or
PIECEWISE CUDA graphs (``requires_piecewise_for_cudagraph``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from ..errors import KvtcError
from .config import ConnectorConfig
from .handoff.policy import RemotePrefill
from .lookup import LazyLookup
from .protocol import StepPlan
from .scheduler import KvtcScheduler
from .vllm_parts import EventCollector, EventQueue, KvtcKVEvents, probe_cpu_offsets
from .worker import KvtcWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class KvtcConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


def _tp() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # parallel state not initialised (single process tools)
        return 0, 1


def _peer(cfg: ConnectorConfig):
    """The decode engine's hand-off client, or None (no hand-off, or NIXL unusable: remote loads then recompute)."""
    if cfg.transfer != "decode":
        return None
    from .handoff.client import HandoffClient

    try:
        return HandoffClient(cfg)
    except KvtcError as e:
        log.error("kvtc compressed hand-off unavailable (requests recompute instead): %s", e)
        return None


class KvtcConnector(KVConnectorBase_V1):
    """dynamo_kvtc as a vLLM KV connector: exactly one of a scheduler half or a worker half, by role.

    Owns nothing but the half it built and the settings. Every hook is one delegating call; the logic lives in
    :class:`~dynamo_kvtc.connector.scheduler.KvtcScheduler` and :class:`~dynamo_kvtc.connector.worker.KvtcWorker`.
    It must never raise into the engine on a cache fault."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_sources(tc.kv_connector_extra_config)
        self.engine_id = str(tc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: KvtcScheduler | None = None
        self._worker: KvtcWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if getattr(tc, "kv_load_failure_policy", None) != self.cfg.load_failure_policy:
                # vLLM's default "fail" turns a failed restore into a failed request; for a cache tier a failed
                # restore is a miss. The scheduler reads the policy right after creating this connector.
                log.info("KvtcConnector: kv_load_failure_policy=%s", self.cfg.load_failure_policy)
                tc.kv_load_failure_policy = self.cfg.load_failure_policy
            self._lookup = LazyLookup(self.engine_id)
            remote = None
            if self.cfg.transfer:
                remote = RemotePrefill(self.cfg, self.engine_id, self.block_size, self._lookup.handoff_port)
            self._scheduler = KvtcScheduler(self.cfg, self.block_size, self._lookup, remote)
            self._events = EventCollector()
        else:
            tp_rank, tp_size = _tp()
            self._event_queue = EventQueue(self.block_size)
            self._worker = KvtcWorker(
                self.cfg,
                engine_id=self.engine_id,
                model=str(vllm_config.model_config.model),
                hf_config=vllm_config.model_config.hf_config,
                block_size=self.block_size,
                num_blocks=getattr(kv_cache_config, "num_blocks", None),
                tp_rank=tp_rank,
                tp_size=tp_size,
                peer=_peer(self.cfg),
                listeners=(self._event_queue,) if self.cfg.publish_events else (),
            )

    @property
    def worker(self) -> KvtcWorker | None:
        """The worker half (None in the scheduler role): what an in-process scheduler or a test asks."""
        return self._worker

    # ------------------------------------------------------------------ class hooks
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # per-layer waits are skipped inside full CUDA graphs

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KvtcConnectorMetadata(self._scheduler.build_meta(scheduler_output))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._events.add(connector_output)

    def take_events(self):
        yield from self._events.take()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches, offsets=self._cpu_offsets(kv_caches))

    def _cpu_offsets(self, kv_caches: dict[str, torch.Tensor]):
        first = next(iter(kv_caches.values()))
        if first.dim() != 4 or first.device.type != "cpu":
            return None
        try:
            return probe_cpu_offsets(first, self.block_size, str(self._vllm_config.cache_config.cache_dtype))
        except Exception as e:
            log.warning("kvtc: probing the CPU KV layout failed (%s); using the plain layout", e)
            return None

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KvtcConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are copied out once per step in wait_for_save, after every layer wrote them

    def wait_for_save(self) -> None:
        self._worker.save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._worker.finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.finished()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def get_kv_connector_kv_cache_events(self) -> KvtcKVEvents | None:
        return self._event_queue.take()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._lookup.close()
