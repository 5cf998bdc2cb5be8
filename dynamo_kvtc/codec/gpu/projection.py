"""The fused codec's projections: coefficients <-> K/V rows through a layer group's PCA basis.

Restore: ``Y = D @ V[cols]^T`` per layer (D: the dequantized coefficients ``[rows, rank]``, V: the group's basis
``[p, rank]``); encode: ``C = X @ V[:, :rank]`` per layer group (X: centred, RoPE-free rows ``[rows, p]``). Both are
the GEMMs that bound the codec's speed. A projector owns how they run (precision, operand caches); the stages around
them never call a GEMM themselves.

Two projectors, chosen by the codec option ``projection`` (:func:`make_projector`):

- :class:`Projector` (``fp16``): fp16 x fp16 tensor-core GEMMs with fp32 accumulation and fp32 output; the basis is
  exactly the calibration's fp16 basis.
- :class:`Fp8Projector` (``fp8``): e4m3 operands, fp32 accumulation (``torch._scaled_mm`` with row-wise scales).
  The A operand (coefficients on restore, rows on encode) gets one fp32 scale per row, computed on the fly; the B
  operand (the basis) one fp32 scale per output column, quantized once per layer group, kind and rank and cached on
  the projector. ``out = (A_q @ B_q) * scale_a * scale_b`` with ``scale = amax / 448`` (e4m3's largest value). On a
  restore the coefficients are quantized once per coefficient matrix and reused by every layer of the group. On the
  CPU (the fused path's test mode) the same quantized operands are multiplied in fp32 (``fp8-emulated``).

The blob format does not depend on the projector: a blob written with one decodes with the other, only the
reconstruction error differs. :func:`~dynamo_kvtc.codec.fp8.fake_e4m3` is the FP8 numerics the reference path
(``projection="fp8"`` on the CPU) uses to emulate this one, so its accuracy can be measured without a GPU.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from ..fp8 import E4M3, e4m3_scales
from .ops import mm_f32

log = logging.getLogger(__name__)

QUANT_ROWS = 8192  # rows quantized per pass (bounds the fp32 temporary of a large coefficient matrix)
_LOGGED: set[str] = set()
_LOG_LOCK = threading.Lock()


def _log_once(msg: str) -> None:
    with _LOG_LOCK:
        if msg in _LOGGED:
            return
        _LOGGED.add(msg)
    log.warning("kvtc projection: %s", msg)


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


# ------------------------------------------------------------------------------------------------ FP8 numerics
_DIV_INTO_E4M3 = [True]  # torch.div(..., out=<e4m3 view>): divide and round in one pass (else via an fp32 temporary)


def _div_into(q: torch.Tensor, x: torch.Tensor, sc: torch.Tensor) -> None:
    """``q[:] = e4m3(x / sc)`` (fp32 division, round to nearest even; ``|x / sc| <= 448`` by construction)."""
    if _DIV_INTO_E4M3[0]:
        try:
            torch.div(x, sc, out=q)
            return
        except (RuntimeError, TypeError, NotImplementedError) as e:
            _DIV_INTO_E4M3[0] = False
            _log_once(f"torch.div into float8_e4m3fn unavailable ({type(e).__name__}: {e}); quantizing in two passes")
    q.copy_(x.float() / sc)


def quantize_rows(x: torch.Tensor, k_pad: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, k_pad] e4m3 row-major, scale [M, 1] fp32)`` with one scale per row; columns K..k_pad
    are zero. Two passes over ``x`` (row maxima, then divide-and-round), :data:`QUANT_ROWS` rows at a time."""
    M, K = x.shape
    kp = K if k_pad is None else k_pad
    q = torch.empty(M, kp, dtype=E4M3, device=x.device)
    if kp > K:
        q.view(torch.uint8)[:, K:].zero_()
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    for i in range(0, M, QUANT_ROWS):
        xs = x[i : i + QUANT_ROWS]
        sc = e4m3_scales(xs, 1)
        _div_into(q[i : i + QUANT_ROWS, :K], xs, sc)
        s[i : i + QUANT_ROWS] = sc
    return q, s


# ------------------------------------------------------------------------------------------------ device support
@dataclass(frozen=True)
class Fp8Support:
    """Whether ``torch._scaled_mm`` with row-wise scales runs on a device, with which output dtype, and why not."""

    ok: bool
    out_dtype: torch.dtype | None
    why: str


_SUPPORT: dict[str, Fp8Support] = {}


