"""Tensor parallelism with ONE joint basis, sharded by rows: every TP rank codes only its own KV heads, the blob is
the single-process codec's (issue 16).

A basis group projects a token's K (or V) over all its layers x heads x head_dim (``p`` features) onto ``r``
coefficients: ``c = (x - mean) @ V`` with ``V [p, r]``. The product splits by rows: TP rank ``t`` holds the rows of
``V`` and ``mean`` that belong to its heads (``V_t``, ``mean_t``), so

    c = sum_t (x_t - mean_t) @ V_t          (one all-reduce of the partial coefficients, identical on every rank)
    x_t = c @ V_t^T + mean_t                 (every rank reconstructs only its heads, no collective)

Quantization, entropy coding and the blob are then exactly the single-process codec's: the blob names the joint
calibration, decodes with a plain :class:`~dynamo_kvtc.codec.kvtc.KvtcCodec` (any TP size can read it), and every
rank ends with the same bytes. RoPE is per head and stays local. The accuracy is the joint calibration's up to the
float order of the sum (a quantization bin boundary can flip a rare code; measured in docs/accuracy.md's TP section).

Sinks (fp8 per vector) and the raw window are per head: each rank all-gathers them (a few tokens; the window only
on a sequence's last span) so the blob holds every head, as the single-process blob does.

The collective is injected: any object with ``all_reduce_sum`` and ``all_gather`` (:class:`Collective`), e.g.
:class:`TorchCollective` over a ``torch.distributed`` process group (the connector's own group of the TP ranks:
:mod:`dynamo_kvtc.connector.vllm.tensor_parallel`). Nothing here
imports CUDA, NIXL or Dynamo; the math is the reference path's float32 (on any device).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import ConfigError, InputError
from .base import Codec
from .container import check_section, runs_to_positions, section_chunks, write_blob
from .entropy.registry import PORTABLE
from .entropy.sections import EntropyCoder
from .model import DTYPES, CalibrationLike
from .plan import decode_coefficients, encode_coefficients
from .reference import ReferenceCodec
from .rope import RotaryConfig, rotate
from .sinks import decode_sinks, encode_sinks


class Collective(Protocol):
    """The two collectives the sharded codec needs, over the ranks of one TP group (every rank calls each one with
    tensors of the same shape, in the same order)."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...


@dataclass
class TorchCollective:
    """:class:`Collective` over a ``torch.distributed`` process group (None: the default group). Owns nothing but the
    group handle; never initialises or destroys a process group."""

    group: Any = None

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, t, group=self.group)
        return out


