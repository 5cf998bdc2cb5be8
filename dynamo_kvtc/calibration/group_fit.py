"""One basis group's fit (K or V): its PCA, fp16 basis and DP error tables (:class:`GroupFit`), and what the artifact
keeps of it once the DP has run (:func:`plans_and_stats`: mean, trimmed basis, one plan per ratio, and its stats)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codec.plan import Plan
from .dp import Allocation

log = logging.getLogger(__name__)


@dataclass
class GroupFit:
    """What the DP and the artifact need of one group and kind: its PCA, fp16 basis and DP error tables."""

    pca: Any
    basis16: torch.Tensor
    zero: np.ndarray
    errs: dict[tuple[int, str], np.ndarray]
    energy: float  # squared norm of the mean-centred DP sample
    rows: int


def plans_and_stats(
    g: int, kind: str, p: int, fit: GroupFit, allocs: list[Allocation], ratios, stats: dict[str, Any], shared: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[float, Plan]]:
    """(mean, trimmed basis, plans by ratio) of one group and kind; its stats go into ``stats``."""
    plans = {}
    for r, al in zip(ratios, allocs):
        bud = al.bits if shared else int(16 * p / float(r))  # a shared budget's group gets what the DP gave it
        plans[float(r)] = Plan(p, float(r), bud, al.groups)
        stats[f"g{g}.{kind}.{float(r):g}x"] = {
            "rank": plans[float(r)].rank,
            "bits_per_token": al.bits,
            "budget_bits": bud,
            "relative_error_dp_sample": (al.error + max(0.0, fit.energy - float(fit.zero.sum()))) / fit.energy,
        }
    width = max(pl.rank for pl in plans.values())
    ev = fit.pca.variances
    stats[f"g{g}.{kind}.variance_captured_by_width"] = float(ev[:width].sum() / max(fit.pca.total_variance, 1e-30))
    log.info("group %d %s: width %d of %d", g, kind, width, p)
    return fit.pca.mean.cpu().float(), fit.basis16[:, :width].cpu(), plans


def orthonormality(fits: dict[tuple[int, str], GroupFit]) -> dict[str, float]:
    errs = [f.pca.orthonormality_error for f in fits.values() if f.pca.orthonormality_error is not None]
    return {"orthonormality_error": max(errs)} if errs else {}
