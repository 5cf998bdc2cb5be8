"""The fused codec's projections: coefficients <-> K/V rows through a layer group's PCA basis.

Restore: ``Y = D @ V[cols]^T`` per layer (D: the dequantized coefficients ``[rows, rank]``, V: the group's basis
``[p, rank]``); encode: ``C = X @ V[:, :rank]`` per layer group (X: centred, RoPE-free rows ``[rows, p]``). Both are
the GEMMs that bound the codec's speed. :class:`Projector` owns how they run (precision, operand caches); the
stages around them never call a GEMM themselves.
"""

from __future__ import annotations

import torch

from .ops import mm_f32


class Projector:
    """Runs the restore and encode projections of one fused codec. Owns nothing but the choice of GEMM; it never
    changes the basis the calibration stores (fp16) nor the blob format."""

    name = "fp16"

    def restore(self, coeffs: torch.Tensor, tab, kind: str, cols: slice) -> torch.Tensor:
        """``coeffs [rows, rank] @ basis[cols, :rank]^T`` -> ``[rows, len(cols)]`` (fp32 or bf16)."""
        basis = tab.k_basis if kind == "k" else tab.v_basis
        return mm_f32(coeffs, basis[cols, : coeffs.shape[1]].t())

    def encode(self, rows: torch.Tensor, tab, kind: str, rank: int) -> torch.Tensor:
        """``rows [n, p] @ basis[:, :rank]`` -> ``[n, rank]`` fp32 coefficients."""
        basis = tab.k_basis if kind == "k" else tab.v_basis
        return mm_f32(rows, basis[:, :rank].to(rows.dtype))
