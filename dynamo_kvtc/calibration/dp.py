"""Dynamic-programming bit allocation (paper §3.2, App. B.17).

Minimise the squared reconstruction error ||D - D_q||^2 of projected calibration rows under a per-token bit budget.
Coordinates are coded in groups of consecutive PCA components, each group of a size in ``GROUP_SIZES`` and aligned to
its size, with a type in {none, int2, int4, fp8}; coded groups carry a 16-bit shift and scale per token (counted in
the budget). The "none" type costs nothing and reconstructs zero: it drops components.

``E[i][b]`` = least error of coding components ``[0, i)`` with at most ``b`` budget units. ``E[0][b] = 0``;
``E[i][b] = min( E[i-1][b] + zero_err[i-1],  min over aligned (size, kind) ending at i of
E[i-size][b - cost] + err(block) )``. Every row is non-increasing in ``b`` by induction, so "at most b" needs no
separate propagation step. The table is vectorised over the budget axis; budgets are counted in units of the gcd
of all group costs, which is exact. One table answers every ratio at once (each ratio backtracks from its own budget).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..codec.plan import GROUP_SIZES
from ..codec.quant import group_cost_bits, group_sq_error
from ..errors import CalibrationError

DP_KINDS = ("int2", "int4", "fp8")


@dataclass
class Allocation:
    groups: tuple[tuple[int, int, str], ...]
    error: float
    bits: int


def block_errors(
    coeffs: torch.Tensor,
    sizes: Sequence[int] = GROUP_SIZES,
    kinds: Sequence[str] = DP_KINDS,
    chunk: int = 2048,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, dict[tuple[int, str], np.ndarray]]:
    """Error tables from projected rows ``coeffs [N, F]``: per-component zero error [F] and, for every (size, kind),
    the error of each aligned block ``[k*size, (k+1)*size)`` (float64 [F // size]). The quantization runs where
    ``coeffs`` lives (a GPU: the tables are summed there in float64 and copied to the host once)."""
    n, f = coeffs.shape
    dev = coeffs.device
    zero = torch.zeros(f, dtype=torch.float64, device=dev)
    errs = {(s, k): torch.zeros(f // s, dtype=torch.float64, device=dev) for s in sizes for k in kinds}
    steps = max(1, (n + chunk - 1) // chunk)
    for step, i in enumerate(range(0, n, chunk)):
        x = coeffs[i : i + chunk].float()
        zero += x.double().square().sum(0)
        for s in sizes:
            nb = f // s
            if nb == 0:
                continue
            xb = x[:, : nb * s].reshape(x.shape[0], nb, s)
            for k in kinds:
                errs[(s, k)] += group_sq_error(xb, k)
        if progress:
            progress(step + 1, steps)
    return zero.cpu().numpy(), {key: e.cpu().numpy() for key, e in errs.items()}


def allocate(
    zero_err: np.ndarray,
    block_err: dict[tuple[int, str], np.ndarray],
    budgets_bits: Sequence[int],
    cost_fn: Callable[[str, int], int] = group_cost_bits,
    cost_scale: np.ndarray | None = None,
) -> list[Allocation]:
    """Exact optimal aligned-group allocation for each budget (bits per token).

    ``cost_scale`` (positive integers, one per component; default all 1) multiplies the cost of every group that ends
    at that component: a table that concatenates several basis groups (:mod:`.group_budget`) weights each group's
    bits by the tokens it codes. Every aligned group must then lie inside one basis group."""
    f = len(zero_err)
    options = [(s, k) for (s, k) in block_err if len(block_err[(s, k)])]
    costs = [cost_fn(k, s) for s, k in options]
    if any(c <= 0 for c in costs):
        raise CalibrationError("every coded group must cost a positive number of bits")
    unit = 0
    for c in costs:
        unit = math.gcd(unit, c)
    if not budgets_bits:
        return []
    bmax = max(budgets_bits) // unit
    maxg = max([s for s, _ in options], default=1)
    ring = np.zeros((maxg + 1, bmax + 1))  # E rows for i-maxg .. i
    choice = np.zeros((f + 1, bmax + 1), dtype=np.int16)
    ucost = [c // unit for c in costs]
    cand = np.empty(bmax + 1)
    for i in range(1, f + 1):
        best = ring[(i - 1) % (maxg + 1)] + zero_err[i - 1]
        ch = choice[i]
        m = 1 if cost_scale is None else int(cost_scale[i - 1])
        for idx, ((s, k), c) in enumerate(zip(options, ucost), start=1):
            c *= m
            if i % s or i < s or c > bmax:
                continue
            prev = ring[(i - s) % (maxg + 1)]
            cand[:c] = np.inf
            np.add(prev[: bmax + 1 - c], block_err[(s, k)][i // s - 1], out=cand[c:])
            better = cand < best
            if better.any():
                best = np.where(better, cand, best)
                ch[better] = idx
        ring[i % (maxg + 1)] = best
    final = ring[f % (maxg + 1)]
    out = []
    for budget in budgets_bits:
        b = budget // unit
        i, groups, bits = f, [], 0
        while i > 0:
            idx = int(choice[i, b])
            if idx == 0:
                i -= 1
                continue
            s, k = options[idx - 1]
            m = 1 if cost_scale is None else int(cost_scale[i - 1])
            groups.append((i - s, s, k))
            bits += costs[idx - 1] * m
            b -= ucost[idx - 1] * m
            i -= s
        groups.reverse()
        out.append(Allocation(tuple(groups), float(final[budget // unit]), bits))
    return out


def plan_error(
    groups: Sequence[tuple[int, int, str]], zero_err: np.ndarray, block_err: dict[tuple[int, str], np.ndarray]
) -> float:
    """Total error of a plan under the same error tables (used to verify the DP)."""
    coded = np.zeros(len(zero_err), dtype=bool)
    total = 0.0
    for start, size, kind in groups:
        total += float(block_err[(size, kind)][start // size])
        coded[start : start + size] = True
    return total + float(zero_err[~coded].sum())

def compact_sample(res_u: list[torch.Tensor], res_rows: dict[str, list[torch.Tensor]], keep: int) -> None:
    """The DP sample: keep the ``keep`` rows with the smallest random keys (seeded, uniform, without replacement)."""
    u = torch.cat(res_u)
    order = torch.argsort(u)[:keep]
    order, _ = torch.sort(order)
    res_u[:] = [u[order]]
    for kind in res_rows:
        pieces, res_rows[kind] = res_rows[kind], []
        if len(pieces) == 1:
            res_rows[kind].append(pieces[0][order.to(pieces[0].device)])
            continue
        kept, start = [], 0  # piece by piece, each dropped once read: no copy of all pieces at once
        for i in range(len(pieces)):
            piece, pieces[i] = pieces[i], None
            stop = start + len(piece)
            idx = order[(order >= start) & (order < stop)] - start
            kept.append(piece[idx.to(piece.device)])
            start = stop
            del piece
        res_rows[kind].append(torch.cat(kept))
