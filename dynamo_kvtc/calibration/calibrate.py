"""One-time calibration (paper §3.1, §3.2, B.1): RoPE-free cross-layer PCA and DP plans per ratio.

One row per token = the concatenation over the layers of a layer group x KV heads x head_dim (layer-major, then
head, then dim); separate bases for K and V; rows mean-centred; keys with RoPE removed at their absolute positions;
attention-sink positions excluded. PCA is fitted on all calibration tokens; the DP runs on a seeded uniform sample of
``dp_tokens`` of them (the paper uses the first 32K tokens).

Per-layer token sets (``token_sets``, on by default): where the model has sliding-window layers
(``ModelFingerprint.windows``), layers are grouped by attention type (the calibration's ``layer_order`` puts each
type's layers together; ``layer_groups`` then splits each type into up to that many groups) and a sliding type's
groups record their token set (a span's last ``window`` tokens), which the codec then encodes alone. A sliding
layer's KV of every calibration token is a vector that layer keeps while the token is recent (the capture runs the
model's own sliding attention), so by default every token's row is a sample of what it keeps; ``kept_rows_only``
restricts a sliding group to each sample's last ``window`` tokens instead (the cache's state at the sample's end;
4x fewer rows at 2048-token windows and W = 511).

On a GPU (``device``), the moments, the RoPE removal and the DP sample all stay on the device: a row enters the DP
sample only if its random key can still place it among the ``dp_tokens`` smallest (the same sample as keeping every
row and cutting later), so nothing of the size of the capture ever reaches host memory. Without a ``rank``, a group
of more than 10240 features keeps 10240 components (the paper's cut-off) and the PCA is randomized.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, replace
from typing import Any

import torch

from ..codec.model import BasisGroup, ModelFingerprint
from ..codec.rope import rotate
from ..errors import CalibrationError, ConfigError, InputError
from .artifact import Calibration
from .config import CalibrationConfig, KvSample, group_plan, shard_heads
from .dp import Allocation, allocate, block_errors, compact_sample
from .group_budget import GroupTable, share_budget, token_weights
from .group_fit import GroupFit, orthonormality, plans_and_stats
from .pca import Moments, default_rank, fit_pca

log = logging.getLogger(__name__)


def _bar(total: int | None, desc: str, enabled: bool, unit: str = "it"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, unit=unit, dynamic_ncols=True)


def calibrate(
    source: Any,
    fingerprint: ModelFingerprint | None = None,
    *,
    config: CalibrationConfig | None = None,
    provenance: dict[str, Any] | None = None,
    tokenizer: Any = None,
    texts: Iterable[str] | None = None,
    seq_len: int = 2048,
    **overrides: Any,
) -> Calibration:
    """Build a :class:`Calibration` from KV samples or from a Hugging Face causal LM.

    ``source`` is an iterable of :class:`KvSample` (or ``(keys, values, positions)`` tuples), in which case
    ``fingerprint`` is required; or a transformers model, in which case ``tokenizer`` and ``texts`` are required and
    the KV cache is captured by running the model over the texts in windows of ``seq_len`` tokens.
    Keyword ``overrides`` set fields of :class:`CalibrationConfig` (``ratios``, ``layer_groups``, ``rank``, ...).
    """
    cfg = config or CalibrationConfig()
    if overrides:
        cfg = CalibrationConfig(**{**asdict(cfg), **overrides})
    prov = dict(provenance or {})
    if hasattr(source, "config") and hasattr(source, "forward"):
        from .models import fingerprint_of, iter_model_kv

        if tokenizer is None or texts is None:
            raise ConfigError("calibrating from a model needs tokenizer= and texts=")
        full_fp = fingerprint_of(source, tokenizer)
        samples: Iterable = iter_model_kv(source, tokenizer, texts, seq_len=seq_len, max_tokens=cfg.max_tokens)
        prov.setdefault("seq_len", seq_len)
    else:
        if fingerprint is None:
            raise ConfigError("calibrating from KV samples needs fingerprint=")
        full_fp = fingerprint
        samples = source
    return _calibrate(samples, full_fp, cfg, prov)


def _iter_samples(samples: Iterable) -> Iterator[KvSample]:
    for s in samples:
        if isinstance(s, KvSample):
            yield s
        elif isinstance(s, (tuple, list)) and len(s) == 3:
            yield KvSample(*s)
        else:
            raise InputError(
                f"calibration samples must be KvSample or (keys, values, positions), got {type(s).__name__}"
            )


def _calibrate(
    samples: Iterable, full_fp: ModelFingerprint, cfg: CalibrationConfig, prov: dict[str, Any]
) -> Calibration:
    cal = Calibrator(full_fp, cfg)
    for s in _iter_samples(samples):
        if cal.full:
            break
        cal.add(s)
    return cal.finish(prov)


class Calibrator:
    """Streaming calibration state: feed samples with :meth:`add`, checkpoint with :meth:`state_dict`, then
    :meth:`finish` runs the PCA and the DP. Resuming from a state and feeding the remaining samples gives the same
    calibration (same id) as an uninterrupted run with the same seed."""

    def __init__(self, full_fp: ModelFingerprint, cfg: CalibrationConfig) -> None:
        self.cfg = cfg
        self.full_fp = full_fp
        self.total_heads = full_fp.total_kv_heads or full_fp.num_kv_heads
        self.heads = shard_heads(self.total_heads, cfg.tp_rank, cfg.tp_size)
        H = self.heads.stop - self.heads.start
        keep = ("architecture", "num_layers", "head_dim", "dtype", "rotary", "tokenizer", "model_name", "windows")
        self.fp = ModelFingerprint(
            **{k: getattr(full_fp, k) for k in keep},
            num_kv_heads=H,
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            total_kv_heads=self.total_heads,
        )
        self.order, self.slices, self.group_tokens = group_plan(self.fp, cfg.layer_groups, cfg.token_sets)
        self.dev = torch.device(cfg.device)
        D = self.fp.head_dim
        self._workspace: dict = {}  # the moments' shared float32 scratch (one p x p per width)
        self.mom = {
            (g, kind): Moments((b - a) * H * D, self.dev, self._workspace)
            for g, (a, b) in enumerate(self.slices)
            for kind in "kv"
        }
        self.gen = torch.Generator().manual_seed(cfg.seed)
        # the DP sample: random keys (host) and rows (on the device) of the rows with the smallest keys so far
        self.res_u: list[torch.Tensor] = []
        self.res_rows: dict[str, list[torch.Tensor]] = {"k": [], "v": []}
        self.res_rows["dist"] = []  # each reservoir row's distance from its sample's last token (token sets)
        self._res_cut = float("inf")  # a row whose key is not below this can never be in the DP sample
        self.tokens = 0
        self.sequences = 0
        self.max_len = 0  # the longest sample fed (tokens, sinks included): the shared budget's default span
        self.seconds = 0.0  # wall time spent producing and consuming samples (capture), across resumptions
        self._last = time.time()
        self._bar = _bar(cfg.max_tokens, "calibrate: capture + moments", cfg.progress, unit="tok")

    @property
    def full(self) -> bool:
        return self.cfg.max_tokens is not None and self.tokens >= self.cfg.max_tokens

    def add(self, s: KvSample) -> None:
        cfg, fp = self.cfg, self.fp
        L, D = fp.num_layers, fp.head_dim
        H = fp.num_kv_heads
        keys, values, pos = s.keys, s.values, torch.as_tensor(s.positions, dtype=torch.int64)
        if keys.dim() != 4 or keys.shape != values.shape:
            raise InputError(
                f"calibration sample keys {tuple(keys.shape)} / values {tuple(values.shape)} must be [L,T,H,D]"
            )
        if (keys.shape[0], keys.shape[2], keys.shape[3]) != (L, self.total_heads, D):
            raise InputError(
                f"calibration sample shape {tuple(keys.shape)} does not match the model (layers={L}, "
                f"kv_heads={self.total_heads}, head_dim={D})"
            )
        keep = pos >= cfg.sinks
        if cfg.max_tokens is not None:
            room = cfg.max_tokens - self.tokens
            if room <= 0:
                return
            idx = torch.nonzero(keep).flatten()[:room]
            keep = torch.zeros_like(keep)
            keep[idx] = True
        n = int(keep.sum())
        if n == 0:
            return
        dev = self.dev
        kk = keep.to(keys.device)
        k = keys[:, kk][:, :, self.heads].to(dev, torch.float32)
        v = values[:, kk][:, :, self.heads].to(dev, torch.float32)
        if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
            raise InputError("calibration sample contains NaN or Inf")
        if cfg.remove_rope:
            p = pos[keep].to(dev)
            cache: dict = {}
            for layer in range(L):
                rc = fp.rotary[layer]
                if rc not in cache:
                    cache[rc] = rc.cos_sin(p, device=dev)
                k[layer] = rotate(k[layer], *cache[rc], rc, inverse=True)
        if self.order is not None:
            k, v = k[list(self.order)], v[list(self.order)]
        rows = {"k": k.permute(1, 0, 2, 3).reshape(n, -1), "v": v.permute(1, 0, 2, 3).reshape(n, -1)}
        dist = (keys.shape[1] - 1) - torch.nonzero(keep).flatten()  # tokens after each row's token in its sample
        for g, (a, b) in enumerate(self.slices):
            cols = slice(a * H * D, b * H * D)
            sel = (dist < self.group_tokens[g]).to(dev) if self.group_tokens[g] and cfg.kept_rows_only else None
            for kind in "kv":
                x = rows[kind][:, cols]
                self.mom[(g, kind)].add(x if sel is None else x[sel])
        u = torch.rand(n, generator=self.gen)
        enter = u < self._res_cut  # the others have dp_tokens smaller keys already: they would be cut anyway
        if bool(enter.any()):
            sel = None if bool(enter.all()) else torch.nonzero(enter).flatten()
            self.res_u.append(u if sel is None else u[sel])
            for kind in "kv":
                self.res_rows[kind].append(rows[kind] if sel is None else rows[kind][sel.to(dev)])
            self.res_rows["dist"].append(dist if sel is None else dist[sel])
        if sum(x.numel() for x in self.res_u) > 2 * cfg.dp_tokens:
            self._compact()
        self.tokens += n
        self.sequences += 1
        self.max_len = max(self.max_len, int(keys.shape[1]))
        now = time.time()
        self.seconds += now - self._last
        self._last = now
        self._bar.update(n)

    def _compact(self) -> None:
        compact_sample(self.res_u, self.res_rows, self.cfg.dp_tokens)
        if self.res_u and self.res_u[0].numel() >= self.cfg.dp_tokens:
            self._res_cut = float(self.res_u[0].max())

    def regroup(self, layer_groups: int) -> Calibrator:
        """A calibrator for ``layer_groups`` consecutive groups holding exactly the samples fed to this one, without
        capturing them again (``dynamo-kvtc calibrate --layer-groups 1,2,3`` captures once).

        Each new group's moments are the diagonal block of this calibrator's moments over the group's columns (same
        shift, sum and Gram entries as feeding the group alone), and the DP sample is shared (the reservoir keeps
        whole rows), so the result equals a separate run on the same samples up to float summation order. Every new
        group must lie inside one of this calibrator's groups (always true when this one has a single group)."""
        out = Calibrator(self.full_fp, replace(self.cfg, layer_groups=layer_groups))
        H, D = self.fp.num_kv_heads, self.fp.head_dim
        for g, (a, b) in enumerate(out.slices):
            src = next((i for i, (sa, sb) in enumerate(self.slices) if sa <= a and b <= sb), None)
            if src is None:
                raise ConfigError(
                    f"layer group {a}..{b} of {layer_groups} groups spans several of this calibrator's "
                    f"{len(self.slices)} groups; regroup from a one-group calibrator"
                )
            off = self.slices[src][0]
            cols = slice((a - off) * H * D, (b - off) * H * D)
            for kind in "kv":
                base, m = self.mom[(src, kind)], out.mom[(g, kind)]
                m.n = base.n
                m.shift = None if base.shift is None else base.shift[cols].clone()
                m.sum = base.sum[cols].clone()
                m.gram = base.gram[cols, cols].clone()
        out.gen.set_state(self.gen.get_state())
        out.res_u = list(self.res_u)
        out.res_rows = {kind: list(rows) for kind, rows in self.res_rows.items()}
        out._res_cut = self._res_cut
        out.tokens, out.sequences, out.seconds = self.tokens, self.sequences, self.seconds
        out.max_len = self.max_len
        out._bar.update(self.tokens)
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors of the whole state (for safetensors), where they live (the moments and DP rows on the device:
        ``build`` writes them to disk in pieces)."""
        if self.res_u:
            self._compact()
        out = {
            "counters": torch.tensor([self.tokens, self.sequences], dtype=torch.int64),
            "seconds": torch.tensor([self.seconds], dtype=torch.float64),
            "rng": self.gen.get_state(),
            "max_len": torch.tensor([self.max_len], dtype=torch.int64),
        }
        if self.res_u:
            out["reservoir.u"] = self.res_u[0]
            for kind in self.res_rows:
                out[f"reservoir.{kind}"] = self.res_rows[kind][0]
        for (g, kind), m in self.mom.items():
            if m.n:
                for name, t in m.state_dict().items():
                    out[f"moments.{g}.{kind}.{name}"] = t
        return out

    def state_bytes(self) -> int:
        """Bytes a checkpoint of this state writes (the float64 Gram matrices and the DP rows dominate)."""
        grams = sum(8 * m.p * (m.p + 2) + 4 * m.p for m in self.mom.values())
        rows = sum(t.nbytes for kind in self.res_rows for t in self.res_rows[kind])
        return grams + rows + sum(u.nbytes for u in self.res_u)

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        self.tokens, self.sequences = (int(x) for x in d["counters"])
        self.seconds = float(d["seconds"][0])
        self.max_len = int(d["max_len"][0]) if "max_len" in d else 0  # older checkpoints: set budget_tokens
        self.gen.set_state(d["rng"].cpu())  # a checkpoint loaded onto the GPU brings it there
        if "reservoir.u" in d:
            self.res_u[:] = [d["reservoir.u"].cpu()]
            for kind in "kv":
                self.res_rows[kind][:] = [d[f"reservoir.{kind}"].to(self.dev)]
            # a checkpoint from before token sets has no distances: 0 counts each row into every group
            dist = d.get("reservoir.dist", torch.zeros(len(d["reservoir.u"]), dtype=torch.int64))
            self.res_rows["dist"][:] = [dist.cpu()]
            self._compact()
        for (g, kind), m in self.mom.items():
            prefix = f"moments.{g}.{kind}."
            if prefix + "n" in d:
                m.load_state_dict({k[len(prefix) :]: v for k, v in d.items() if k.startswith(prefix)})
        self._bar.update(self.tokens)
        self._last = time.time()

    # ------------------------------------------------------------------ finish
    def finish(self, prov: dict[str, Any] | None = None) -> Calibration:
        self._bar.close()
        cfg, fp, dev = self.cfg, self.fp, self.dev
        H, D = fp.num_kv_heads, fp.head_dim
        slices, res_u, res_rows = self.slices, self.res_u, self.res_rows
        n_tokens, n_seqs = self.tokens, self.sequences
        prov = dict(prov or {})
        self.seconds += time.time() - self._last
        t_start = time.time() - self.seconds
        if n_tokens < max(64, 2 * cfg.sinks):
            raise CalibrationError(f"calibration data too short: {n_tokens} usable tokens (need at least 64)")
        compact_sample(res_u, res_rows, cfg.dp_tokens)
        t_capture = time.time() - t_start
        fits, t_pca, t_dp = self._fit_groups()
        t0 = time.time()
        allocs, budget_prov = self._allocate(fits)
        t_dp += time.time() - t0
        groups: list[BasisGroup] = []
        stats: dict[str, Any] = {}
        for g, (a, b) in enumerate(slices):
            p = (b - a) * H * D
            parts: dict[str, Any] = {}
            for kind in "kv":
                fit, al = fits[(g, kind)], allocs[(g, kind)]
                parts[kind] = plans_and_stats(g, kind, p, fit, al, cfg.ratios, stats, bool(budget_prov))
            groups.append(
                BasisGroup(
                    (a, b),
                    parts["k"][0],
                    parts["k"][1],
                    parts["v"][0],
                    parts["v"][1],
                    parts["k"][2],
                    parts["v"][2],
                    self.group_tokens[g],
                )
            )
        prov = {
            **prov,
            "tokens": n_tokens,
            "sequences": n_seqs,
            "dp_tokens": int(res_u[0].numel()),
            "seed": cfg.seed,
            "sinks_excluded": cfg.sinks,
            "rank_cap": cfg.rank,
            **_token_set_provenance(self.order, self.group_tokens),
            **budget_prov,
            "pca": {
                "method": "exact" if any(f.pca.method == "exact" for f in fits.values()) else cfg.pca_method,
                "niter": cfg.niter,
                "rank": {f"g{g}.{kind}": int(f.pca.basis.shape[1]) for (g, kind), f in fits.items()},
                **orthonormality(fits),
            },
            "seconds": {
                "capture": round(t_capture, 2),
                "pca": round(t_pca, 2),
                "dp": round(t_dp, 2),
                "total": round(time.time() - t_start, 2),
            },
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "device": str(dev),
                "torch": torch.__version__,
            },
            "stats": stats,
            **cfg.extra,
        }
        return Calibration(fp, groups, rope_removed=cfg.remove_rope, provenance=prov, layer_order=self.order)

    def _fit_groups(self) -> tuple[dict[tuple[int, str], GroupFit], float, float]:
        """PCA of every group and kind, and the DP error tables of its DP sample (seconds of PCA and DP too)."""
        cfg, dev = self.cfg, self.dev
        H, D = self.fp.num_kv_heads, self.fp.head_dim
        fits: dict[tuple[int, str], GroupFit] = {}
        t_pca = t_dp = 0.0
        for m in self.mom.values():
            m.release()  # the capture's scratch buffer: the PCA needs the memory
        for g, (a, b) in enumerate(self.slices):
            cols = slice(a * H * D, b * H * D)
            for kind in "kv":
                t0 = time.time()
                mom = self.mom[(g, kind)]
                rank = cfg.rank if cfg.rank is not None else default_rank(mom.p)
                pca = fit_pca(mom, rank, niter=cfg.niter, seed=cfg.seed + g, method=cfg.pca_method)
                basis16 = pca.basis.to(torch.float16)
                _sync(dev)
                t1 = time.time()
                sample = self.res_rows[kind][0][:, cols].to(dev)
                if self.group_tokens[g] and cfg.kept_rows_only:  # the DP sample: rows kept at the samples' ends
                    sample = sample[(self.res_rows["dist"][0] < self.group_tokens[g]).to(dev)]
                if sample.shape[0] < 16:
                    raise CalibrationError(f"group {g}: only {sample.shape[0]} DP sample rows in its token set")
                coeffs = (sample - pca.mean.to(dev)) @ basis16.to(dev).float()  # the DP's error tables run here too
                bar = _bar(None, f"calibrate: DP errors g{g}.{kind}", cfg.progress, unit="chunk")

                def _tick(i: int, n: int, bar=bar) -> None:
                    bar.total = n
                    bar.update(1)

                zero, errs = block_errors(coeffs, progress=_tick)
                bar.close()
                energy = float(((sample - pca.mean.to(dev)) ** 2).sum())
                fits[(g, kind)] = GroupFit(pca, basis16, zero, errs, energy, int(sample.shape[0]))
                t_pca += t1 - t0
                t_dp += time.time() - t1
        return fits, t_pca, t_dp

    def shares_budget(self) -> bool:
        """Whether one DP spans all groups (:mod:`.group_budget`): groups with different token sets, sharing on."""
        return self.cfg.shared_budget and len(self.slices) > 1 and len(set(self.group_tokens)) > 1

    def _allocate(
        self, fits: dict[tuple[int, str], GroupFit]
    ) -> tuple[dict[tuple[int, str], list[Allocation]], dict[str, Any]]:
        """Allocations per (group, kind), one per ratio: a DP per group, or one DP over all groups."""
        cfg = self.cfg
        H, D = self.fp.num_kv_heads, self.fp.head_dim
        feats = [(b - a) * H * D for a, b in self.slices]
        if not self.shares_budget():
            out = {}
            for (g, kind), fit in fits.items():
                out[(g, kind)] = allocate(fit.zero, fit.errs, [int(16 * feats[g] / float(r)) for r in cfg.ratios])
            return out, {}
        length = cfg.budget_tokens or self.max_len
        weights = token_weights(self.group_tokens, length)
        ew = list(cfg.group_error_weights) or [1.0] * len(self.slices)
        if len(ew) != len(self.slices):
            raise ConfigError(f"group_error_weights has {len(ew)} entries for {len(self.slices)} basis groups")
        out: dict[tuple[int, str], list[Allocation]] = {}
        for kinds in ("kv",) if cfg.share_kv else ("k", "v"):
            keys = [(g, kind) for kind in kinds for g in range(len(self.slices))]
            tables = []
            for g, kind in keys:
                f = fits[(g, kind)]
                scale = 1.0  # "relative": a group's squared error over its mean energy per layer and row
                if cfg.budget_error == "relative":
                    scale = (self.slices[g][1] - self.slices[g][0]) * f.rows / max(f.energy, 1e-30)
                tables.append(GroupTable(f.zero, f.errs, feats[g], f.rows, weights[g], ew[g] * scale))
            for r_allocs in share_budget(tables, cfg.ratios):
                for key, al in zip(keys, r_allocs):
                    out.setdefault(key, []).append(al)
        prov = {
            "group_budget": {
                "span_tokens": length,
                "token_weights": weights,
                "error_weights": ew,
                "error": cfg.budget_error,
                **({"share_kv": True} if cfg.share_kv else {}),
            }
        }
        return out, prov



def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _token_set_provenance(order: tuple[int, ...] | None, tokens: list[int]) -> dict[str, Any]:
    return {"token_sets": {"layer_order": list(order), "group_tokens": tokens}} if order else {}
