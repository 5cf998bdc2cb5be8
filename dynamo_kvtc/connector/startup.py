"""One start-up for the three ways in: what KvtcConnector's worker, the vLLM ``kvtc`` tier and the LMCache ``kvtc``
serde open before they serve, in one function (:func:`open_tier`) with one set of checks and messages.

In order: the model's family (:func:`~dynamo_kvtc.connector.support.decide`: hybrid, sparse-MLA, RoPE-less models
refused; MLA refused by a way in that reads K/V pages), the way in's own engine checks (``engine``: KvtcConnector's KV
cache dtype and layout), the calibration directory (the setting, else the catalog's lookup by model name; a TP rank's
``rank<r>/``), its ``calibration.json``, the calibration against the served model's fingerprint (a joint TP
calibration: its ``tp.json`` and this rank's :class:`~dynamo_kvtc.codec.factory.Shard`), ``ratio: auto`` (the
calibration's checked ratio, :mod:`~dynamo_kvtc.calibration.verdict`), the ratio's plan, and the codec
(:func:`~dynamo_kvtc.codec.factory.make_codec`). Before the calibration, the
store the way in will open (:class:`StoreSpec`: a cache size that makes the tier a no-op, a disk folder that cannot
be used). The result is one :class:`Opened`; a refusal is its ``why_not`` (:class:`WhyNot`: a metric label, the
setting it concerns, one line, and whether it is invalid configuration), never an exception.

**The start-up rule** (the same for every way in, applied by :meth:`Opened.settle`; docs/configuration.md): invalid
configuration (a value the operator set that cannot work: a calibration that is missing, unreadable or made for
another model, a ratio with no plan, ``ratio: auto`` with no verdict to resolve it, a disk folder that cannot be used,
a cache size that stores nothing) stops the engine with ONE line, a :class:`~dynamo_kvtc.errors.ConfigError` naming
the key as the operator wrote it (the way in's option, or the ``DYN_KVTC_*`` variable when the environment set it).
A runtime limitation of the machine or the model (a model family or KV layout the way in does not serve, an 8-bit KV
cache it cannot read, no CUDA for ``device: cuda``, a codec that cannot be built here) serves WITHOUT the tier (every
lookup a miss) with one WARNING line and ``kvtc_enabled{reason}`` 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .. import settings
from ..calibration.artifact import Calibration
from ..calibration.catalog import find_calibration, not_found
from ..calibration.mla import is_mla_fingerprint
from ..calibration.models import fingerprint_of
from ..calibration.tensor_parallel import TP_MANIFEST, check_tp_manifest
from ..calibration.verdict import safe_ratio
from ..codec.base import Codec
from ..codec.factory import Shard, make_codec
from ..codec.model import ModelFingerprint
from ..codec.options import CodecOptions
from ..errors import ConfigError, KvtcError, TierError
from ..tiers.config import AUTO
from ..tiers.disk_dir import disk_dir_problem
from .support import Family, decide

log = logging.getLogger(__name__)


INVALID = "config"  # the metric label of invalid configuration (the engine stops; nothing is served to label)


class Refusal(TierError):
    """A start-up refusal with its metric label (``reason``), the setting it concerns (``key``) and whether it is
    invalid configuration (``invalid``: the engine stops) rather than a runtime limitation (served without the
    tier)."""

    def __init__(self, reason: str, key: str, message: str, invalid: bool = False) -> None:
        super().__init__(message)
        self.reason, self.key, self.invalid = reason, key, invalid


@dataclass(frozen=True)
class WhyNot:
    """Why a way in does not serve with the tier: ``reason`` (the metric label: model, kv_cache_dtype, layout,
    device, codec; ``config`` for invalid configuration), ``key`` (the setting it concerns, "" none), one line, and
    ``invalid`` (invalid configuration: the engine stops; else a runtime limitation: served without the tier)."""

    reason: str
    key: str
    message: str
    invalid: bool = False

    def error(self, way: str) -> ConfigError:
        """The start-up error naming the option as ``way`` spells it (``env``: the ``DYN_KVTC_*`` variable)."""
        return ConfigError(f"{settings.origin(way, self.key)}: {self.message}" if self.key else self.message)


@dataclass(frozen=True)
class StoreSpec:
    """The store a way in will open, checked before the calibration: host bytes, disk bytes, the disk folder."""

    host_bytes: int
    disk_bytes: int = 0
    disk_dir: Path | None = None


def check_store(spec: StoreSpec) -> None:
    """Refuse (invalid configuration) a store that could hold nothing, or a disk folder that cannot be used."""
    if spec.host_bytes <= 0 and spec.disk_bytes <= 0:
        raise Refusal(INVALID, "cpu_cache_gb", "is 0 and there is no disk tier (disk_cache_gb 0): the tier could "
                      "store nothing and every offload would fail; set cpu_cache_gb > 0 or a disk tier",
                      invalid=True)  # fmt: skip
    if spec.disk_bytes > 0:
        if spec.disk_dir is None:
            raise Refusal(INVALID, "disk_cache_dir", "is required when disk_cache_gb > 0", invalid=True)
        why = disk_dir_problem(Path(spec.disk_dir))
        if why is not None:
            raise Refusal(INVALID, "disk_cache_dir", why, invalid=True)


@dataclass(frozen=True)
class CodecSpec:
    """How to build the codec: ``device`` and the codec's own knobs (see :func:`make_codec`)."""

    device: Any
    window: int = 128
    sinks: int = 4
    options: CodecOptions | None = None
    tag: str | None = None


