"""PCA of calibration rows (paper §3.1): streaming moments, then a randomized eigendecomposition (Halko et al.).

Rows are accumulated as a float64 Gram matrix of shifted rows (shift = mean of the first batch, which avoids
catastrophic cancellation), so any number of tokens can be streamed and a run can be checkpointed. The right singular
vectors of the centred data matrix C - mu are the eigenvectors of its Gram matrix G = (C - mu)^T (C - mu); randomized
subspace iteration on G with ``niter`` power iterations is Halko's randomized SVD of C - mu with the same number of
power iterations. ``method="exact"`` uses a full symmetric eigendecomposition instead (fine for p up to ~8K on CPU).

On a GPU (``device="cuda"``) everything stays there: each batch's Gram product is computed in float32 into one
reused workspace and added to the float64 accumulator (the same arithmetic as before, without two p x p temporaries
per batch); the randomized solver works on a float32 copy of the centred Gram built block by block (no float64 p x p
temporary). Memory per K or V: 8 p^2 bytes for the Gram, plus 4 p^2 for the shared workspace during capture and
4 p^2 for the float32 copy during the PCA (p = 32768, Llama-3.1-8B: 8.6 + 4.3 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CalibrationError

RANK_CAP = 10240  # the paper's dimensionality cut-off for Llama-3.1-8B, Llama-3.3-70B and Mistral-NeMo-12B (B.1)


def default_rank(p: int) -> int:
    """Components kept when no rank is given: all of them up to the paper's cut-off of 10240, which then applies
    (p = 32768 for Llama-3.1-8B: an exact eigendecomposition of that Gram is far slower than the randomized one,
    and the DP gives the components past ~10K no bits at 8x and above)."""
    return min(p, RANK_CAP)


class Moments:
    """Streaming count, mean and Gram matrix of rows of width ``p`` (float64 accumulators).

    ``workspace`` (a dict) lets several Moments on one device share their float32 p x p scratch buffer (one per
    width); :meth:`release` drops it."""

    def __init__(self, p: int, device: str | torch.device = "cpu", workspace: dict | None = None) -> None:
        self.p = p
        self.device = torch.device(device)
        self.n = 0
        self.shift: torch.Tensor | None = None
        self.sum = torch.zeros(p, dtype=torch.float64, device=self.device)
        self.gram = torch.zeros(p, p, dtype=torch.float64, device=self.device)
        self._ws = workspace if workspace is not None else {}

    def _buffer(self) -> torch.Tensor:
        key = (self.p, str(self.device))
        buf = self._ws.get(key)
        if buf is None:
            buf = self._ws[key] = torch.empty(self.p, self.p, dtype=torch.float32, device=self.device)
        return buf

    def release(self) -> None:
        """Free the float32 scratch buffer (before the PCA needs the memory); the next :meth:`add` makes a new one."""
        self._ws.pop((self.p, str(self.device)), None)

    def add(self, rows: torch.Tensor, chunk: int = 4096) -> None:
        if rows.shape[-1] != self.p:
            raise CalibrationError(f"row width {rows.shape[-1]} differs from {self.p}")
        rows = rows.to(self.device, torch.float32)
        if self.shift is None:
            self.shift = rows.mean(dim=0)
        buf = self._buffer()
        for i in range(0, rows.shape[0], chunk):
            x = rows[i : i + chunk] - self.shift
            self.sum += x.sum(dim=0, dtype=torch.float64)
            torch.mm(x.t(), x, out=buf)  # float32 product, then a float64 sum: as `gram += (x.t() @ x).double()`
            self.gram.add_(buf)
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
    method: str = "exact"  # the solver that ran: "exact" or "randomized"
    orthonormality_error: float | None = None  # max |B^T B - I| of the randomized basis (float32)


def centred_gram_f32(m: Moments, block: int = 4096) -> torch.Tensor:
    """The centred Gram (C - mu)^T (C - mu) in float32, computed in float64 one row block at a time (no float64
    p x p temporary)."""
    mu = m.sum / m.n
    out = torch.empty(m.p, m.p, dtype=torch.float32, device=m.gram.device)
    for i in range(0, m.p, block):
        out[i : i + block] = (m.gram[i : i + block] - m.n * torch.outer(mu[i : i + block], mu)).float()
    return out


def fit_pca(
    m: Moments,
    rank: int | None = None,
    *,
    niter: int = 8,
    oversample: int = 64,
    seed: int = 0,
    method: str = "randomized",
    low_memory: bool | None = None,
) -> PcaResult:
    """Principal components of the accumulated rows, ``rank`` capped at p (None: all p). ``low_memory`` (default:
    off the CPU) builds the randomized solver's float32 Gram by row blocks and draws its start by row blocks."""
    if m.n < 2:
        raise CalibrationError(f"PCA needs at least 2 rows, got {m.n}")
    p = m.p
    r = min(rank or p, p)
    if method == "exact" or r + oversample >= p:
        g = m.covariance_gram()
        total = float(torch.trace(g)) / m.n
        evals, evecs = torch.linalg.eigh(g)
        order = torch.argsort(evals, descending=True)[:r]
        return PcaResult(m.mean(), evecs[:, order].float(), evals[order].clamp_min(0) / m.n, total)
    if method != "randomized":
        raise CalibrationError(f"unknown PCA method {method!r}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    mu = m.sum / m.n
    total = float((torch.diagonal(m.gram) - m.n * mu * mu).sum()) / m.n  # the trace of the centred Gram
    if low_memory is None:
        low_memory = m.gram.device.type != "cpu"
    gf = centred_gram_f32(m) if low_memory else m.covariance_gram().float()
    k = r + oversample
    if not low_memory:
        q = torch.randn(p, k, generator=gen)
    else:  # drawn on the host in row blocks (the same numbers on any device), no p x k host tensor
        q = torch.empty(p, k, device=gf.device)
        for i in range(0, p, 4096):
            q[i : i + 4096] = torch.randn(min(4096, p - i), k, generator=gen).to(gf.device)
    q, _ = torch.linalg.qr(gf @ q)
    for _ in range(niter):
        q, _ = torch.linalg.qr(gf @ q)
    b = q.t() @ gf @ q
    del gf
    b = (b + b.t()) / 2
    evals, u = torch.linalg.eigh(b.double())
    order = torch.argsort(evals, descending=True)[:r]
    basis = (q.double() @ u[:, order]).float()  # orthonormal: q has orthonormal columns, u is orthogonal
    del q, u
    eye = basis.t() @ basis
    eye.diagonal().sub_(1)
    orth = float(eye.abs().max())
    return PcaResult(m.mean(), basis, evals[order].clamp_min(0) / m.n, total, "randomized", orth)


def subspace_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Sine of the largest principal angle between the column spaces of two bases of equal width (0: the same
    subspace, 1: some direction of one is orthogonal to the other). Both are orthonormalised first, so an fp16
    basis (a calibration's) does not read as ~0.02 apart from itself."""
    a, b = torch.linalg.qr(a.double())[0], torch.linalg.qr(b.double())[0]
    s = torch.linalg.svdvals(a.t() @ b)
    return float((1 - s.min().clamp(max=1) ** 2).clamp_min(0).sqrt())
