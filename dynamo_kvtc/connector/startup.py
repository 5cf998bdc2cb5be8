"""One start-up for the three ways in: what KvtcConnector's worker, the vLLM ``kvtc`` tier and the LMCache ``kvtc``
serde open before they serve, in one function (:func:`open_tier`) with one set of checks and messages.

In order: the model's family (:func:`~dynamo_kvtc.connector.support.decide`: hybrid, sparse-MLA, RoPE-less models
refused; MLA refused by a way in that reads K/V pages), the way in's own engine checks (``engine``: KvtcConnector's KV
cache dtype and layout), the calibration directory (the setting, else the catalog's lookup by model name; a TP rank's
``rank<r>/``), its ``calibration.json``, the calibration against the served model's fingerprint (a joint TP
calibration: its ``tp.json`` and this rank's :class:`~dynamo_kvtc.codec.factory.Shard`), ``ratio: auto`` (the
calibration's checked ratio, :mod:`~dynamo_kvtc.calibration.verdict`), the ratio's plan, and the codec
(:func:`~dynamo_kvtc.codec.factory.make_codec`). The result is one :class:`Opened`; a refusal is its ``why_not``
(:class:`WhyNot`: a metric label, the setting it concerns, one line), never an exception: KvtcConnector then serves
without its tiers (every lookup a miss), the vLLM tier and the serde stop the engine with the line
(:meth:`Opened.raise_for`) naming the option as the way in spells it.
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
from .support import Family, decide

log = logging.getLogger(__name__)


class Refusal(KvtcError):
    """A start-up refusal with its metric label (``reason``) and the setting it concerns (``key``)."""

    def __init__(self, reason: str, key: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.key = reason, key


@dataclass(frozen=True)
class WhyNot:
    """Why a way in serves without the tier: ``reason`` (the metric label: model, kv_cache_dtype, layout,
    calibration, codec), ``key`` (the setting it concerns, "" none) and one line."""

    reason: str
    key: str
    message: str

    def error(self, way: str) -> ConfigError:
        """The start-up error of a way in that refuses to start (the option named as ``way`` spells it)."""
        return ConfigError(f"{settings.origin(way, self.key)}: {self.message}" if self.key else self.message)


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

    def raise_for(self, way: str) -> Opened:
        """``self``, or the refusal as the ConfigError of a way in that stops the engine."""
        if self.why_not is not None:
            raise self.why_not.error(way)
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
            raise Refusal("calibration", "calibration", "is not set and no model name was given to look one up by")
        tools = tools or settings.tool_settings()
        # a fitting one by name or fingerprint; else one by name alone, which the fingerprint check then refuses
        # naming what differs
        path = find_calibration(model, tools, fingerprint) or find_calibration(model, tools)
        if path is None:
            raise Refusal(
                "calibration",
                "calibration",
                f"{not_found(model, fingerprint, tools)} ({settings.origin(way, 'calibration')})",
            )
    path = Path(path)
    per_rank = path / f"rank{tp_rank}" / "calibration.json"
    if tp_size > 1 and not (path / TP_MANIFEST).is_file() and per_rank.is_file():  # tp.json: the joint one
        path = path / f"rank{tp_rank}"
    if not (path / "calibration.json").is_file():
        raise Refusal("calibration", "calibration", f"calibration directory {path} has no calibration.json")
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
        raise TierError(
            "a joint calibration under tensor parallelism needs the TP ranks' torch.distributed world (vLLM's "
            "workers), and none could be used: give each rank its own calibration (rank<r>/) instead"
        )
    return Shard(tp_rank, layout, tp.collective)


def check_device(way: str, device: str) -> None:
    """Refuse ``device: cuda`` where CUDA is absent (the vLLM tier and the LMCache serde)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{settings.origin(way, 'device')}: 'cuda' requested but CUDA is not available here")


def torch_device(device: str, tensor: torch.Tensor | None = None) -> torch.device:
    """The device of ``device: auto|cpu|cuda`` (``auto``: ``tensor``'s GPU when it has one, else CUDA when present)."""
    if device != "auto":
        return torch.device(device)
    if tensor is not None and tensor.device.type == "cuda":
        return tensor.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _ratio(cal: Calibration, path: Path, ratio: float | str, policy: str, model: str | None) -> float:
    if ratio == AUTO:  # the calibration's checked safe ratio (`dynamo-kvtc check ... --write`)
        ratio = safe_ratio(path, cal.id, cal.ratios, model)
    planned = [float(r) for r in cal.ratios]
    if float(ratio) in planned:
        return float(ratio)
    if policy == "raw":  # nothing is compressed: any plan of the calibration codes the raw blobs
        return planned[0]
    raise Refusal("calibration", "ratio", f"{float(ratio):g} has no plan in calibration {path} ({cal.ratios})")


def _mla_refusal(way: str, what: str) -> Refusal:
    return Refusal("model", "calibration", f"{what} is an MLA model's: the {settings.WAY_LABELS[way]} reads K/V "
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
) -> Opened:
    """Open what way in ``way`` (``extra``: KvtcConnector, ``vllm_tier``, ``lmcache_serde``) serves with; see the
    module docstring. ``hf_config``: the served model's config (None: unknown, no family or fingerprint check);
    ``engine``: the way in's own checks of its engine, run after the family decision and before the calibration,
    given the model's fingerprint (this rank's heads) and returning the fingerprint as the engine serves it (they
    raise :class:`Refusal` or a KvtcError: reason ``layout``); ``codec``: build the codec too."""
    reason, key = "model", ""
    family = fp = full = None
    try:
        if hf_config is not None:
            family = decide(hf_config, tp_size)  # docs/models.md's table, from the config alone
            if family.key == "mla" and not serves_mla:
                raise _mla_refusal(way, f"model {model or ''}".strip())
            full = fingerprint_of(hf_config)
            fp = replace(full, num_kv_heads=max(1, full.total_kv_heads // tp_size), tp_rank=tp_rank, tp_size=tp_size)
        reason = "layout"
        if engine is not None:
            fp = engine(fp)
        reason, key = "calibration", "calibration"
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
        reason, key = "codec", "device"
        built = None
        if codec is not None:
            built = make_codec(cal, ratio=served, device=codec.device, options=codec.options, sinks=codec.sinks,
                               window=codec.window, tag=codec.tag, shard=shard)  # fmt: skip
    except Refusal as e:
        return Opened(family=family, fingerprint=fp, why_not=WhyNot(e.reason, e.key, str(e)))
    except (KvtcError, OSError, ValueError) as e:
        return Opened(family=family, fingerprint=fp, why_not=WhyNot(reason, key, str(e)))
    return Opened(cal, path, served, policy, family, fp, shard, built)
