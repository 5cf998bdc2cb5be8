"""What the codec needs to know about a model shard and its calibrated bases (no I/O here).

- :class:`ModelFingerprint` identifies the KV layout a calibration was made for: architecture, layers, KV heads of the
  shard, head_dim, dtype, per-layer rotary configuration, tokenizer, tensor-parallel rank and size.
- :class:`BasisGroup` holds one layer group's PCA means and bases for K and V and the DP plans per ratio.

:class:`~dynamo_kvtc.calibration.Calibration` composes these with provenance and persistence; the codec accepts any
object that has ``id``, ``fingerprint``, ``groups`` and ``ratios`` (:class:`CalibrationLike`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch

from ..errors import CalibrationError, CalibrationMismatchError
from .plan import Plan
from .rope import RotaryConfig

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in DTYPES.items():
        if v == dtype:
            return k
    raise KeyError(dtype)


@dataclass(frozen=True)
class ModelFingerprint:
    architecture: str
    num_layers: int
    num_kv_heads: int  # KV heads held by this shard
    head_dim: int
    dtype: str
    rotary: tuple[RotaryConfig, ...]  # one per layer
    tokenizer: str = ""
    model_name: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    total_kv_heads: int = 0  # KV heads of the whole model (0 = same as num_kv_heads)
    windows: tuple[int, ...] = ()  # per layer: the most recent tokens its cache keeps (0 = all; () = every layer all)

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise CalibrationError("fingerprint needs positive num_layers, num_kv_heads and head_dim")
        if len(self.rotary) != self.num_layers:
            raise CalibrationError(f"fingerprint has {len(self.rotary)} rotary configs for {self.num_layers} layers")
        if self.dtype not in DTYPES:
            raise CalibrationError(f"fingerprint dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if not (0 <= self.tp_rank < self.tp_size):
            raise CalibrationError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.windows and (len(self.windows) != self.num_layers or any(w < 0 for w in self.windows)):
            raise CalibrationError(f"fingerprint needs one window >= 0 per layer, got {self.windows}")
        object.__setattr__(self, "windows", tuple(int(w) for w in self.windows) if any(self.windows) else ())

    @property
    def features(self) -> int:
        """p: features per token for K (and for V) across all layers and KV heads of the shard."""
        return self.num_layers * self.num_kv_heads * self.head_dim

    def raw_bytes_per_token(self, dtype: torch.dtype | str | None = None) -> int:
        """Bytes of one token's K and V over all layers and KV heads of the shard, uncompressed, with elements of
        ``dtype`` (a torch dtype or a name of ``DTYPES``; None: the fingerprint's own ``dtype``)."""
        if dtype is None or isinstance(dtype, str):
            dtype = DTYPES[dtype or self.dtype]
        return 2 * self.features * dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "rotary": [r.to_dict() for r in self.rotary],
            "tokenizer": self.tokenizer,
            "model_name": self.model_name,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "total_kv_heads": self.total_kv_heads,
            **({"windows": list(self.windows)} if self.windows else {}),  # absent without sliding layers: same ids
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelFingerprint:
        try:
            d = dict(d)
            d["rotary"] = tuple(RotaryConfig.from_dict(r) for r in d["rotary"])
            d["windows"] = tuple(d.get("windows") or ())
            return cls(**d)
        except (KeyError, TypeError) as e:
            raise CalibrationError(f"malformed model fingerprint: {e}") from e

    def mismatches(self, other: ModelFingerprint, *, strict: bool = True) -> list[str]:
        """The differences that make a calibration (``self``) unusable for ``other``, each as ``"<field> <ours> vs
        <theirs>"`` (``"num_layers 6 vs 4"``, ``"rope theta 1000000.0 vs 10000.0"``). A difference another one
        implies is left out: per-layer RoPE and windows when the layer counts differ, RoPE's head_dim when head_dim
        does."""
        keys = ["architecture", "num_layers", "num_kv_heads", "head_dim", "tp_rank", "tp_size"]
        keys += ["windows"] if self.num_layers == other.num_layers else []
        keys += ["tokenizer"] if strict else []
        out = []
        for k in keys:
            a, b = getattr(self, k), getattr(other, k)
            if a != b and not (k in ("tokenizer", "windows") and (not a or not b)):
                out.append(f"{k} {_say(a)} vs {_say(b)}")
        if self.num_layers == other.num_layers and self.rotary != other.rotary:
            out += _rotary_mismatches(self.rotary, other.rotary, skip_head_dim=self.head_dim != other.head_dim)
        return out

    def check_matches(self, other: ModelFingerprint) -> None:
        problems = self.mismatches(other)
        if problems:
            raise CalibrationMismatchError(
                f"calibration for {self.model_name or self.architecture} does not fit "
                f"{other.model_name or other.architecture} (calibration vs model): " + "; ".join(problems)
            )


def _say(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _rotary_mismatches(a: tuple[RotaryConfig, ...], b: tuple[RotaryConfig, ...], skip_head_dim: bool) -> list[str]:
    """Per RoPE field that differs (``rope theta 1000000.0 vs 10000.0``), at which layers when not at all of them."""
    out = []
    for f in fields(RotaryConfig):
        if not f.compare or (skip_head_dim and f.name == "head_dim"):
            continue
        layers = [i for i, (x, y) in enumerate(zip(a, b)) if getattr(x, f.name) != getattr(y, f.name)]
        if layers:
            x, y = getattr(a[layers[0]], f.name), getattr(b[layers[0]], f.name)
            where = "" if len(layers) == len(a) else f" (layer {layers[0]}" + (
                f" and {len(layers) - 1} more)" if len(layers) > 1 else ")"
            )
            out.append(f"rope {f.name.replace('_', ' ')} {_say(x)} vs {_say(y)}{where}")
    return out


@dataclass
class BasisGroup:
    """One layer group ``[start, stop)``: means [p_g], bases [p_g, r] (columns = components) and plans for K and V.

    ``[start, stop)`` is a range over the calibration's layer order (``layer_order``; the identity unless the
    calibration groups layers by attention type). ``tokens`` is the group's token set: a span's last ``tokens`` tokens
    (what a sliding-window layer keeps), 0 for all of them."""

    layers: tuple[int, int]
    k_mean: torch.Tensor
    k_basis: torch.Tensor
    v_mean: torch.Tensor
    v_basis: torch.Tensor
    k_plans: dict[float, Plan] = field(default_factory=dict)
    v_plans: dict[float, Plan] = field(default_factory=dict)
    tokens: int = 0

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


def group_layer_ids(order: tuple[int, ...] | None, layers: tuple[int, int]) -> list[int]:
    """The model layers of a group's range ``layers`` over a calibration's ``order`` (None: the identity)."""
    a, b = layers
    return list(range(a, b)) if order is None else list(order[a:b])


class CalibrationLike(Protocol):
    """What the codec reads of a calibration (``layer_order``, optional: the permutation its groups range over)."""

    id: str
    fingerprint: ModelFingerprint
    groups: list[BasisGroup]

    @property
    def ratios(self) -> list[float]: ...