@dataclass(frozen=True)
class Opened:
    """What a way in opened: the calibration (and its directory), the ratio it serves at (``auto`` resolved; under
    ``raw`` a planned ratio of the calibration), the ratio policy, the model's family and fingerprint as served
    (None: unknown), this TP rank's shard of a joint calibration, the codec (when asked for), or ``why_not``."""

    calibration: Calibration | None = None
    path: Path | None = None
    ratio: float | None = None
    policy: str = "fixed"
    family: Family | None = None
    fingerprint: ModelFingerprint | None = None
    shard: Shard | None = None
    codec: Codec | None = None
    why_not: WhyNot | None = None

    def settle(self, way: str, from_env: frozenset[str] | set[str] = frozenset()) -> Opened:
        """The start-up rule (module docstring): invalid configuration raises its one-line ConfigError naming the
        option (the ``DYN_KVTC_*`` variable when its key is in ``from_env``: set by the environment); a runtime
        limitation logs one WARNING line and returns ``self`` (its ``why_not`` set: serve without the tier)."""
        w = self.why_not
        if w is None:
            return self
        if w.invalid:
            raise w.error("env" if w.key in from_env else way) from None
        log.warning("kvtc (%s): serving without the tier (%s; kvtc_enabled 0): %s", settings.WAY_LABELS[way],
                    w.reason, w.message)  # fmt: skip
        return self

    def make(self, spec: CodecSpec) -> Codec:
        """Another codec of this calibration at the served ratio (the LMCache serde's per device and tag)."""
        return make_codec(self.calibration, ratio=self.ratio, device=spec.device, options=spec.options,
                          sinks=spec.sinks, window=spec.window, tag=spec.tag, shard=self.shard)  # fmt: skip


def calibration_dir(
    calibration: str | Path | None,
    model: str | None,
    way: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    tools: Any = None,
    fingerprint: ModelFingerprint | None = None,
) -> Path:
    """The calibration directory: ``calibration`` when set, else :func:`find_calibration`'s for ``model`` (the
    normalised model name under ``DYN_KVTC_CALIBRATIONS`` or the repository's ``calibrations/``, then
    ``<DYN_KVTC_CACHE>/calibrations``; with the served model's ``fingerprint``, a folder found by name must fit it,
    and any calibration in those folders that fits is found whatever its folder is called); under TP its ``rank<r>/``
    when there is one and no ``tp.json`` (a joint calibration). Raises Refusal (key ``calibration``) naming the
    setting as ``way`` spells it, and the nearest calibrations with what differs."""
    path = calibration
    if path is None:
        if not model:
            raise Refusal(INVALID, "calibration", "is not set and no model name was given to look one up by", True)
        tools = tools or settings.tool_settings()
        # a fitting one by name or fingerprint; else one by name alone, which the fingerprint check then refuses
        # naming what differs
        path = find_calibration(model, tools, fingerprint) or find_calibration(model, tools)
        if path is None:
            raise Refusal(
                INVALID,
                "calibration",
                f"{not_found(model, fingerprint, tools)} ({settings.origin(way, 'calibration')})",
                invalid=True,
            )
    path = Path(path)
    per_rank = path / f"rank{tp_rank}" / "calibration.json"
    if tp_size > 1 and not (path / TP_MANIFEST).is_file() and per_rank.is_file():  # tp.json: the joint one
        path = path / f"rank{tp_rank}"
    if not (path / "calibration.json").is_file():
        raise Refusal(INVALID, "calibration", f"calibration directory {path} has no calibration.json", invalid=True)
    return path


def joint_shard(
    path: Path, cal: Calibration, model: ModelFingerprint, rank_heads: int, tp_rank: int, tp_size: int, tp: Any
) -> Shard | None:
    """This rank's :class:`~dynamo_kvtc.codec.factory.Shard` when ``cal`` (loaded from ``path``) is a JOINT
    calibration served at ``tp_size`` > 1, checked against the served ``model`` (all heads) and ``tp.json`` (one-line
    refusal on a mismatch); None for a per-rank calibration or tp 1. ``tp``: the TP ranks' group (its collective)."""
    if tp_size <= 1 or cal.fingerprint.tp_size != 1:
        return None
    layout = check_tp_manifest(path, tp_size, tp_rank, rank_heads)
    cal.check_model(model)
    if tp is None:
        raise Refusal("tensor_parallel", "",
            "a joint calibration under tensor parallelism needs the TP ranks' torch.distributed world (vLLM's "
            "workers), and none could be used: give each rank its own calibration (rank<r>/) instead"
        )
    return Shard(tp_rank, layout, tp.collective)


