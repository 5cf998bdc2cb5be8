"""The fused codec's stages, twice: :class:`TritonOps` (kernels, see ``triton_kernels.py``) and :class:`TorchOps`
(plain torch computing the same function, on any device). The fused codec uses Triton where it imports and compiles
and falls back to torch otherwise; tests hold the two against each other.

Shared conventions:

- K/V rows are addressed through a *layer view* (a tensor whose first element is the base address) plus one int64
  element offset per token and the head and dim strides, so paged engine blocks and dense tensors look the same.
- RoPE is applied as ``out[d] = x[d] * A[row, d] + x[partner[d]] * B[row, d]`` with tables built by
  :func:`rope_tables` (inverse for encode, forward for decode), which covers rotate-half and interleaved pairs, partial
  rotary and yarn's attention scaling exactly as :mod:`dynamo_kvtc.codec.rope` does.
- CRC-32 is zlib's; :func:`crc_matrices` holds the GF(2) operators that advance a CRC register over 2^j zero bytes.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Sequence
from functools import lru_cache

import torch

from ..plan import pack_codes, unpack_codes
from ..quant import BITS, dequantize, quantize
from ..rope import RotaryConfig

log = logging.getLogger(__name__)

KIND_ID = {"int2": 0, "int4": 1, "fp8": 2}
LEVELS = {"int2": 3.0, "int4": 15.0, "fp8": 0.0}
F16_MAX = 65504.0
CRC_PIECE = 512
CRC_LANES = 64
CRC_NBITS = 32  # sections < 4 GiB

# prep flag bits
FLAG_NONFINITE = 1
FLAG_F16_OVERFLOW = 2


# ---------------------------------------------------------------------------------------------------------- helpers
def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view from ``t``'s first element to the end of its storage (for offset-addressed gathers/scatters)."""
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((n,), (1,), t.storage_offset())


def device_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on ``device`` without blocking the host: built in pinned memory and copied
    asynchronously on the current stream (the caching host allocator keeps the pinned block until the copy is done)."""
    t = torch.tensor(list(values), dtype=dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@lru_cache(maxsize=64)
def _device_inv_freq(cfg: RotaryConfig, device: str) -> torch.Tensor:
    inv = cfg.inv_freq()
    return inv.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else inv


def _cos_sin(cfg: RotaryConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`RotaryConfig.cos_sin` on ``positions``' device with the inverse frequencies cached there (the plain
    method copies them host->device, blocking, on every call); same operations, same values."""
    dev = positions.device
    if dev.type != "cuda":
        return cfg.cos_sin(positions, device=dev)
    inv = _device_inv_freq(cfg, str(dev))
    ang = positions.to(dtype=torch.float32)[:, None] * inv[None, :]
    if cfg.style == "half":
        ang = torch.cat((ang, ang), dim=-1)
    else:
        ang = torch.repeat_interleave(ang, 2, dim=-1, output_size=2 * ang.shape[-1])
    s = cfg.attention_scaling()
    return ang.cos() * s, ang.sin() * s


