"""The DP bit allocation is exact (brute force on tiny instances) and respects its budget."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_kvtc.calibration.dp import allocate, block_errors, plan_error

SIZES = (1, 2, 4)
KINDS = ("a", "b")
COST = {"a": 2, "b": 5}


def cost_fn(kind: str, size: int) -> int:
    return COST[kind] * size + 3


def tilings(f: int, start: int = 0):
    """Every aligned tiling of [start, f) into groups of SIZES, each group coded (a kind) or dropped (None)."""
    if start == f:
        yield []
        return
    for s in SIZES:
        if start % s or start + s > f:
            continue
        for kind in (None, *KINDS):
            for rest in tilings(f, start + s):
                yield [(start, s, kind)] + rest


def brute_force(zero, errs, budget):
    best = np.inf
    for t in tilings(len(zero)):
        coded = [(a, s, k) for a, s, k in t if k is not None]
        if sum(cost_fn(k, s) for _, s, k in coded) <= budget:
            best = min(best, plan_error(coded, zero, errs))
    return best


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 2**31), st.integers(0, 40))
def test_dp_matches_brute_force(f, seed, budget):
    rng = np.random.default_rng(seed)
    zero = rng.uniform(0.5, 3.0, f)
    errs = {}
    for s in SIZES:
        nb = f // s
        base = np.array([zero[i * s : (i + 1) * s].sum() for i in range(nb)])
        for k in KINDS:
            errs[(s, k)] = base * rng.uniform(0.0, 0.9, nb)
    (alloc,) = allocate(zero, errs, [budget], cost_fn=cost_fn)
    assert sum(cost_fn(k, s) for _, s, k in alloc.groups) == alloc.bits <= budget
    assert alloc.error == pytest.approx(plan_error(alloc.groups, zero, errs))
    assert alloc.error == pytest.approx(brute_force(zero, errs, budget))


def test_real_quantizer_plans_are_monotone_in_budget():
    torch.manual_seed(0)
    spectrum = torch.logspace(1, -2, 256)
    coeffs = torch.randn(1024, 256) * spectrum
    zero, errs = block_errors(coeffs, chunk=300)
    budgets = [16 * 256 // r for r in (2, 4, 8, 16, 32)]
    allocs = allocate(zero, errs, budgets)
    errors = [a.error for a in allocs]
    assert errors == sorted(errors)  # less budget, more error
    for a, b in zip(allocs, budgets):
        assert a.bits <= b
        assert all(start % size == 0 for start, size, _ in a.groups)
    # high-variance components get at least as many bits per coordinate as the tail
    first = allocs[1].groups[0]
    assert first[0] == 0
    # error table is exactly what the quantizer does, chunking does not matter
    zero2, errs2 = block_errors(coeffs, chunk=1024)
    assert np.allclose(zero, zero2) and all(np.allclose(errs[k], errs2[k]) for k in errs)


def test_no_budget_drops_everything():
    zero = np.ones(8)
    errs = {(1, "int2"): np.full(8, 0.1)}
    (a,) = allocate(zero, errs, [0])
    assert a.groups == () and a.error == pytest.approx(8.0)


def test_tilings_enumerator_sane():
    # 2 coordinates: [1][1] (3*3 choices) + [2] (3 choices)
    assert len(list(tilings(2))) == 12
    assert all(sum(s for _, s, _ in t) == 3 for t in itertools.islice(tilings(3), 50))
