"""Tensor parallelism in the connector: each TP rank's tiers, and the JOINT calibration served by row-sharded codecs.

Two ways to serve a TP engine, chosen per calibration directory at start-up
(:func:`~dynamo_kvtc.connector.startup.joint_shard`):

- **Joint** (``dynamo-kvtc calibrate --tp-size N``: one calibration of all KV heads plus ``tp.json``): every rank
  codes its own heads with :class:`~dynamo_kvtc.codec.sharded.ShardedKvtcCodec` and all ranks write the same blob,
  the single-process blob of all heads. An encode is collective (an all-reduce of partial coefficients, all-gathers
  of sinks and the raw window); a restore is local. A ``tp.json`` made for another TP size refuses the engine with
  :func:`~dynamo_kvtc.calibration.tensor_parallel.check_tp_manifest`'s one line.
- **Per rank** (``rank<r>/`` calibrations, no ``tp.json``): each rank its own basis and blobs; no collective.

**The process group.** The collectives run on a gloo group of the TP ranks that the connector opens itself
(:func:`open_group`, at ``register_kv_caches``, when every rank is there): vLLM's TP communicator serves the forward
pass on another thread, and two threads' collectives on one group would pair with each other's. The group is keyed
under the default store of vLLM's ``torch.distributed`` world (a prefix of its own), so only the TP ranks take part.
Device tensors are staged through host memory (a few hundred bytes per token: :func:`~dynamo_kvtc.codec.sharded.
allreduce_bytes_per_token`).

**Same order on every rank.** A collective pairs with the other ranks' next one, so every rank must encode the same
spans in the same order. The scheduler's plan of a step is one object sent to every rank (its saves in one order);
each rank's worker submits them in that order to its offload worker, ONE thread running jobs first in, first out.
What a rank decides alone (a block already present, the admission filter, the offload queue's byte budget, the ratio
its host fill picks) could still differ, so with the joint codec every save queues a job on every rank, a skipped one
too, and each job starts with a vote (:class:`Agreement`: one all-gather of a few integers): the save is encoded only
when every rank wants the same blocks, at rank 0's ratio, else skipped on every rank (``offload_tp_disagreed``). A
rank whose own work fails inside an encode still takes part in every collective of it (zeros), and then every rank
drops that blob (:meth:`ShardedKvtcCodec.encode`). Votes that name different jobs (the ranks out of step), or a
collective that fails or times out (:data:`TIMEOUT_S`), stop the joint saves on that rank for good (logged once;
restores go on). The start-up vote (:func:`agree_start`) makes the ranks serve the joint calibration together or not
at all.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ...errors import TierError
from ...tiers.config import TierConfig

log = logging.getLogger(__name__)

TIMEOUT_S = 120.0  # a collective of the connector's group waits this long for the other ranks
_opened = itertools.count()  # groups opened by this process (each under a store prefix of its own)


def rank_tiers(tiers: TierConfig, tp_rank: int, tp_size: int) -> TierConfig:
    """This rank's tiers: ``cpu_cache_gb`` and ``disk_cache_gb`` are totals across the TP group, split evenly, and each
    rank gets its own disk directory. (Per-rank calibrations: each rank holds its heads' share of every block; the joint
    codec: each rank holds the whole blob of all heads, so the group holds ``tp_size`` copies.)"""
    if tp_size <= 1:
        return tiers
    kw: dict[str, Any] = {"host_bytes": tiers.host_bytes // tp_size, "disk_bytes": tiers.disk_bytes // tp_size}
    if tiers.disk_bytes and tiers.disk_dir is not None:
        kw["disk_dir"] = tiers.disk_dir / f"rank{tp_rank}"  # each rank its own head shard
    return tiers.with_(**kw)


class GlooCollective:
    """:class:`~dynamo_kvtc.codec.sharded.Collective` over a gloo process group; tensors on any device are staged
    through host memory, all-gathers move bytes (any dtype, bit for bit)."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        c = t.detach().to("cpu", copy=True).contiguous()
        self.group.allreduce([c]).wait()
        return c.to(t.device)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        c = t.detach().to("cpu").contiguous()
        if c.numel() == 0:
            return [c.to(t.device) for _ in range(self.size)]
        b = c.reshape(-1).view(torch.uint8)
        out = [torch.empty_like(b) for _ in range(self.size)]
        self.group.allgather([out], [b]).wait()
        return [o.view(c.dtype).view(c.shape).to(t.device) for o in out]