def fp8_support(device: str | torch.device) -> Fp8Support:
    """Probe (once per device) FP8 tensor cores (compute capability >= 8.9) and a small row-wise ``_scaled_mm``,
    first with fp32 output, then bf16; the probe's result must match the fp32 product of the same operands."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    if key in _SUPPORT:
        return _SUPPORT[key]
    if dev.type != "cuda" or not torch.cuda.is_available():
        res = Fp8Support(False, None, "no CUDA device")
    elif torch.cuda.get_device_capability(dev) < (8, 9):
        cc = torch.cuda.get_device_capability(dev)
        res = Fp8Support(False, None, f"compute capability {cc[0]}.{cc[1]} < 8.9 (no FP8 tensor cores)")
    else:
        res = _probe(dev)
    _SUPPORT[key] = res
    return res


def _probe(dev: torch.device) -> Fp8Support:
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(64, 64, generator=g).to(dev)
    b = torch.randn(48, 64, generator=g).to(dev)  # row-major [N, K]: b.t() is the column-major B operand
    qa, sa = quantize_rows(a)
    qb, sb = quantize_rows(b)
    ref = (qa.float() * sa) @ (qb.float() * sb).t()
    errors = []
    for out_dtype in (torch.float32, torch.bfloat16):
        try:
            y = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.view(1, -1), out_dtype=out_dtype)
            err = float((y.float() - ref).norm() / ref.norm())
        except (RuntimeError, TypeError, NotImplementedError, ValueError) as e:
            errors.append(f"{str(out_dtype).split('.')[-1]}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        if err < 1e-2:
            return Fp8Support(True, out_dtype, f"torch._scaled_mm row-wise, {str(out_dtype).split('.')[-1]} output")
        errors.append(f"{str(out_dtype).split('.')[-1]}: wrong result (rel. error {err:.3g})")
    return Fp8Support(False, None, "torch._scaled_mm row-wise refused: " + "; ".join(errors))


def resolve_projection(choice: str, device: str | torch.device) -> tuple[str, str]:
    """``(name, why)``: the projector ``choice`` (auto|fp16|fp8) gives on ``device``: ``fp16``, ``fp8`` (tensor
    cores) or ``fp8-emulated`` (CPU: fp32 math on e4m3-rounded operands)."""
    dev = torch.device(device)
    if choice == "fp16":
        return "fp16", "configured"
    if dev.type != "cuda":
        if choice == "fp8":
            return "fp8-emulated", "no CUDA device: e4m3 operands multiplied in fp32"
        return "fp16", "auto: no CUDA device"
    sup = fp8_support(dev)
    if sup.ok:
        return "fp8", f"{choice}: {sup.why}"
    return "fp16", f"{choice}: {sup.why}"


def make_projector(choice: str, device: str | torch.device) -> Projector:
    """The projector of a fused codec configured with ``projection=choice`` on ``device`` (an explicit ``fp8`` that
    the device cannot run is logged once and runs in fp16)."""
    name, why = resolve_projection(choice, device)
    if choice == "fp8" and name == "fp16":
        _log_once(f"fp8 projections requested but unavailable on {device} ({why}); using fp16")
    if name == "fp16":
        return Projector()
    sup = fp8_support(device) if name == "fp8" else None
    return Fp8Projector(out_dtype=sup.out_dtype if sup else None)


# ------------------------------------------------------------------------------------------------ projectors
class Projector:
    """Runs the restore and encode projections of one fused codec in fp16 (fp32 accumulation and output). Owns
    nothing but the choice of GEMM; it never changes the basis the calibration stores (fp16) nor the blob format."""

    name = "fp16"

    def restore(self, coeffs: torch.Tensor, tab, kind: str, cols: slice) -> torch.Tensor:
        """``coeffs [rows, rank] @ basis[cols, :rank]^T`` -> ``[rows, len(cols)]`` (fp32 or bf16)."""
        basis = tab.k_basis if kind == "k" else tab.v_basis
        return mm_f32(coeffs, basis[cols, : coeffs.shape[1]].t())

    def encode(self, rows: torch.Tensor, tab, kind: str, rank: int) -> torch.Tensor:
        """``rows [n, p] @ basis[:, :rank]`` -> ``[n, rank]`` fp32 coefficients."""
        basis = tab.k_basis if kind == "k" else tab.v_basis
        return mm_f32(rows, basis[:, :rank].to(rows.dtype))


class Fp8Projector(Projector):
    """FP8 (e4m3) projections with row-wise scales and fp32 accumulation (``out_dtype`` None: emulated in fp32 on
    e4m3-rounded operands, the CPU test mode).

    Owns two operand caches: the quantized basis per (table, kind, direction, rank), held while the table lives, and
    the quantized coefficients of a restore per coefficient tensor, held while that tensor lives and dropped if it is
    modified in place. It never changes the calibration's basis, the coefficients it is given, nor the blob format;
    shapes ``torch._scaled_mm`` refuses (an output width that is not a multiple of 16) run in fp16, logged once."""

    def __init__(self, out_dtype: torch.dtype | None = None) -> None:
        self.out_dtype = out_dtype
        self.name = "fp8" if out_dtype is not None else "fp8-emulated"
        self._basis: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._coeffs: dict[int, tuple] = {}
        self._lock = threading.Lock()

    # -------------------------------------------------------------------------------------------- operands
    def basis_operand(self, tab, kind: str, rank: int, encode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantized basis of ``tab``/``kind`` at ``rank``, cached. Restore: ``(q [p, rank16], scale [p])``, one
        scale per basis row (= per output column of ``D @ V^T``); encode: ``(q [rank16, p], scale [1, rank16])``, one
        scale per component (padded components are zero with scale 1)."""
        key = (kind, encode, rank)
        with self._lock:
            per_tab = self._basis.setdefault(tab, {})
            hit = per_tab.get(key)
        if hit is not None:
            return hit
        basis = (tab.k_basis if kind == "k" else tab.v_basis)[:, :rank]
        if encode:
            q, s = quantize_rows(basis.t())  # per component, over the p rows of V
            r16 = _pad16(rank)
            if r16 > rank:
                qp = torch.zeros(r16, q.shape[1], dtype=torch.uint8, device=q.device).view(E4M3)
                qp[:rank] = q
                sp = torch.ones(r16, 1, dtype=torch.float32, device=q.device)
                sp[:rank] = s
                q, s = qp, sp
            hit = (q.contiguous(), s.view(1, -1).contiguous())
        else:
            q, s = quantize_rows(basis, _pad16(rank))
            hit = (q, s.view(-1))
        with self._lock:
            self._basis[tab][key] = hit
        return hit

    def coeff_operand(self, coeffs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The row-wise quantized ``coeffs`` (``[rows, rank16]`` e4m3, ``[rows, 1]`` fp32), computed once per
        coefficient tensor and reused by every layer of its group."""
        key = id(coeffs)
        with self._lock:
            hit = self._coeffs.get(key)
        if hit is not None and hit[0]() is coeffs and hit[1] == coeffs._version:
            return hit[2], hit[3]
        q, s = quantize_rows(coeffs, _pad16(coeffs.shape[1]))
        ref = weakref.ref(coeffs, lambda _r, k=key: self._drop(k, _r))
        with self._lock:
            self._coeffs[key] = (ref, coeffs._version, q, s)
        return q, s

    def _drop(self, key: int, ref) -> None:
        with self._lock:
            hit = self._coeffs.get(key)
            if hit is not None and hit[0] is ref:
                del self._coeffs[key]

    def cached_coefficients(self) -> int:
        """How many quantized coefficient matrices the projector holds now (tests: the cache lives with a restore)."""
        with self._lock:
            return len(self._coeffs)

    # -------------------------------------------------------------------------------------------- GEMMs
    def _mm(self, qa, qb_t, sa, sb) -> torch.Tensor:
        """``(qa @ qb_t) * sa * sb``: ``qa [M, K]`` row-major, ``qb_t [K, N]`` column-major, fp32 accumulation."""
        if self.out_dtype is None:
            return (qa.float() @ qb_t.float()) * sa * sb
        if qa.shape[0] == 0:
            return torch.zeros(0, qb_t.shape[1], dtype=self.out_dtype, device=qa.device)
        return torch._scaled_mm(qa, qb_t, scale_a=sa, scale_b=sb, out_dtype=self.out_dtype)

    def restore(self, coeffs: torch.Tensor, tab, kind: str, cols: slice) -> torch.Tensor:
        n = cols.stop - cols.start
        if n % 16 and self.out_dtype is not None:
            _log_once(f"restore output width {n} is not a multiple of 16 (torch._scaled_mm); these GEMMs run in fp16")
            return super().restore(coeffs, tab, kind, cols)
        qa, sa = self.coeff_operand(coeffs)
        qb, sb = self.basis_operand(tab, kind, coeffs.shape[1], encode=False)
        return self._mm(qa, qb[cols].t(), sa, sb[cols].view(1, -1))

    def encode(self, rows: torch.Tensor, tab, kind: str, rank: int) -> torch.Tensor:
        p = rows.shape[1]
        if p % 16 and self.out_dtype is not None:
            _log_once(f"encode row width {p} is not a multiple of 16 (torch._scaled_mm); these GEMMs run in fp16")
            return super().encode(rows, tab, kind, rank)
        qa, sa = quantize_rows(rows)
        qb, sb = self.basis_operand(tab, kind, rank, encode=True)
        out = self._mm(qa, qb.t(), sa, sb)
        if out.shape[1] != rank or out.dtype != torch.float32:
            out = out[:, :rank].float().contiguous()
        return out


def layers_per_gemm(n_layers: int, rows: int, out_dtype: torch.dtype | None, cap_bytes: int) -> int:
    """How many layers of a group one restore projection GEMM covers: as many as keep its K and V outputs (``rows``
    output elements per layer and kind, summed over the plans) within ``cap_bytes``, at least one, at most the group.
    Wider GEMMs run nearer the tensor cores' peak and cut the launches per group from 2 x layers to 2 x chunks; the
    cap bounds the restore's scratch memory. ``out_dtype`` None: fp16/emulated projections, fp32 outputs."""
    esize = torch.empty(0, dtype=out_dtype).element_size() if out_dtype is not None else 4
    return max(1, min(n_layers, cap_bytes // max(2 * rows * esize, 1)))
