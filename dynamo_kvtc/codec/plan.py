"""A DP bit-allocation plan (paper §3.2) and the byte layout of the coefficients it codes.

A plan is a list of coded groups ``(start, size, kind)`` over PCA coordinates ``0..features-1``; coordinates not in
any group get 0 bits (the "none" type) and reconstruct as zero. Groups are *aligned to their own size*
(``start % size == 0``), the Microscaling convention; this keeps the DP's error table at
O(types x sizes x features x rows) and is documented in docs/deviations.md.

Byte layout of one plan's section for ``T`` tokens (little-endian), bucket by bucket in canonical order
(kinds fp8, int4, int2; sizes ascending; groups by start):

    shift  float16 [n_groups, T]
    scale  float16 [n_groups, T]
    codes  [n_groups, size, T] flattened component-major, packed: fp8 1 byte, int4 2 per byte (low nibble first),
           int2 4 per byte (lowest bits first); zero-padded to an even number of bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from ..errors import CalibrationError
from .quant import BITS, KINDS, dequantize, group_cost_bits, quantize

GROUP_SIZES = (1, 16, 64, 256, 1024)
KIND_ORDER = ("fp8", "int4", "int2")


@dataclass(frozen=True)
class Bucket:
    kind: str
    size: int
    starts: tuple[int, ...]

    def index(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Coordinate indices [n, size] of this bucket's groups."""
        st = torch.tensor(self.starts, dtype=torch.int64, device=device)
        return st[:, None] + torch.arange(self.size, dtype=torch.int64, device=device)[None, :]

    def nbytes(self, tokens: int) -> int:
        n = len(self.starts)
        code_bits = BITS[self.kind] * n * self.size * tokens
        return 4 * n * tokens + 2 * ((code_bits + 15) // 16)  # codes padded to an even length (fp16 alignment)


@dataclass(frozen=True)
class Plan:
    """Coded groups over ``features`` PCA coordinates, for a target ``ratio`` and ``budget_bits`` per token."""

    features: int
    ratio: float
    budget_bits: int
    groups: tuple[tuple[int, int, str], ...]

    def __post_init__(self) -> None:
        end = 0
        for start, size, kind in self.groups:
            if kind not in KINDS or kind == "none":
                raise CalibrationError(f"plan group kind {kind!r} is not a coded type")
            if size not in GROUP_SIZES:
                raise CalibrationError(f"plan group size {size} not in {GROUP_SIZES}")
            if start % size:
                raise CalibrationError(f"plan group at {start} of size {size} is not aligned to its size")
            if start < end:
                raise CalibrationError(f"plan groups overlap or are unsorted at coordinate {start}")
            end = start + size
        if end > self.features:
            raise CalibrationError(f"plan codes coordinate {end - 1} beyond the basis width {self.features}")

    @property
    def rank(self) -> int:
        """Number of leading PCA components the plan needs (the trimmed basis width)."""
        return self.groups[-1][0] + self.groups[-1][1] if self.groups else 0

    @property
    def bits_per_token(self) -> int:
        return sum(group_cost_bits(k, s) for _, s, k in self.groups)

    @cached_property
    def buckets(self) -> tuple[Bucket, ...]:
        out = []
        for kind in KIND_ORDER:
            for size in GROUP_SIZES:
                starts = tuple(st for st, sz, k in self.groups if k == kind and sz == size)
                if starts:
                    out.append(Bucket(kind, size, starts))
        return tuple(out)

    def nbytes(self, tokens: int) -> int:
        """Exact byte length of this plan's section for ``tokens`` tokens (before entropy coding)."""
        return sum(b.nbytes(tokens) for b in self.buckets)

    def kind_counts(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS if k != "none"}
        for _, size, kind in self.groups:
            out[kind] += size
        return out

    # ------------------------------------------------------------------ serialisation (run-length)
    def to_dict(self) -> dict[str, Any]:
        runs: list[list[Any]] = []
        for start, size, kind in self.groups:
            if runs and runs[-1][1] == size and runs[-1][2] == kind and runs[-1][0] + runs[-1][3] * size == start:
                runs[-1][3] += 1
            else:
                runs.append([start, size, kind, 1])
        return {"features": self.features, "ratio": self.ratio, "budget_bits": self.budget_bits, "runs": runs}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        try:
            groups = []
            for start, size, kind, count in d["runs"]:
                for i in range(int(count)):
                    groups.append((int(start) + i * int(size), int(size), str(kind)))
            return cls(int(d["features"]), float(d["ratio"]), int(d["budget_bits"]), tuple(groups))
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationError(f"malformed plan record: {e}") from e


# ---------------------------------------------------------------------- packing
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat uint8 tensor of ``bits``-bit codes into bytes (low bits first)."""
    if bits == 8:
        return codes
    per = 8 // bits
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat((codes, codes.new_zeros(pad)))
    c = codes.view(-1, per)
    out = c[:, 0].clone()
    for i in range(1, per):
        out |= c[:, i] << (bits * i)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``count`` codes as uint8."""
    if bits == 8:
        return packed[:count]
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=1).reshape(-1)[:count]


def iter_sections(plan: Plan, tokens: int) -> Iterator[tuple[Bucket, int, int]]:
    """Yield (bucket, offset, nbytes) of each bucket within a plan's section."""
    off = 0
    for b in plan.buckets:
        n = b.nbytes(tokens)
        yield b, off, n
        off += n


def encode_coefficients(coeffs: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Quantize and pack PCA coefficients ``[T, >= plan.rank]`` (float32) into one uint8 tensor."""
    tokens = coeffs.shape[0]
    parts: list[torch.Tensor] = []
    for b in plan.buckets:
        idx = b.index(coeffs.device)
        x = coeffs[:, idx.reshape(-1)].view(tokens, len(b.starts), b.size)
        codes, shift, scale = quantize(x, b.kind)
        parts.append(shift.t().contiguous().view(torch.uint8).reshape(-1))
        parts.append(scale.t().contiguous().view(torch.uint8).reshape(-1))
        packed = pack_codes(codes.permute(1, 2, 0).reshape(-1), BITS[b.kind])
        parts.append(packed)
        if packed.numel() % 2:
            parts.append(packed.new_zeros(1))
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=coeffs.device)
    return torch.cat(parts)


def decode_coefficients(buf: torch.Tensor, plan: Plan, tokens: int) -> torch.Tensor:
    """Inverse of :func:`encode_coefficients`: coefficients ``[T, plan.rank]`` (float32, zeros where not coded)."""
    out = torch.zeros(tokens, plan.rank, dtype=torch.float32, device=buf.device)
    for b, off, nb in iter_sections(plan, tokens):
        n = len(b.starts)
        chunk = buf[off : off + nb]
        meta = n * tokens * 2
        shift = chunk[:meta].view(torch.float16).view(n, tokens).t()
        scale = chunk[meta : 2 * meta].view(torch.float16).view(n, tokens).t()
        codes = unpack_codes(chunk[2 * meta :], BITS[b.kind], n * b.size * tokens)
        codes = codes.view(n, b.size, tokens).permute(2, 0, 1)
        vals = dequantize(codes, shift, scale, b.kind)
        out[:, b.index(buf.device).reshape(-1)] = vals.reshape(tokens, -1)
    return out