def rope_tables(
    cfg: RotaryConfig, positions: torch.Tensor, head_dim: int, *, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(A [R, D] fp32, B [R, D] fp32, partner [D] int32) so that ``x*A + x[partner]*B`` (un)rotates like
    :func:`dynamo_kvtc.codec.rope.rotate`; None when the layer applies no RoPE. Queues no host synchronisation."""
    if cfg.scaling == "none":
        return None
    dev = positions.device
    cos, sin = _cos_sin(cfg, positions)
    R, D, rd = positions.numel(), head_dim, cfg.dims
    s2 = cfg.attention_scaling() ** 2 if inverse else 1.0
    sign = 1.0 if inverse else -1.0
    A = torch.ones(R, D, dtype=torch.float32, device=dev)
    B = torch.zeros(R, D, dtype=torch.float32, device=dev)
    partner = torch.arange(D, dtype=torch.int32, device=dev)
    o = cfg.rotary_offset  # the rotated dims are [o, o + rd) (an MLA head's RoPE part sits after its latent)
    A[:, o : o + rd] = cos / s2
    if cfg.style == "half":
        h = rd // 2
        partner[o : o + h] = torch.arange(o + h, o + rd, dtype=torch.int32, device=dev)
        partner[o + h : o + rd] = torch.arange(o, o + h, dtype=torch.int32, device=dev)
        B[:, o : o + h] = sign * sin[:, :h] / s2
        B[:, o + h : o + rd] = -sign * sin[:, h:rd] / s2
    else:
        partner[o : o + rd : 2] = torch.arange(o + 1, o + rd, 2, dtype=torch.int32, device=dev)
        partner[o + 1 : o + rd : 2] = torch.arange(o, o + rd, 2, dtype=torch.int32, device=dev)
        B[:, o : o + rd : 2] = sign * sin[:, 0:rd:2] / s2
        B[:, o + 1 : o + rd : 2] = -sign * sin[:, 1:rd:2] / s2
    return A.contiguous(), B.contiguous(), partner


# ---------------------------------------------------------------------------------------------------------- CRC-32
@lru_cache(maxsize=1)
def crc_table() -> tuple[int, ...]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0xEDB88320 if c & 1 else 0)
        out.append(c)
    return tuple(out)


def _apply(mat: Sequence[int], v: int) -> int:
    out, b = 0, 0
    while v:
        if v & 1:
            out ^= mat[b]
        v >>= 1
        b += 1
    return out


@lru_cache(maxsize=1)
def crc_matrices() -> tuple[tuple[int, ...], ...]:
    """``M[j]``: the linear map advancing a raw CRC-32 register over 2^j zero bytes, as 32 column images."""
    tab = crc_table()
    m0 = tuple(tab[(1 << b) & 0xFF] ^ ((1 << b) >> 8) for b in range(32))
    mats = [m0]
    for _ in range(1, 40):
        prev = mats[-1]
        mats.append(tuple(_apply(prev, prev[b]) for b in range(32)))
    return tuple(mats)


def crc_shift(state: int, nbytes: int) -> int:
    """Advance a raw CRC register over ``nbytes`` zero bytes."""
    mats = crc_matrices()
    j = 0
    while nbytes:
        if nbytes & 1:
            state = _apply(mats[j], state)
        nbytes >>= 1
        j += 1
    return state


def crc_finish(raw_xor: int, length: int) -> int:
    """zlib.crc32 of a message from the XOR of its pieces' raw CRCs (each advanced to the message end)."""
    return (crc_shift(0xFFFFFFFF, length) ^ raw_xor ^ 0xFFFFFFFF) & 0xFFFFFFFF


@lru_cache(maxsize=65536)
def _crc_init(length: int) -> int:
    return crc_shift(0xFFFFFFFF, length)


def crc_register(crc: int, length: int) -> int:
    """The raw register the CRC kernel accumulates for a message of ``length`` bytes whose zlib CRC-32 is ``crc``
    (the inverse of :func:`crc_finish`), as a signed int32: compared on the device, no read-back needed."""
    return _i32((crc ^ 0xFFFFFFFF ^ _crc_init(int(length))) & 0xFFFFFFFF)


def _i32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


@lru_cache(maxsize=8)
def _crc_device_tables(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    tab = device_tensor([_i32(v) for v in crc_table()], torch.int32, device)
    mats = device_tensor([_i32(v) for m in crc_matrices()[:CRC_NBITS] for v in m], torch.int32, device)
    return tab, mats


# ---------------------------------------------------------------------------------------------------------- torch
class TorchOps:
    """Reference-equivalent torch implementations (any device)."""

    name = "torch"
    rows_per_step = 8192  # bounds the temporary index tensors of offset gathers

    def _gather(self, src: torch.Tensor, roff: torch.Tensor, H: int, D: int, sh: int, sd: int) -> torch.Tensor:
        flat = flat_view(src)
        idx = (torch.arange(H, device=roff.device) * sh)[:, None] + (torch.arange(D, device=roff.device) * sd)[None, :]
        return flat[roff[:, None, None] + idx[None]]

    def prep(self, src, roff, out, col0, mean, rope, flag, H, D, sh, sd, bf16=False) -> None:
        for a in range(0, roff.numel(), self.rows_per_step):
            b = min(roff.numel(), a + self.rows_per_step)
            x = self._gather(src, roff[a:b], H, D, sh, sd).float()  # [n, H, D]
            bad = int(FLAG_NONFINITE) if not bool(torch.isfinite(x).all()) else 0
            if rope is not None:
                A, B, partner = rope
                x = x * A[a:b, None, :] + x[..., partner.long()] * B[a:b, None, :]
            y = x.reshape(b - a, H * D) - mean
            if not bf16 and bool((y.abs() > F16_MAX).logical_and(torch.isfinite(y)).any()):
                bad |= FLAG_F16_OVERFLOW
            if bad:
                flag |= bad
            out[a:b, col0 : col0 + H * D] = y.to(torch.bfloat16 if bf16 else torch.float16)

    def quantize(self, coeffs, T, kind, size, starts, shift, scale, codes, pack) -> None:
        n = starts.numel()
        idx = (starts.long()[:, None] + torch.arange(size, device=starts.device)[None, :]).reshape(-1)
        x = coeffs[:T, idx].float().view(T, n, size)
        c, s, sc = quantize(x, kind)
        shift.copy_(s.t().reshape(-1))
        scale.copy_(sc.t().reshape(-1))
        flatc = c.permute(1, 2, 0).reshape(-1)
        if pack:
            p = pack_codes(flatc, BITS[kind])
            codes[: p.numel()].copy_(p)
        else:
            codes[: flatc.numel()].copy_(flatc)

    def dequant(self, codes, shift, scale, kind, size, starts, out, T) -> None:
        n = starts.numel()
        c = unpack_codes(codes, BITS[kind], n * size * T).view(n, size, T).permute(2, 0, 1)
        vals = dequantize(c, shift.view(n, T).t(), scale.view(n, T).t(), kind)
        idx = (starts.long()[:, None] + torch.arange(size, device=starts.device)[None, :]).reshape(-1)
        out[:T, idx] = vals.reshape(T, -1).clamp(-F16_MAX, F16_MAX).to(out.dtype)

    def post(self, y, doff, dst, mean, rope, H, D, sh, sd) -> None:
        R = y.shape[0]
        x = y.float().view(R, H, D) + mean.view(1, H, D)
        if rope is not None:
            A, B, partner = rope
            x = x * A[:, None, :] + x[..., partner.long()] * B[:, None, :]
        keep = doff >= 0
        flat = flat_view(dst)
        idx = (torch.arange(H, device=y.device) * sh)[:, None] + (torch.arange(D, device=y.device) * sd)[None, :]
        flat[doff[keep][:, None, None] + idx[None]] = x[keep].to(dst.dtype)

    def scatter(self, vals, off, dst, H, D, sh, sd) -> None:
        """Write ``vals [n, H, D]`` (cast to ``dst``'s dtype) to the tokens at element offsets ``off`` of ``dst``;
        offsets < 0 are skipped. (Boolean-mask indexing: this twin synchronises on CUDA.)"""
        keep = off >= 0
        idx = (torch.arange(H, device=off.device) * sh)[:, None] + (torch.arange(D, device=off.device) * sd)[None, :]
        flat_view(dst)[off[keep][:, None, None] + idx[None]] = vals.reshape(-1, H, D)[keep].to(dst.dtype)

    def crc(self, data: torch.Tensor, offs: Sequence[int], lens: Sequence[int]) -> list[int]:
        host = data.cpu().numpy() if data.device.type != "cpu" else data.numpy()
        return [zlib.crc32(memoryview(host[o : o + n])) for o, n in zip(offs, lens)]

    def crc_check(self, data: torch.Tensor, offs: Sequence[int], lens: Sequence[int], want: Sequence[int]):
        """A bool tensor on ``data``'s device: section i's CRC-32 equals ``want[i]`` (this twin reads the data back
        to the host)."""
        got = self.crc(data, offs, lens)
        return device_tensor([g == w for g, w in zip(got, want)], torch.bool, data.device)

    def copy_chunks(self, src, dst, src_offs, dst_offs, lens) -> None:
        for so, do, n in zip(src_offs, dst_offs, lens):
            if n:
                dst[do : do + n].copy_(src[so : so + n])


# ---------------------------------------------------------------------------------------------------------- triton
def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class TritonOps(TorchOps):
    """The same stages as Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1)."""

    name = "triton"
    BR = 32  # rows per program (prep, post)
    BT = 64  # tokens per program (quantize, dequantize)

    def __init__(self) -> None:
        from . import triton_kernels as K  # lazy: Triton is optional

        self.K = K
        self._lock = threading.Lock()

    @staticmethod
    def _dummy(dev) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.float32, device=dev)

    def prep(self, src, roff, out, col0, mean, rope, flag, H, D, sh, sd, bf16=False) -> None:
        R = roff.numel()
        if R == 0:
            return
        dev = out.device
        if rope is None:
            A = B = self._dummy(dev)
            partner = torch.zeros(1, dtype=torch.int32, device=dev)
        else:
            A, B, partner = rope
        grid = (triton_cdiv(R, self.BR),)
        self.K.prep_kernel[grid](
            src, roff, out, mean, A, B, partner, flag, R, out.stride(0), col0, sh, sd,
            H=H, D=D, DB=_pow2(D), BR=self.BR, ROPE=rope is not None, OUT_BF16=bool(bf16),
        )  # fmt: skip

    def quantize(self, coeffs, T, kind, size, starts, shift, scale, codes, pack) -> None:
        if T == 0 or starts.numel() == 0:
            return
        grid = (triton_cdiv(T, self.BT), starts.numel())
        self.K.quant_kernel[grid](
            coeffs, coeffs.stride(0), T, starts, shift, scale, codes,
            SIZE=size, KIND=KIND_ID[kind], BITS=BITS[kind], LEVELS=LEVELS[kind], BT=self.BT, CJ=min(size, 64),
            PACK=bool(pack),
        )  # fmt: skip

    def dequant(self, codes, shift, scale, kind, size, starts, out, T) -> None:
        if T == 0 or starts.numel() == 0:
            return
        grid = (triton_cdiv(T, self.BT), starts.numel())
        self.K.dequant_kernel[grid](
            codes, shift, scale, starts, out, out.stride(0), T,
            SIZE=size, BITS=BITS[kind], BT=self.BT, CJ=min(size, 64),
        )  # fmt: skip

    def post(self, y, doff, dst, mean, rope, H, D, sh, sd) -> None:
        R = y.shape[0]
        if R == 0:
            return
        dev = y.device
        if rope is None:
            A = B = self._dummy(dev)
            partner = torch.zeros(1, dtype=torch.int32, device=dev)
        else:
            A, B, partner = rope
        grid = (triton_cdiv(R, self.BR),)
        self.K.post_kernel[grid](
            y, y.stride(0), doff, dst, mean, A, B, partner, R, sh, sd,
            H=H, D=D, DB=_pow2(D), BR=self.BR, ROPE=rope is not None,
        )  # fmt: skip

    def crc(self, data: torch.Tensor, offs: Sequence[int], lens: Sequence[int]) -> list[int]:
        """CRC-32 of each range on the device; one synchronisation (reading the results back)."""
        crcs = self.crc_async(data, offs, lens)
        return self.crc_collect(crcs, lens)

    def crc_async(self, data: torch.Tensor, offs: Sequence[int], lens: Sequence[int]) -> torch.Tensor:
        dev = data.device
        n = len(offs)
        span = CRC_PIECE * CRC_LANES
        sec, blk = [], []
        for s, ln in enumerate(lens):
            nb = -(-int(ln) // span)
            sec.extend([s] * nb)
            blk.extend(range(nb))
        acc = torch.zeros(max(n, 1), dtype=torch.int32, device=dev)
        if not sec:
            return acc
        tab, mats = _crc_device_tables(str(dev))
        item_sec = device_tensor(sec, torch.int32, dev)
        item_blk = device_tensor(blk, torch.int32, dev)
        sec_off = device_tensor(offs, torch.int64, dev)
        sec_len = device_tensor(lens, torch.int64, dev)
        self.K.crc_kernel[(len(sec),)](
            data, item_sec, item_blk, sec_off, sec_len, tab, mats, acc,
            PIECE=CRC_PIECE, LANES=CRC_LANES, NBITS=CRC_NBITS,
        )  # fmt: skip
        return acc

    def crc_check(self, data: torch.Tensor, offs: Sequence[int], lens: Sequence[int], want: Sequence[int]):
        """A bool tensor on the device: section i's CRC-32 equals ``want[i]``; computed and compared there (no
        synchronisation)."""
        n = len(offs)
        if n == 0:
            return torch.ones(0, dtype=torch.bool, device=data.device)
        acc = self.crc_async(data, offs, lens)
        exp = device_tensor([crc_register(w, ln) for w, ln in zip(want, lens)], torch.int32, data.device)
        return acc[:n] == exp

    def scatter(self, vals, off, dst, H, D, sh, sd) -> None:
        R = off.numel()
        if R == 0:
            return
        src = vals.reshape(R, H * D)
        grid = (triton_cdiv(R, self.BR),)
        self.K.scatter_kernel[grid](src, src.stride(0), off, dst, R, sh, sd, H=H, D=D, DB=_pow2(D), BR=self.BR)

    @staticmethod
    def crc_collect(acc: torch.Tensor, lens: Sequence[int]) -> list[int]:
        raw = acc.cpu().tolist()
        return [crc_finish(r & 0xFFFFFFFF, int(n)) for r, n in zip(raw, lens)]

    COPY_PIECE = 1 << 20  # one program copies at most this many bytes of a chunk given on the host

    def copy_chunks(self, src, dst, src_offs, dst_offs, lens) -> None:
        """One program per chunk (chunks given as device tensors: nvCOMP's outputs), or per ``COPY_PIECE`` bytes of
        a chunk given as host integers: a raw section of hundreds of MB must not be copied by a single program."""
        if not isinstance(lens, torch.Tensor) and any(int(n) > self.COPY_PIECE for n in lens):
            P, so2, do2, n2 = self.COPY_PIECE, [], [], []
            for so, do, n in zip(src_offs, dst_offs, lens):
                for a in range(0, int(n), P):
                    so2.append(int(so) + a)
                    do2.append(int(do) + a)
                    n2.append(min(P, int(n) - a))
            src_offs, dst_offs, lens = so2, do2, n2
        n = len(lens)
        if n == 0:
            return
        dev = dst.device

        def t(v):
            if isinstance(v, torch.Tensor):
                return v.to(dev, torch.int64)
            return device_tensor(v, torch.int64, dev)

        self.K.copy_chunks_kernel[(n,)](src, dst, t(src_offs), t(dst_offs), t(lens), BLOCK=4096)


def triton_cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


_OPS: dict[str, TorchOps] = {}
_OPS_ERR: dict[str, str] = {}


def triton_status() -> tuple[bool, str]:
    """(usable, reason): Triton importable (compilation problems show up at the first launch)."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return False, f"triton not importable: {type(e).__name__}: {e}"
    return True, "triton " + getattr(triton, "__version__", "?")


def get_ops(kind: str = "auto") -> TorchOps:
    """``"triton"``, ``"torch"`` or ``"auto"`` (Triton when it imports)."""
    if kind == "auto":
        ok, _ = triton_status()
        kind = "triton" if ok else "torch"
    if kind not in _OPS:
        _OPS[kind] = TritonOps() if kind == "triton" else TorchOps()
    return _OPS[kind]


# ------------------------------------------------------------------------------------------------ shared helpers
ALIGN = 16  # every raw section, and every compressed chunk handed to nvCOMP, starts on 16 bytes


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


_MM_OUT_DTYPE = [True]


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with 16-bit operands, fp32 accumulation and fp32 output."""
    if a.is_cuda:
        if _MM_OUT_DTYPE[0]:
            try:
                return torch.mm(a, b, out_dtype=torch.float32)
            except (TypeError, RuntimeError, NotImplementedError) as e:
                _MM_OUT_DTYPE[0] = False
                log.warning("torch.mm(out_dtype=float32) unavailable (%s); using bf16 GEMM outputs", e)
        return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16)).float()
    return a.float() @ b.float()
