"""``KvtcConnector``: dynamo_kvtc as a vLLM KV connector (``KVConnectorBase_V1``, vLLM 0.31 API; loads on 0.32/0.33).

Use it from vLLM or from ``python -m dynamo.vllm``::

    --kv-transfer-config '{"kv_connector": "KvtcConnector", "kv_connector_module_path": "dynamo_kvtc.connector.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_cache_gb": 8, "ratio": 16}}'

The class is a thin delegate: :class:`~dynamo_kvtc.connector.vllm.scheduler.KvtcScheduler` (scheduler role) and
:class:`~dynamo_kvtc.connector.vllm.worker.KvtcWorker` (worker role) hold the logic, and
:mod:`~dynamo_kvtc.connector.handoff` the compressed prefill→decode hand-off. Layer-wise restore needs eager mode or
PIECEWISE CUDA graphs (``requires_piecewise_for_cudagraph``).

**A failed restore is a recompute, or nothing is restored.** vLLM's scheduler reads ``kv_load_failure_policy``
from the engine's top-level ``KVTransferConfig`` (default ``fail``: a failed load fails the user's request). Alone,
that config is the one this connector is given, and its scheduler half sets the connector's ``load_failure_policy``
there (:func:`set_failure_policy`). Inside ``MultiConnector`` each child gets a fresh copy, which vLLM does not read:
the operator sets ``"kv_load_failure_policy": "recompute"`` at the top level (docs/deployment.md). The worker half
checks it: vLLM makes the engine's own config available while it builds the worker's connectors
(``get_current_vllm_config_or_none``), and where that config is another connector's whose policy would fail a request
on a failed restore, the worker disables itself with one error line naming the setting (:func:`failure_policy_refusal`;
every lookup a miss, so nothing is ever loaded). Where the policy cannot be set at all, the scheduler half refuses to
restore anything. A miss costs a recompute; a failed load would cost the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from ...calibration.mla import is_mla
from ...errors import KvtcError
from ...logs import operator_logging
from ...tiers.layouts import detect_layout
from ...tiers.layouts.cpu import probe_cpu_offsets
from ..config import ConnectorConfig, from_environment
from ..kv_events import EventCollector, EventQueue, KvtcKVEvents
from .guard import shielded
from .lookup import LazyLookup
from .remote_prefill import RemotePrefill
from .scheduler import KvtcScheduler
from .stats import KvtcConnectorStats, KvtcPromMetrics, StatsReporter
from .step_plan import StepPlan
from .worker import KvtcWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _register() -> None:
    """Register the class by name too: MultiConnector rebuilds a child's stats in the front-end process by class
    name (``get_connector_class_by_name``), which only knows registered connectors."""
    try:
        KVConnectorFactory.register_connector("KvtcConnector", __name__, "KvtcConnector")
    except ValueError:
        pass  # already registered (this module imported twice, or vLLM ships one)


_register()


@dataclass
class KvtcConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


def _kv_bytes_per_token(vllm_config: Any) -> int:
    """16-bit K and V bytes of one token on one TP rank (what a raw hand-off READs per token), from the model's
    fingerprint; 0 when the model config does not say (the link policy then takes every offer compressed)."""
    from ...calibration.models import fingerprint_of

    try:
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        fp = replace(fingerprint_of(mc.hf_config), num_kv_heads=int(mc.get_num_kv_heads(pc)))
        return fp.raw_bytes_per_token()
    except (AttributeError, TypeError, ValueError, KeyError, KvtcError) as e:
        log.warning("kvtc: KV size per token unknown (%s); the hand-off link policy takes every offer compressed", e)
        return 0


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
    from ..handoff.client import HandoffClient

    try:
        return HandoffClient(cfg)
    except KvtcError as e:
        log.error("kvtc compressed hand-off unavailable (requests recompute instead): %s", e)
        return None


def set_failure_policy(own: Any, policy: str) -> bool:
    """Set ``policy`` on the ``KVTransferConfig`` this connector was given (the engine's own when it is the top-level
    connector: vLLM's scheduler reads it right after building the connector); False when the config refuses."""
    if getattr(own, "kv_load_failure_policy", None) == policy:
        return True
    try:
        own.kv_load_failure_policy = policy
    except Exception as e:  # noqa: BLE001 - a frozen or validating config
        log.error("KvtcConnector: cannot set kv_load_failure_policy=%s on %s: %s", policy, own.kv_connector, e)
        return False
    log.info("KvtcConnector: kv_load_failure_policy=%s", policy)
    return True


def engine_transfer_config() -> Any:
    """The engine's own (top-level) ``KVTransferConfig`` while vLLM builds a worker's connectors, or None where vLLM
    does not say (its current-config context is unset, or this vLLM has none)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    engine = get_current_vllm_config_or_none()
    return getattr(engine, "kv_transfer_config", None)


def failure_policy_refusal(own: Any, engine: Any, policy: str) -> str | None:
    """Why this connector must not restore (one line), or None: a failed restore is a recompute. ``own``: the config
    the connector was given; ``engine``: the engine's top-level one (:func:`engine_transfer_config`; None: unknown,
    warned about). Alone (``engine is own``) the scheduler half sets the policy; inside a wrapper the top-level
    policy is the operator's, and a ``fail`` there would fail a request on a failed restore."""
    if policy != "recompute" or engine is own:
        return None
    if engine is None:
        log.warning(
            "KvtcConnector: vLLM does not say which kv_transfer_config its scheduler reads; inside MultiConnector "
            "set kv_load_failure_policy: recompute at the top level of --kv-transfer-config"
        )
        return None
    if getattr(engine, "kv_load_failure_policy", None) == "recompute":
        return None
    return (
        f"inside {engine.kv_connector}, vLLM applies the top-level kv_load_failure_policy "
        f"({getattr(engine, 'kv_load_failure_policy', None)!r}), so a failed restore would fail the request: set "
        '"kv_load_failure_policy": "recompute" at the top level of --kv-transfer-config'
    )


