"""``KvtcConnector``: dynamo_kvtc as a vLLM KV connector (``KVConnectorBase_V1``, vLLM 0.31 API; loads on 0.32/0.33).

Use it from vLLM or from ``python -m dynamo.vllm``::

    --kv-transfer-config '{"kv_connector": "KvtcConnector", "kv_connector_module_path": "dynamo_kvtc.connector.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_cache_gb": 8, "ratio": 16}}'

The class is a thin delegate: :class:`~dynamo_kvtc.connector.scheduler.KvtcScheduler` (scheduler role) and
:class:`~dynamo_kvtc.connector.worker.KvtcWorker` (worker role) hold the logic, and
:mod:`~dynamo_kvtc.connector.transfer` the compressed prefill→decode hand-off. Layer-wise restore needs eager mode or
PIECEWISE CUDA graphs (``requires_piecewise_for_cudagraph``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVConnectorKVEvents, KVEventAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .config import ConnectorConfig
from .lookup import LookupClient
from .protocol import StepPlan
from .scheduler import KvtcScheduler
from .worker import LOCAL_WORKERS, KvtcWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MEDIUM = "CPU"  # the compressed tiers live in host memory (and on local disk behind it)


@dataclass
class KvtcConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


class KvtcKVEvents(KVConnectorKVEvents):
    """Compressed-tier BlockStored/BlockRemoved events, aggregated over TP workers (kept when all ranks report)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> KvtcKVEvents:
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list:
        return self._agg.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._agg.get_number_of_workers()

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()