def check_device(device: str | None) -> None:
    """Refuse ``device: cuda`` where CUDA is absent (a runtime limitation: served without the tier)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise Refusal("device", "device", "'cuda' requested but CUDA is not available here")


def torch_device(device: str, tensor: torch.Tensor | None = None) -> torch.device:
    """The device of ``device: auto|cpu|cuda`` (``auto``: ``tensor``'s GPU when it has one, else CUDA when present)."""
    if device != "auto":
        return torch.device(device)
    if tensor is not None and tensor.device.type == "cuda":
        return tensor.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _ratio(cal: Calibration, path: Path, ratio: float | str, policy: str, model: str | None) -> float:
    if ratio == AUTO:  # the calibration's checked safe ratio (`dynamo-kvtc check ... --write`)
        try:
            ratio = safe_ratio(path, cal.id, cal.ratios, model)
        except KvtcError as e:  # no verdict (or one that does not resolve): a ratio policy that cannot be served
            raise Refusal(INVALID, "ratio", str(e), invalid=True) from None
    planned = [float(r) for r in cal.ratios]
    if float(ratio) in planned:
        return float(ratio)
    if policy == "raw":  # nothing is compressed: any plan of the calibration codes the raw blobs
        return planned[0]
    raise Refusal(INVALID, "ratio", f"{float(ratio):g} has no plan in calibration {path} ({cal.ratios})", True)


def _mla_refusal(way: str, what: str) -> Refusal:
    return Refusal("model", "", f"{what} is an MLA model's: the {settings.WAY_LABELS[way]} reads K/V "
                   "pages; MLA is served through KvtcConnector (docs/models.md)")  # fmt: skip


def open_tier(
    way: str,
    *,
    calibration: str | Path | None,
    model: str | None,
    ratio: float | str,
    policy: str = "fixed",
    hf_config: Any = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp: Any = None,
    engine: Callable[[ModelFingerprint | None], ModelFingerprint | None] | None = None,
    serves_mla: bool = True,
    codec: CodecSpec | None = None,
    tools: Any = None,
    store: StoreSpec | None = None,
    device: str | None = None,
) -> Opened:
    """Open what way in ``way`` (``extra``: KvtcConnector, ``vllm_tier``, ``lmcache_serde``) serves with; see the
    module docstring. ``hf_config``: the served model's config (None: unknown, no family or fingerprint check);
    ``engine``: the way in's own checks of its engine, run after the family decision and before the calibration,
    given the model's fingerprint (this rank's heads) and returning the fingerprint as the engine serves it (they
    raise :class:`Refusal` or a KvtcError: reason ``layout``); ``codec``: build the codec too; ``store``: the store it
    will open (checked first: invalid configuration); ``device``: the ``device`` option (``cuda`` without CUDA: a
    limitation). Apply the start-up rule to the result with :meth:`Opened.settle`."""
    reason, key, invalid = INVALID, "", True
    family = fp = full = None
    try:
        if store is not None:
            check_store(store)
        reason, invalid = "device", False
        check_device(device)
        reason = "model"
        if hf_config is not None:
            family = decide(hf_config, tp_size)  # docs/models.md's table, from the config alone
            if family.key == "mla" and not serves_mla:
                raise _mla_refusal(way, f"model {model or ''}".strip())
            full = fingerprint_of(hf_config)
            fp = replace(full, num_kv_heads=max(1, full.total_kv_heads // tp_size), tp_rank=tp_rank, tp_size=tp_size)
        reason = "layout"
        if engine is not None:
            fp = engine(fp)
        reason, key, invalid = INVALID, "calibration", True  # the calibration the operator named (or ran) is theirs
        path = calibration_dir(calibration, model, way, tp_rank, tp_size, tools, full)
        cal = Calibration.load(path)
        if not serves_mla and is_mla_fingerprint(cal.fingerprint):
            raise _mla_refusal(way, f"calibration {path}")
        shard = None
        if full is not None and fp is not None:
            shard = joint_shard(path, cal, full, fp.num_kv_heads, tp_rank, tp_size, tp)
            if shard is None:
                cal.check_model(fp)
        key = "ratio"
        served = _ratio(cal, path, ratio, policy, model)
        reason, key, invalid = "codec", "", False  # the codec could not be built on this machine
        built = None
        if codec is not None:
            built = make_codec(cal, ratio=served, device=codec.device, options=codec.options, sinks=codec.sinks,
                               window=codec.window, tag=codec.tag, shard=shard)  # fmt: skip
    except Refusal as e:
        return Opened(family=family, fingerprint=fp, why_not=WhyNot(e.reason, e.key, str(e), e.invalid))
    except (KvtcError, OSError, ValueError) as e:
        return Opened(family=family, fingerprint=fp, why_not=WhyNot(reason, key, str(e), invalid))
    return Opened(cal, path, served, policy, family, fp, shard, built)