class KvtcConnector(KVConnectorBase_V1):
    """dynamo_kvtc as a vLLM KV connector: exactly one of a scheduler half or a worker half, by role.

    Owns nothing but the half it built and the settings. Every hook is one delegating call; the logic lives in
    :class:`~dynamo_kvtc.connector.vllm.scheduler.KvtcScheduler` and
    :class:`~dynamo_kvtc.connector.vllm.worker.KvtcWorker`.
    It must never raise into the engine on a cache fault."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        operator_logging()  # the ready line and warnings in vLLM's log at its level
        tc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_sources(tc.kv_connector_extra_config)
        self.engine_id = str(tc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: KvtcScheduler | None = None
        self._worker: KvtcWorker | None = None
        self._stats: StatsReporter | None = None
        self.refuse_loads = False  # True when a failed restore could fail a request: every lookup then misses
        if role == KVConnectorRole.SCHEDULER:
            # vLLM's default "fail" turns a failed restore into a failed request; for a cache tier a failed restore
            # is a miss. The scheduler reads the policy from the top-level config right after creating connectors
            # (alone: this one; inside a wrapper the worker half checks the wrapper's).
            if not set_failure_policy(tc, self.cfg.load_failure_policy):
                self.refuse_loads = self.cfg.load_failure_policy == "recompute"
                log.error(
                    "KvtcConnector refuses to restore (every request recomputes): the engine's "
                    "kv_load_failure_policy could not be set to recompute; set it at the top level of "
                    "--kv-transfer-config"
                )
            self._lookup = LazyLookup(self.engine_id)
            remote = None
            if self.cfg.transfer:
                remote = RemotePrefill(
                    self.cfg,
                    self.engine_id,
                    self.block_size,
                    self._lookup.handoff_port,
                    kv_bytes_per_token=_kv_bytes_per_token(vllm_config),
                )
            self._scheduler = KvtcScheduler(
                self.cfg, self.block_size, self._lookup, remote, refuse_loads=self.refuse_loads
            )
            self._events = EventCollector(self._scheduler.lora_of)  # LoRA blocks carry their adapter
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
                kv_cache_dtype=str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
                refusal=failure_policy_refusal(tc, engine_transfer_config(), self.cfg.load_failure_policy),
                from_env=from_environment(tc.kv_connector_extra_config),
            )
            if tp_rank == 0:  # one rank's view, like the kvtc_* endpoint
                self._stats = StatsReporter(self._worker)

    @property
    def worker(self) -> KvtcWorker | None:
        """The worker half (None in the scheduler role): what an in-process scheduler or a test asks."""
        return self._worker

    # ------------------------------------------------------------------ class hooks
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # per-layer waits are skipped inside full CUDA graphs

    # -------------------------------------------------------------- scheduler side (connector/vllm/guard.py: a miss)
    @shielded(lambda self, *a, **k: (0, False), (0, False))
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @shielded(lambda self, *a, **k: self._scheduler.fail_alloc(*a, **k))
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @shielded(lambda self, *a, **k: KvtcConnectorMetadata(self._scheduler.take_plan()), KvtcConnectorMetadata)
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KvtcConnectorMetadata(self._scheduler.build_meta(scheduler_output))

    @shielded(lambda self, request, *a, **k: self._scheduler.finished_held(request), (False, None))
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._events.add(connector_output)

    def take_events(self):
        yield from self._events.take()

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches, offsets=self._cpu_offsets(kv_caches), scales=self._scales(kv_caches))

    def _scales(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]] | None:
        """An FP8 cache's per-layer (k_scale, v_scale), from the attention layers vLLM registered (None otherwise)."""
        if not str(self._vllm_config.cache_config.cache_dtype).startswith("fp8"):
            return None
        try:
            layers = self._vllm_config.compilation_config.static_forward_context
            return {n: (float(layers[n]._k_scale_float), float(layers[n]._v_scale_float)) for n in kv_caches}
        except (AttributeError, KeyError, TypeError) as e:
            log.warning("kvtc: cannot read the FP8 KV scales (%s); the connector disables itself", e)
            return {}  # the worker refuses: encoding with guessed scales would restore wrong values

    def _cpu_offsets(self, kv_caches: dict[str, torch.Tensor]):
        """The ``cpu`` layout's element order, probed through vLLM's own cache-write kernel (bf16, fp16 and FP8
        caches); None for any other layout."""
        first = next(iter(kv_caches.values()))
        mc = self._vllm_config.model_config
        try:
            if first.device.type != "cpu" or detect_layout(first, None, mla=is_mla(mc.hf_config)) != "cpu":
                return None
        except KvtcError:
            return None  # the worker refuses this cache with its own reason
        try:
            cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
            return probe_cpu_offsets(first, self.block_size, cache_dtype, model_dtype=mc.dtype)
        except Exception as e:  # noqa: BLE001 - the worker refuses the cache with this reason (never reads it as plain)
            return e

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

    # ------------------------------------------------------------------ vLLM's own metrics
    def get_kv_connector_stats(self) -> KvtcConnectorStats | None:
        return self._stats.take() if self._stats is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtcConnectorStats:
        return KvtcConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict
    ) -> KvtcPromMetrics:
        return KvtcPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._lookup.close()
