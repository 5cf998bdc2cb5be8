"""Synthetic calibrations for shapes whose weights are not available offline (throughput benchmarks only).

A random orthonormal basis of width ``rank`` and a power-law spectrum ``lambda_i = i^-alpha`` stand in for a real
model's PCA; the DP plans are computed by the real DP on coefficients drawn from that spectrum, so the retained rank
and the bit mix follow what the DP does on such a spectrum. Nothing here says anything about accuracy.
"""

from __future__ import annotations

import torch

from ..codec.model import BasisGroup, ModelFingerprint
from ..codec.plan import Plan
from ..codec.rope import RotaryConfig, apply_rope
from .artifact import Calibration
from .dp import allocate, block_errors


def spectrum(rank: int, alpha: float = 1.1) -> torch.Tensor:
    return torch.arange(1, rank + 1, dtype=torch.float32) ** (-alpha)


def synthetic_calibration(
    layers: int,
    kv_heads: int,
    head_dim: int,
    theta: float = 1e4,
    *,
    ratios=(8, 16, 32, 64),
    rank: int | None = None,
    dp_rows: int = 2048,
    device: str = "cpu",
    seed: int = 0,
    name: str = "synthetic",
    rotary: RotaryConfig | None = None,
) -> Calibration:
    p = layers * kv_heads * head_dim
    rank = min(rank or min(p, 10240), p)
    g = torch.Generator(device="cpu").manual_seed(seed)
    fp = ModelFingerprint(
        "SyntheticForCausalLM",
        layers,
        kv_heads,
        head_dim,
        "bfloat16",
        (rotary or RotaryConfig(head_dim, theta=theta),) * layers,
        model_name=name,
        total_kv_heads=kv_heads,
    )
    lam = spectrum(rank)
    parts = {}
    for kind in "kv":
        basis = torch.linalg.qr(torch.randn(p, rank, generator=g).to(device))[0].to(torch.float16).cpu()
        mean = (torch.randn(p, generator=g) * 0.1).float()
        coeffs = torch.randn(dp_rows, rank, generator=g) * lam.sqrt()
        zero, errs = block_errors(coeffs)
        budgets = [int(16 * p / float(r)) for r in ratios]
        plans = {
            float(r): Plan(p, float(r), b, a.groups) for r, b, a in zip(ratios, budgets, allocate(zero, errs, budgets))
        }
        width = max(pl.rank for pl in plans.values())
        parts[kind] = (mean, basis[:, :width].contiguous(), plans)
    grp = BasisGroup(
        (0, layers), parts["k"][0], parts["k"][1], parts["v"][0], parts["v"][1], parts["k"][2], parts["v"][2]
    )
    return Calibration(fp, [grp], provenance={"synthetic": True, "spectrum": "i^-1.1", "seed": seed})


def synthetic_kv(cal: Calibration, tokens: int, start: int = 0, device: str = "cpu", seed: int = 1):
    """KV drawn from the calibration's own model (basis x spectrum), keys rotated at their positions, bf16."""
    fp = cal.fingerprint
    g = torch.Generator(device="cpu").manual_seed(seed)
    grp = cal.groups[0]
    out = []
    for mean, basis in ((grp.k_mean, grp.k_basis), (grp.v_mean, grp.v_basis)):
        r = basis.shape[1]
        z = (torch.randn(tokens, r, generator=g) * spectrum(r).sqrt()).to(device)
        x = z @ basis.to(device).float().t() + mean.to(device)
        out.append(x.view(tokens, fp.num_layers, fp.num_kv_heads, fp.head_dim).permute(1, 0, 2, 3))
    pos = torch.arange(start, start + tokens)
    k = torch.stack([apply_rope(out[0][i], pos.to(device), fp.rotary[i]) for i in range(fp.num_layers)])
    return k.to(torch.bfloat16).contiguous(), out[1].to(torch.bfloat16).contiguous(), pos