@dataclass
class TpGroup:
    """The connector's own process group of one engine's TP ranks."""

    rank: int
    size: int
    collective: GlooCollective


def _first_rank(tp_rank: int) -> int:
    """The global rank of this TP group's rank 0 (vLLM's TP group when there is one)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().ranks[0])
    except Exception:  # noqa: BLE001 - no vLLM parallel state: the world is the TP group
        import torch.distributed as dist

        return dist.get_rank() - tp_rank


def open_group(tp_rank: int, tp_size: int, timeout_s: float = TIMEOUT_S) -> TpGroup | None:
    """A gloo group of this engine's ``tp_size`` ranks, apart from vLLM's (every rank calls it once, at the same
    point); None when ``tp_size`` is 1 or no ``torch.distributed`` world is initialised (or it cannot be opened: logged;
    the joint calibration then refuses to start)."""
    if tp_size <= 1:
        return None
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        if not dist.is_available() or not dist.is_initialized():
            return None
        prefix = f"kvtc/tp/{_first_rank(tp_rank)}/{next(_opened)}"
        store = dist.PrefixStore(prefix, _get_default_store())
        pg = dist.ProcessGroupGloo(store, tp_rank, tp_size, timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - the joint codec then refuses with a reason; nothing else needs the group
        log.warning("kvtc: could not open the TP ranks' gloo group (%s: %s)", type(e).__name__, e)
        return None
    return TpGroup(tp_rank, tp_size, GlooCollective(pg, tp_size))


def agree_start(tp: TpGroup | None, store: Any) -> None:
    """The start-up vote, called once by every rank (``store`` None: this rank failed to set up): a rank serving the
    joint calibration goes on only when every rank does (TierError otherwise), and then votes on every save
    (:class:`Agreement`). Ranks with per-rank calibrations need no agreement."""
    if tp is None:
        return
    mode = 0 if store is None else 2 if getattr(store, "shard", None) is not None else 1
    try:
        modes = [int(m) for m in tp.collective.all_gather(torch.tensor([mode], dtype=torch.int64))]
    except Exception as e:  # noqa: BLE001 - a rank missing at start-up: this rank serves nothing
        raise TierError(f"the TP ranks' start-up vote failed ({type(e).__name__}: {e})") from None
    if mode == 2:
        others = [r for r, m in enumerate(modes) if m != 2]
        if others:
            raise TierError(
                f"TP rank(s) {others} cannot serve the joint calibration (they failed to start or use per-rank "
                "calibrations): the ranks encode together or not at all"
            )
        store.offloader.agree = Agreement(tp.collective, tp.rank)


class Agreement:
    """The per-save vote of the joint codec's ranks (runs on the offload worker, first in every job): ``(ratio, raw)``
    when every rank wants to encode the same blocks (rank 0's ratio and raw choice), else None. Votes naming
    different jobs, or a failed collective, stop it for good (``broken``: every later save skipped, no collective)."""

    def __init__(self, collective: Any, rank: int) -> None:
        self.collective, self.rank = collective, rank
        self.broken: str | None = None

    def __call__(self, vote: tuple[int, ...]) -> tuple[float, bool] | None:
        if self.broken is not None:
            return None
        try:
            got = self.collective.all_gather(torch.tensor([int(x) for x in vote], dtype=torch.int64))
        except Exception as e:  # noqa: BLE001 - a rank gone or stuck: no more joint saves
            return self._break(f"the save vote failed ({type(e).__name__}: {e})")
        votes = [tuple(int(x) for x in g.tolist()) for g in got]
        if any(v[:3] != votes[0][:3] for v in votes):
            return self._break(f"the TP ranks' saves are out of step (votes {votes})")
        if all(v[3] for v in votes) and len({v[4:6] for v in votes}) == 1:
            return votes[0][6] / 1000, bool(votes[0][7])
        return None

    def _break(self, why: str) -> None:
        self.broken = why
        log.error("kvtc TP rank %d: joint-codec saves stop (restores go on): %s", self.rank, why)
        return None