@dataclass(frozen=True)
class HeadLayout:
    """Which KV heads (``[start, stop)`` of the model's ``total_heads``) each TP rank holds, in rank order.

    Ranks hold equal numbers of heads (vLLM's split; replicated when tp > heads). A head held by several ranks is
    contributed to the coefficient sum, and to gathered sinks/windows, by the first of them only.
    """

    total_heads: int
    shards: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        sizes = {b - a for a, b in self.shards}
        if not self.shards or len(sizes) != 1 or min(sizes) <= 0:
            raise ConfigError(f"TP ranks must hold equal, non-empty head ranges, got {self.shards}")
        covered = sorted({h for a, b in self.shards for h in range(a, b)})
        if covered != list(range(self.total_heads)):
            raise ConfigError(f"head ranges {self.shards} do not cover the model's {self.total_heads} KV heads")
        for a, b in set(self.shards):
            if any(a < d < b or a < c < b for c, d in set(self.shards) if (c, d) != (a, b)):
                raise ConfigError(f"head ranges {self.shards} overlap partially")

    @classmethod
    def from_slices(cls, total_heads: int, slices: Sequence[slice]) -> HeadLayout:
        return cls(total_heads, tuple((int(s.start), int(s.stop)) for s in slices))

    @property
    def size(self) -> int:
        return len(self.shards)

    def heads(self, rank: int) -> slice:
        a, b = self.shards[rank]
        return slice(a, b)

    def contributes(self, rank: int) -> bool:
        """Whether ``rank`` is the first holder of its heads (replicas add nothing to the sum)."""
        return self.shards.index(self.shards[rank]) == rank

    def assemble(self, parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """All heads in model order from per-rank tensors (``parts[t]`` holds rank t's heads along ``dim``)."""
        firsts = sorted({self.shards.index(s) for s in self.shards}, key=lambda t: self.shards[t][0])
        return torch.cat([parts[t] for t in firsts], dim)


class _ShardTables:
    """One basis group's rows for this rank's heads (float32): means ``[Lg*h*D]``, bases ``[Lg*h*D, r]``."""

    def __init__(self, g, heads: slice, total_heads: int, head_dim: int, device: torch.device) -> None:
        self.layers = g.layers
        Lg = g.layers[1] - g.layers[0]
        h = torch.arange(heads.start, heads.stop)
        d = torch.arange(head_dim)
        per_layer = (h[:, None] * head_dim + d[None, :]).reshape(-1)  # this rank's rows within one layer
        self.rows = (torch.arange(Lg)[:, None] * total_heads * head_dim + per_layer[None, :]).reshape(-1)
        self.k_mean = g.k_mean.float()[self.rows].to(device)
        self.k_basis = g.k_basis.float()[self.rows].to(device)
        self.v_mean = g.v_mean.float()[self.rows].to(device)
        self.v_basis = g.v_basis.float()[self.rows].to(device)
        self.k_plans = g.k_plans
        self.v_plans = g.v_plans


def allreduce_bytes_per_token(calibration: CalibrationLike, ratio: float, dtype: torch.dtype = torch.float32) -> int:
    """Bytes each rank all-reduces per coded token at ``ratio``: K's and V's retained ranks over all layer groups."""
    ranks = sum(g.k_plans[float(ratio)].rank + g.v_plans[float(ratio)].rank for g in calibration.groups)
    return ranks * torch.empty(0, dtype=dtype).element_size()


class ShardedKvtcCodec(Codec):
    """Encode/decode one TP rank's KV heads with the JOINT calibration (all heads), producing and reading the
    single-process blob format.

    Owns this rank's rows of each basis group and a :class:`ReferenceCodec` (float32 math, headers, blob
    checks). :meth:`encode` is collective: every rank of the layout must call it with the same positions and window
    (it all-reduces partial coefficients and all-gathers sinks/windows); it returns the same bytes on every rank.
    :meth:`decode_layers` / :meth:`decode` are local (no collective) and return only this rank's heads. It never
    creates or tears down a process group, and never writes a blob a single-process codec could not read.

    ``reduce_dtype``: float32 (default) or bfloat16 (halves the all-reduced bytes; the coefficients are rounded to
    bf16 before quantization).
    """

    def __init__(
        self,
        calibration: CalibrationLike,
        rank: int,
        layout: HeadLayout,
        collective: Collective,
        ratio: float = 16,
        device: str | torch.device = "cpu",
        *,
        sinks: int = 4,
        window: int = 128,
        min_tokens: int = 16,
        tag: str = PORTABLE,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        fp = calibration.fingerprint
        if fp.tp_size != 1 or layout.total_heads != fp.num_kv_heads:
            raise ConfigError(
                f"a row-sharded codec needs the joint calibration of all {layout.total_heads} KV heads; calibration "
                f"{calibration.id[:12]} holds {fp.num_kv_heads} heads (tp rank {fp.tp_rank}/{fp.tp_size})"
            )
        if not 0 <= rank < layout.size:
            raise ConfigError(f"rank {rank} outside the layout's {layout.size} ranks")
        if reduce_dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"reduce_dtype must be float32 or bfloat16, got {reduce_dtype}")
        self.base = ReferenceCodec(
            calibration,
            ratio,
            device,
            sinks=sinks,
            window=window,
            min_tokens=min_tokens,
            tag=tag,
            projection="fp16",  # the reference path's float32 math
        )
        self.cal = calibration
        self.fp = fp
        self.rank = rank
        self.layout = layout
        self.collective = collective
        self.heads = layout.heads(rank)
        self.contributes = layout.contributes(rank)
        self.reduce_dtype = reduce_dtype
        self.device = self.base.device
        self.rope_removed = self.base.rope_removed
        self._tables = [
            _ShardTables(g, self.heads, fp.num_kv_heads, fp.head_dim, self.device) for g in calibration.groups
        ]
        self._coders: dict[str, EntropyCoder] = {}

    @property
    def ratio(self) -> float:
        return self.base.ratio

    @property
    def config(self) -> Any:
        """The codec settings (sinks, window, min tokens, ratio, entropy tag): the reference codec's."""
        return self.base.config

    def check_blob(self, blob: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list]:
        """The joint calibration's blob checks (the blob is the single-process codec's)."""
        return self.base.check_blob(blob)

    def _coder(self, tag: str) -> EntropyCoder:
        if tag not in self._coders:
            self._coders[tag] = EntropyCoder(tag, self.device)
        return self._coders[tag]

    def _check(self, keys: torch.Tensor, values: torch.Tensor, positions: Any) -> torch.Tensor:
        fp = self.fp
        want = (fp.num_layers, self.heads.stop - self.heads.start, fp.head_dim)
        for name, t in (("keys", keys), ("values", values)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or (t.shape[0], t.shape[2], t.shape[3]) != want:
                raise InputError(f"{name} must be [layers, tokens, heads, head_dim] with (L, h, D) = {want}")
            if t.dtype not in DTYPES.values():
                raise InputError(f"{name} dtype {t.dtype} not supported (bfloat16, float16, float32)")
        if keys.shape != values.shape or keys.dtype != values.dtype:
            raise InputError("keys and values differ in shape or dtype")
        pos = torch.as_tensor(positions).to("cpu", torch.int64).reshape(-1)
        if pos.numel() != keys.shape[1] or pos.numel() == 0 or int(pos[0]) < 0:
            raise InputError("positions must hold one non-negative position per token")
        if pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all()):
            raise InputError("positions must be strictly increasing")
        return pos

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, layer: int, cache: dict, inverse: bool) -> torch.Tensor:
        cfg: RotaryConfig = self.fp.rotary[layer]
        if cfg not in cache:
            cache[cfg] = cfg.cos_sin(pos, device=x.device)
        cos, sin = cache[cfg]
        return rotate(x, cos, sin, cfg, inverse=inverse)

    def _gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """All heads of ``x [Lg, n, h, D]`` (this rank's heads) from every rank, in model order (collective)."""
        return self.layout.assemble(self.collective.all_gather(x.contiguous()), dim=2)

    # ================================================================== encode (collective)
    def partial_coefficients(self, tab: _ShardTables, keys, values, pos_c, ns: int, nc: int, ratio: float):
        """This rank's share ``(x_t - mean_t) @ V_t`` of K's and V's coefficients, side by side ``[nc, rk + rv]``
        (zeros on a rank whose heads another rank already contributes)."""
        l0, l1 = tab.layers
        parts = []
        rope_cache: dict = {}
        for kind, x, mean, basis, plans in (
            ("k", keys, tab.k_mean, tab.k_basis, tab.k_plans),
            ("v", values, tab.v_mean, tab.v_basis, tab.v_plans),
        ):
            r = plans[ratio].rank
            if not self.contributes:
                parts.append(torch.zeros(nc, r, dtype=torch.float32, device=self.device))
                continue
            xs = x[l0:l1, ns : ns + nc].to(self.device, torch.float32)
            if kind == "k" and self.rope_removed:
                xs = torch.stack([self._rope(xs[i], pos_c, l0 + i, rope_cache, True) for i in range(l1 - l0)])
            rows = xs.permute(1, 0, 2, 3).reshape(nc, -1)
            parts.append((rows - mean) @ basis[:, :r])
        return torch.cat(parts, 1)

    def encode(self, keys: torch.Tensor, values: torch.Tensor, positions: Any, *, window: int | None = None) -> bytes:
        """Encode this rank's ``keys``/``values`` ``[L, T, h, D]`` (keys post-RoPE) at ``positions`` ``[T]`` into the
        single-process blob of all heads. Collective: every rank calls it with the same positions and window.

        Every rank runs the same collectives whatever happens locally: a rank whose own work fails (a copy, the
        projection, the entropy coder) contributes zeros of the agreed shape, and a last all-reduce of the failure
        flags makes EVERY rank raise :class:`~dynamo_kvtc.errors.InputError`, so no rank keeps a blob missing a rank's
        heads and no later collective pairs with the wrong one."""
        pos = self._check(keys, values, positions)
        mode, ns, nw, nc = self.base.config.segments(pos, window)
        pos_c = pos[ns : ns + nc].to(self.device)
        local = _Local(self.device)
        sections: list[tuple[str, str, int, list[bytes]]] = []
        for gi, tab in enumerate(self._tables):
            sections += self._encode_group(gi, tab, keys, values, pos_c, (ns, nw, nc), local)
        failed = local.failed
        flags = self.collective.all_reduce_sum(torch.tensor([1.0 if failed else 0.0], device=self.device))
        if failed or float(flags.sum()) > 0:
            why = f"{type(failed[0]).__name__}: {failed[0]}" if failed else "on another rank"
            raise InputError(f"TP rank {self.rank}: the sharded encode failed {why}; no rank keeps this blob")
        return write_blob(self.base.blob_header(keys.dtype, pos, mode, ns, nw), sections)

    def _encode_group(self, gi: int, tab: _ShardTables, keys, values, pos_c, segs, local: _Local) -> list:
        """One basis group's sections (collective; see :meth:`encode` for what a local failure does)."""
        ns, nw, nc = segs
        cfg, ratio = self.base.config, self.base.config.ratio
        l0, l1 = tab.layers
        T = keys.shape[1]
        shape = (l1 - l0, 0, self.heads.stop - self.heads.start, self.fp.head_dim)
        dev = self.device
        empty = torch.empty(0, dtype=torch.uint8)
        data: dict[str, tuple[str, torch.Tensor]] = {"sinks": ("store", empty), "window": ("store", empty)}
        data["k"] = data["v"] = (cfg.tag, empty)
        if ns:
            sink = (shape[0], ns, *shape[2:])
            sk = self._gather_heads(local(lambda: keys[l0:l1, :ns].to(dev), sink, keys.dtype))
            sv = self._gather_heads(local(lambda: values[l0:l1, :ns].to(dev), sink, keys.dtype))
            data["sinks"] = ("store", local(lambda: encode_sinks(sk, sv).cpu()))
        if nc:
            rk, rv = tab.k_plans[ratio].rank, tab.v_plans[ratio].rank
            part = local(
                lambda: self.partial_coefficients(tab, keys, values, pos_c, ns, nc, ratio).to(self.reduce_dtype),
                (nc, rk + rv),
                self.reduce_dtype,
            )
            coeffs = self.collective.all_reduce_sum(part).float()
            data["k"] = (cfg.tag, local(lambda: encode_coefficients(coeffs[:, :rk], tab.k_plans[ratio])))
            data["v"] = (cfg.tag, local(lambda: encode_coefficients(coeffs[:, rk:], tab.v_plans[ratio])))
        if nw:
            win = (shape[0], nw, *shape[2:])
            wk = self._gather_heads(local(lambda: keys[l0:l1, T - nw :].to(dev), win, keys.dtype))
            wv = self._gather_heads(local(lambda: values[l0:l1, T - nw :].to(dev), win, keys.dtype))
            data["window"] = ("store", local(lambda: torch.cat((_bytes_of(wk), _bytes_of(wv))).cpu()))
        out = []
        for name in ("sinks", "k", "v", "window"):
            tag, raw = data[name]
            got = local(lambda tag=tag, raw=raw: self._coder(tag).compress(raw))
            if got is not None:
                out.append((f"{gi}.{name}", tag, raw.numel(), got))
        return out

    # ================================================================== decode (local)
    def decode_layers(self, blob: bytes | bytearray | memoryview) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(layer, keys [T, h, D], values [T, h, D])`` of this rank's heads in layer order. The blob is
        validated (structure and every section checksum) before the first layer; no collective."""
        h, recs = self.base.check_blob(blob)
        for r in recs:
            check_section(blob, r)
        return self._layers(blob, h, recs)

    def _layers(self, blob, h, recs) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        T, H, D = h["tokens"], h["heads"], h["head_dim"]
        ns, nw = h["sinks"], h["window"]
        nc = T - ns - nw
        hs = self.heads
        nh = hs.stop - hs.start
        dtype = DTYPES[h["dtype"]]
        dev = self.device
        pos_c = torch.tensor(runs_to_positions(h["positions"]), dtype=torch.int64)[ns : ns + nc].to(dev)
        ratio = float(h["ratio"]) if h["ratio"] is not None else None
        by_name = {r.name: r for r in recs}
        rope_cache: dict = {}
        for gi, tab in enumerate(self._tables):
            l0, l1 = tab.layers
            Lg = l1 - l0
            raw = {}
            for part in ("sinks", "k", "v", "window"):
                r = by_name[f"{gi}.{part}"]
                raw[part] = self._coder(r.tag).decompress(section_chunks(blob, r, verify=False), r.raw_len).to(dev)
            if ns:
                sink_k, sink_v = decode_sinks(raw["sinks"], Lg, ns, H, D)
            coeffs = {}
            if nc:
                coeffs["k"] = decode_coefficients(raw["k"], tab.k_plans[ratio], nc)
                coeffs["v"] = decode_coefficients(raw["v"], tab.v_plans[ratio], nc)
            if nw:
                half = raw["window"].numel() // 2
                win_k = raw["window"][:half].view(dtype).view(Lg, nw, H, D)
                win_v = raw["window"][half:].view(dtype).view(Lg, nw, H, D)
            for i in range(Lg):
                k_out = torch.empty(T, nh, D, dtype=dtype, device=dev)
                v_out = torch.empty(T, nh, D, dtype=dtype, device=dev)
                if ns:
                    k_out[:ns] = sink_k[i, :, hs]
                    v_out[:ns] = sink_v[i, :, hs]
                if nc:
                    rows = slice(i * nh * D, (i + 1) * nh * D)
                    for kind, out, mean, basis, plan in (
                        ("k", k_out, tab.k_mean, tab.k_basis, tab.k_plans[ratio]),
                        ("v", v_out, tab.v_mean, tab.v_basis, tab.v_plans[ratio]),
                    ):
                        x = (coeffs[kind] @ basis[rows, : plan.rank].t() + mean[rows]).view(nc, nh, D)
                        if kind == "k" and self.rope_removed:
                            x = self._rope(x, pos_c, l0 + i, rope_cache, False)
                        out[ns : ns + nc] = x
                if nw:
                    k_out[T - nw :] = win_k[i, :, hs]
                    v_out[T - nw :] = win_v[i, :, hs]
                yield l0 + i, k_out, v_out

    def decode(self, blob: bytes | bytearray | memoryview) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(keys, values)`` ``[L, T, h, D]`` in the encoded dtype, RoPE re-applied (no collective)."""
        ks, vs = [], []
        for _, k, v in self.decode_layers(blob):
            ks.append(k)
            vs.append(v)
        return torch.stack(ks), torch.stack(vs)


class _Local:
    """Runs one rank's local steps of a collective encode: after the first failure (kept in ``failed``) every step
    returns zeros of its agreed shape (or None), so the rank still takes part in every collective."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.failed: list[BaseException] = []

    def __call__(self, fn, shape=None, dtype=None):
        if not self.failed:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - reported to every rank by the encode's last all-reduce
                self.failed.append(e)
        return None if shape is None else torch.zeros(shape, dtype=dtype, device=self.device)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)
