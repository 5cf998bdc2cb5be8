"""What a calibration run is configured with, and how it groups a model's layers.

:class:`CalibrationConfig` (ratios, layer groups, rank cap, DP sample, sinks, RoPE removal, token sets, the shared
bit budget, tensor-parallel rank, device), :class:`KvSample` (one calibration sequence's post-RoPE K/V), the
tensor-parallel head split (:func:`shard_heads`, as vLLM splits KV heads) and the layer grouping (:func:`group_plan`:
consecutive groups, or, for sliding-window models, groups by attention type with each group's token set).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..codec.model import ModelFingerprint
from ..errors import ConfigError


@dataclass
class KvSample:
    """One calibration sequence: post-RoPE keys and values [L, T, H, D] at absolute positions [T]."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor


@dataclass
class CalibrationConfig:
    ratios: tuple[float, ...] = (8, 16, 32, 64)
    layer_groups: int = 1
    rank: int | None = None  # cap on retained components per layer group (None: pca.default_rank(p))
    niter: int = 8
    pca_method: str = "randomized"
    dp_tokens: int = 16384
    sinks: int = 4
    remove_rope: bool = True
    max_tokens: int | None = None
    seed: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    token_sets: bool = True  # group sliding-window layers by attention type, with per-group token sets
    kept_rows_only: bool = False  # fit a sliding group only on each sample's last `window` tokens
    shared_budget: bool = True  # one DP over all groups when their token sets differ (calibration/group_budget.py)
    budget_tokens: int = 0  # span length that weights the shared budget (0: the longest calibration sample)
    group_error_weights: tuple[float, ...] = ()  # error weight per basis group in the shared DP (default 1 each)
    share_kv: bool = False  # the shared DP also spends K's and V's bits from one budget
    budget_error: str = "relative"  # shared DP objective: "relative" (each layer's error over its energy) or "absolute"
    device: str = "cpu"
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ratios or any(float(r) <= 0 for r in self.ratios):
            raise ConfigError(f"ratios must be positive numbers, got {self.ratios}")
        if self.layer_groups < 1:
            raise ConfigError(f"layer_groups must be >= 1, got {self.layer_groups}")
        if self.rank is not None and self.rank < 1:
            raise ConfigError(f"rank must be >= 1, got {self.rank}")
        if self.dp_tokens < 16:
            raise ConfigError(f"dp_tokens must be >= 16, got {self.dp_tokens}")
        if self.budget_tokens < 0 or any(not w > 0 for w in self.group_error_weights):
            raise ConfigError("budget_tokens must be >= 0 and group_error_weights positive")
        if self.budget_error not in ("relative", "absolute"):
            raise ConfigError(f"budget_error must be 'relative' or 'absolute', got {self.budget_error!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} must lie in [0, tp_size={self.tp_size})")


def shard_heads(total_heads: int, tp_rank: int, tp_size: int) -> slice:
    """KV heads held by one tensor-parallel rank (contiguous split, as vLLM does; replicated when tp > heads)."""
    if tp_size == 1:
        return slice(0, total_heads)
    if total_heads % tp_size == 0:
        per = total_heads // tp_size
        return slice(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_heads == 0:
        h = tp_rank // (tp_size // total_heads)
        return slice(h, h + 1)
    raise ConfigError(f"cannot split {total_heads} KV heads over tp_size {tp_size}")


def layer_slices(num_layers: int, groups: int) -> list[tuple[int, int]]:
    if groups > num_layers:
        raise ConfigError(f"layer_groups={groups} exceeds the model's {num_layers} layers")
    bounds = np.linspace(0, num_layers, groups + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def group_plan(
    fp: ModelFingerprint, layer_groups: int, token_sets: bool = True
) -> tuple[tuple[int, ...] | None, list[tuple[int, int]], list[int]]:
    """``(layer_order, slices, tokens)`` of a calibration: the layer permutation (None: identity), the groups as
    ranges over it and each group's token set (0: all tokens). Without sliding-window layers (or ``token_sets``
    off): ``layer_groups`` consecutive groups. Otherwise one run of layers per attention type (types in the order of
    their first layer), each split into up to ``layer_groups`` consecutive groups."""
    L = fp.num_layers
    if not (token_sets and fp.windows):
        return None, layer_slices(L, layer_groups), [0] * layer_groups
    types: dict[int, list[int]] = {}
    for layer, w in enumerate(fp.windows):
        types.setdefault(w, []).append(layer)
    order: list[int] = []
    slices: list[tuple[int, int]] = []
    tokens: list[int] = []
    for w, members in types.items():
        off = len(order)
        order += members
        for a, b in layer_slices(len(members), min(layer_groups, len(members))):
            slices.append((off + a, off + b))
            tokens.append(w)
    return tuple(order), slices, tokens