class _EventQueue:
    """Store listener turning committed/dropped blobs into vLLM KV cache events (relayed by dynamo.vllm)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list = []

    def stored(self, hashes, token_ids, parent) -> None:
        self.events.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=list(token_ids),
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
            )
        )

    def removed(self, hashes) -> None:
        self.events.append(BlockRemoved(block_hashes=list(hashes), medium=MEDIUM))

    def drain(self) -> list:
        out, self.events = self.events, []
        return out


def probe_cpu_offsets(kv_cache: torch.Tensor, block_size: int, cache_dtype: str = "auto"):
    """Learn where vLLM's CPU attention kernel puts each (token, dim) element of a block's K and V halves, by writing
    token and dim indices through the kernel itself into a scratch block. Returns (k_offsets, v_offsets) for
    :class:`~dynamo_kvtc.tiers.layout.PagedKV`, or None when the kernel is unavailable (the plain layout is used)."""
    import torch

    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    _, H, bs, d2 = kv_cache.shape
    D = d2 // 2
    if bs * D > 4096 * 256 or max(bs, D) >= 256:  # indices must stay exact in 16-bit floats
        return None
    isa = _get_attn_isa(kv_cache.dtype, block_size, D, cache_dtype)
    found = []
    for which in ("token", "dim"):
        scratch = torch.zeros(1, H, bs, d2, dtype=kv_cache.dtype)
        kc, vc = scratch.view(1, H, 2 * bs, D).chunk(2, dim=2)
        idx = torch.arange(bs)[:, None, None] if which == "token" else torch.arange(D)[None, None, :]
        x = (idx + 1).expand(bs, H, D).to(kv_cache.dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(x, x, kc, vc, torch.arange(bs, dtype=torch.int64), isa)
        found.append(scratch.view(H, 2 * bs * D)[0].to(torch.int64) - 1)
    tok, dim = found
    half = bs * D
    out = []
    for lo in (0, half):
        t, d = tok[lo : lo + half], dim[lo : lo + half]
        if (t < 0).any() or (d < 0).any():
            return None  # the kernel left holes: not a layout we understand
        offsets = torch.empty(half, dtype=torch.int64)
        offsets[t * D + d] = torch.arange(half)
        out.append(offsets)
    return out[0], out[1]


def _tp() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # parallel state not initialised (single process tools)
        return 0, 1


class KvtcConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_sources(tc.kv_connector_extra_config)
        self.engine_id = str(tc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._kv_events: KvtcKVEvents | None = None
        self._scheduler: KvtcScheduler | None = None
        self._worker: KvtcWorker | None = None
        self._transfer = None
        if role == KVConnectorRole.SCHEDULER:
            if getattr(tc, "kv_load_failure_policy", None) != self.cfg.load_failure_policy:
                # vLLM's default "fail" turns a failed restore into a failed request; for a cache tier a failed
                # restore is a miss. The scheduler reads the policy right after creating this connector.
                log.info("KvtcConnector: kv_load_failure_policy=%s", self.cfg.load_failure_policy)
                tc.kv_load_failure_policy = self.cfg.load_failure_policy
            self._lookup_client: LookupClient | None = None
            self._scheduler = KvtcScheduler(self.cfg, self.block_size, self._match)
        else:
            tp_rank, tp_size = _tp()
            num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self._worker = KvtcWorker(
                self.cfg,
                engine_id=self.engine_id,
                model=str(vllm_config.model_config.model),
                hf_config=vllm_config.model_config.hf_config,
                block_size=self.block_size,
                num_blocks=num_blocks,
                tp_rank=tp_rank,
                tp_size=tp_size,
            )
            self._event_queue = _EventQueue(self.block_size)
        if self.cfg.transfer:
            from .transfer import TransferSide

            self._transfer = TransferSide(self.cfg, self.engine_id, role == KVConnectorRole.SCHEDULER)

    # ------------------------------------------------------------------ class hooks
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # per-layer waits are skipped inside full CUDA graphs

    # ------------------------------------------------------------------ scheduler side
    def _match(self, hashes):
        w = LOCAL_WORKERS.get(self.engine_id)
        if w is not None:
            return w.match(list(hashes))
        if self._lookup_client is None:
            self._lookup_client = LookupClient(self.engine_id)
        return self._lookup_client(hashes)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._transfer is not None and self._transfer.is_remote(request):
            return self._transfer.get_num_new_matched_tokens(request, num_computed_tokens, self.block_size)
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._transfer is not None and self._transfer.is_remote(request):
            self._transfer.update_state_after_alloc(request, blocks, num_external_tokens, self.block_size)
            st = self._scheduler._state(request)  # saves of this request on the decode side start after the fetch
            st.saved = max(st.saved, (request.num_computed_tokens + num_external_tokens) // self.block_size)
            return
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        plan = self._scheduler.build_meta(scheduler_output)
        if self._transfer is not None:
            self._transfer.add_to_plan(plan)
        return KvtcConnectorMetadata(plan)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        held, params = self._scheduler.request_finished(request, block_ids)
        if self._transfer is not None:
            return self._transfer.request_finished(request, block_ids, held, self._scheduler)
        return held, params

    def update_connector_output(self, connector_output: Any) -> None:
        ev = getattr(connector_output, "kv_cache_events", None)
        if not isinstance(ev, KvtcKVEvents):
            return
        if self._kv_events is None:
            self._kv_events = ev
        else:
            self._kv_events.add_events(ev.get_all_events())
            self._kv_events.increment_workers(ev.get_number_of_workers())

    def take_events(self):
        if self._kv_events is not None:
            events, self._kv_events = self._kv_events, None  # this step's batch (all workers) is consumed here
            events.aggregate()
            yield from events.get_all_events()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        offsets = None
        if first.dim() == 4 and first.device.type == "cpu":
            try:
                offsets = probe_cpu_offsets(first, self.block_size, str(self._vllm_config.cache_config.cache_dtype))
            except Exception as e:
                log.warning("kvtc: probing the CPU KV layout failed (%s); using the plain layout", e)
        self._worker.register_kv_caches(kv_caches, offsets=offsets)
        if self._worker.store is not None and self.cfg.publish_events:
            self._worker.store.listeners.append(self._event_queue)
        if self._transfer is not None:
            self._transfer.attach_worker(self._worker)

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
        events = self._event_queue.drain()
        if not events:
            return None
        out = KvtcKVEvents(num_workers=1)
        out.add_events(events)
        return out

    def shutdown(self) -> None:
        if self._transfer is not None:
            self._transfer.close()
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None and getattr(self, "_lookup_client", None) is not None:
            self._lookup_client.close()
