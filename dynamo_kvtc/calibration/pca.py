"""PCA of calibration rows (paper §3.1): streaming moments, then a randomized eigendecomposition (Halko et al.).

Rows are accumulated as a float64 Gram matrix of shifted rows (shift = mean of the first batch, which avoids
catastrophic cancellation), so any number of tokens can be streamed and a run can be checkpointed. The right singular
vectors of the centred data matrix C - mu are the eigenvectors of its Gram matrix G = (C - mu)^T (C - mu); randomized
subspace iteration on G with ``niter`` power iterations is Halko's randomized SVD of C - mu with the same number of
power iterations. ``method="exact"`` uses a full symmetric eigendecomposition instead (fine for p up to ~8K on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CalibrationError


class Moments:
    """Streaming count, mean and Gram matrix of rows of width ``p`` (float64 accumulators)."""

    def __init__(self, p: int, device: str | torch.device = "cpu") -> None:
        self.p = p
        self.device = torch.device(device)
        self.n = 0
        self.shift: torch.Tensor | None = None
        self.sum = torch.zeros(p, dtype=torch.float64, device=self.device)
        self.gram = torch.zeros(p, p, dtype=torch.float64, device=self.device)

    def add(self, rows: torch.Tensor, chunk: int = 4096) -> None:
        if rows.shape[-1] != self.p:
            raise CalibrationError(f"row width {rows.shape[-1]} differs from {self.p}")
        rows = rows.to(self.device, torch.float32)
        if self.shift is None:
            self.shift = rows.mean(dim=0)
        for i in range(0, rows.shape[0], chunk):
            x = rows[i : i + chunk] - self.shift
            self.sum += x.sum(dim=0, dtype=torch.float64)
            self.gram += (x.t() @ x).double()
        self.n += rows.shape[0]

    def mean(self) -> torch.Tensor:
        return (self.shift.double() + self.sum / self.n).float()

    def covariance_gram(self) -> torch.Tensor:
        """Centred Gram matrix (C - mu)^T (C - mu), float64."""
        m = self.sum / self.n
        return self.gram - self.n * torch.outer(m, m)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"n": torch.tensor(self.n), "shift": self.shift, "sum": self.sum, "gram": self.gram}

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self.n = int(d["n"])
        self.shift = d["shift"].to(self.device)
        self.sum = d["sum"].to(self.device, torch.float64)
        self.gram = d["gram"].to(self.device, torch.float64)


@dataclass
class PcaResult:
    mean: torch.Tensor  # [p] float32
    basis: torch.Tensor  # [p, r] float32, orthonormal columns, descending variance
    variances: torch.Tensor  # [r] float64 eigenvalues of the centred Gram / n
    total_variance: float  # trace of the covariance


def fit_pca(
    m: Moments,
    rank: int | None = None,
    *,
    niter: int = 8,
    oversample: int = 64,
    seed: int = 0,
    method: str = "randomized",
) -> PcaResult:
    """Principal components of the accumulated rows, ``rank`` capped at p."""
    if m.n < 2:
        raise CalibrationError(f"PCA needs at least 2 rows, got {m.n}")
    p = m.p
    r = min(rank or p, p)
    g = m.covariance_gram()
    total = float(torch.trace(g)) / m.n
    if method == "exact" or r + oversample >= p:
        evals, evecs = torch.linalg.eigh(g)
        order = torch.argsort(evals, descending=True)[:r]
        return PcaResult(m.mean(), evecs[:, order].float(), evals[order].clamp_min(0) / m.n, total)
    if method != "randomized":
        raise CalibrationError(f"unknown PCA method {method!r}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gf = g.float()
    q = torch.randn(p, r + oversample, generator=gen).to(gf.device)
    q, _ = torch.linalg.qr(gf @ q)
    for _ in range(niter):
        q, _ = torch.linalg.qr(gf @ q)
    b = q.t() @ gf @ q
    b = (b + b.t()) / 2
    evals, u = torch.linalg.eigh(b.double())
    order = torch.argsort(evals, descending=True)[:r]
    basis = (q.double() @ u[:, order]).float()  # orthonormal: q has orthonormal columns, u is orthogonal
    return PcaResult(m.mean(), basis, evals[order].clamp_min(0) / m.n, total)
