"""One bit budget across basis groups (issue 16): a single DP over every group of a calibration.

With per-layer token sets a calibration has several basis groups that code different numbers of tokens (Gemma-3: 15
sliding layers holding 511 tokens, 3 full-attention layers holding all ``T``). A DP per group at the same ratio gives
every group the same bits per feature; one DP over all groups spends the ratio's bits where they lower the error most.

The shared problem, for one of K or V and one ratio ``r``: choose a plan per group minimising
``sum_g weight_g * tokens_g * err_g / rows_g`` (the squared error of the tokens each group codes, per DP-sample row,
times an error weight) subject to ``sum_g tokens_g * bits_g <= 16 * sum_g tokens_g * features_g / r``. ``tokens_g``
is what group ``g`` codes at a representative span length ``T`` (:func:`held_tokens`), reduced to small integers
(:func:`token_weights`); the overall ratio then equals ``r`` at length ``T`` (up to that rounding), is higher at
shorter spans and lower at longer ones when the groups get different bits per feature.

It is solved exactly by the ordinary DP (:func:`~.dp.allocate`) on the groups' tables laid end to end: each group is
padded to a multiple of the largest group size (padding costs nothing to drop and cannot be coded), its errors are
scaled as above and its group costs multiplied by its token weight (``cost_scale``). The result is split back into
one :class:`~.dp.Allocation` per group, whose ``error`` and ``bits`` are in the group's own (unscaled) units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..codec.plan import GROUP_SIZES
from ..codec.quant import group_cost_bits
from ..errors import CalibrationError
from .dp import Allocation, allocate, plan_error


@dataclass(frozen=True)
class GroupTable:
    """One basis group's DP error tables (K or V) and its terms in the shared budget. Holds tables only: it never
    fits a basis nor allocates on its own."""

    zero: np.ndarray  # per-component zero error, summed over the DP sample rows
    errs: dict[tuple[int, str], np.ndarray]  # aligned block errors per (size, kind), summed over the rows
    features: int  # coordinates of the group's rows (its raw size counts in the budget)
    rows: int  # DP sample rows the tables sum over
    tokens: int  # integer token weight: tokens the group codes at the representative length (relative)
    weight: float = 1.0  # error weight


def held_tokens(group_tokens: Sequence[int], length: int) -> list[int]:
    """Tokens each group codes in a span of ``length`` tokens (a token set of 0 means every token)."""
    if length < 1:
        raise CalibrationError(f"the representative span length must be >= 1, got {length}")
    return [min(length, t) if t else length for t in group_tokens]


def token_weights(group_tokens: Sequence[int], length: int) -> list[int]:
    """Integer token weights: each group's held tokens over the smallest group's, rounded (511 vs 2048 -> 1:4)."""
    held = held_tokens(group_tokens, length)
    least = min(held)
    return [max(1, round(h / least)) for h in held]


def share_budget(
    tables: Sequence[GroupTable], ratios: Sequence[float], sizes: Sequence[int] = GROUP_SIZES
) -> list[list[Allocation]]:
    """Allocations ``[ratio][group]`` of one DP over all ``tables`` (see the module docstring)."""
    if not tables:
        return [[] for _ in ratios]
    maxg = max(sizes)
    offsets, zeros, scales = [], [], []
    errs: dict[tuple[int, str], list[np.ndarray]] = {key: [] for key in tables[0].errs}
    off = 0
    for t in tables:
        if t.rows < 1 or t.tokens < 1 or not t.weight > 0:
            raise CalibrationError(f"a group table needs rows, tokens, weight > 0: {t.rows}, {t.tokens}, {t.weight}")
        f = len(t.zero)
        padded = -(-f // maxg) * maxg
        w = t.weight * t.tokens / t.rows
        zeros.append(np.concatenate([t.zero * w, np.zeros(padded - f)]))
        for (s, k), parts in errs.items():
            e = np.full(padded // s, np.inf)
            src = t.errs[(s, k)]
            e[: len(src)] = src * w
            parts.append(e)
        scales.append(np.full(padded, t.tokens, dtype=np.int64))
        offsets.append((off, off + padded))
        off += padded
    budgets = [int(16 * sum(t.tokens * t.features for t in tables) / float(r)) for r in ratios]
    joint = allocate(
        np.concatenate(zeros),
        {key: np.concatenate(parts) for key, parts in errs.items()},
        budgets,
        cost_scale=np.concatenate(scales),
    )
    out = []
    for al in joint:
        per = []
        for t, (a, b) in zip(tables, offsets):
            groups = tuple((st - a, s, k) for st, s, k in al.groups if a <= st < b)
            bits = sum(group_cost_bits(k, s) for _, s, k in groups)
            per.append(Allocation(groups, plan_error(groups, t.zero, t.errs), bits))
        out.append(per)
    return out


def overall_ratio(features: Sequence[int], bits: Sequence[int], held: Sequence[int]) -> float:
    """Ratio (16-bit raw over plan bits, shift/scale included) of groups coding ``held`` tokens each."""
    coded = sum(h * b for h, b in zip(held, bits))
    return math.inf if coded == 0 else 16 * sum(h * f for h, f in zip(held, features)) / coded
