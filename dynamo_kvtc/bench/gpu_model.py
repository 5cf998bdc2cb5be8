"""What ``bench gpu`` runs on: model dimensions, a random-initialised bf16 decoder (the recompute baseline), paged
KV caches filled with synthetic KV, and synthetic calibrations on the GPU (real DP on a power-law spectrum)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..calibration.shapes import SHAPES as MODEL_SHAPES
from .shapes import Shape

ALPHA = 1.1  # spectrum exponent of the synthetic calibrations
RANK_CAP = 10240  # the paper's dimensionality cut-off for 8-70B models (B.1)
DP_ROWS = 2048


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    heads: int
    inter: int
    vocab: int
    embed: bool  # first pipeline stage (token embedding)
    head: bool  # last pipeline stage (LM head)


def _dims(name: str, embed: bool = True, head: bool = True) -> ModelDims:
    m = MODEL_SHAPES[name]
    return ModelDims(m.hidden, m.heads, m.inter, m.vocab, embed, head)


MODELS = {
    "llama-3.1-8b": _dims("llama-3.1-8b"),
    "mistral-nemo-12b": _dims("mistral-nemo-12b"),
    "llama-3.3-70b-pp20": _dims("llama-3.1-70b", False, False),  # a middle stage: layers 20-39 of 80
    "smollm2-135m": _dims("smollm2-135m"),  # small: smoke runs
}


# ============================================================================================ synthetic calibration
def _block_errors_dev(coeffs: torch.Tensor):
    from ..calibration.dp import DP_KINDS
    from ..codec.plan import GROUP_SIZES
    from ..codec.quant import group_sq_error

    n, f = coeffs.shape
    zero = coeffs.double().square().sum(0).cpu().numpy()
    errs = {}
    for s in GROUP_SIZES:
        nb = f // s
        if nb == 0:
            continue
        xb = coeffs[:, : nb * s].reshape(n, nb, s)
        for k in DP_KINDS:
            errs[(s, k)] = group_sq_error(xb, k).cpu().numpy()
    return zero, errs


def synthetic_calibration_gpu(
    name: str, s: Shape, ratios, *, layer_groups: int = 1, dev: torch.device, seed: int = 0
) -> tuple[Any, dict[str, Any]]:
    """Synthetic calibration (bases on the GPU, fp16): per layer group a random orthonormal basis of width
    min(p_g, 10240) and the spectrum i^-1.1; the real DP on 2048 coefficient rows drawn from it (one DP serves K and
    V: same distribution)."""
    from ..calibration.artifact import Calibration
    from ..calibration.dp import allocate
    from ..calibration.synthetic import spectrum
    from ..codec.model import BasisGroup, ModelFingerprint
    from ..codec.plan import Plan
    from ..codec.rope import RotaryConfig

    t0 = time.perf_counter()
    L, H, D = s.layers, s.kv_heads, s.head_dim
    fp = ModelFingerprint(
        "SyntheticForCausalLM", L, H, D, "bfloat16", tuple(RotaryConfig(D, theta=s.theta) for _ in range(L)),
        model_name=name, total_kv_heads=H,
    )  # fmt: skip
    bounds = [round(i * L / layer_groups) for i in range(layer_groups + 1)]
    g = torch.Generator(device=dev).manual_seed(seed)
    groups, info = [], {"groups": []}
    for a, b in zip(bounds[:-1], bounds[1:]):
        p = (b - a) * H * D
        rank = min(p, RANK_CAP)
        lam = spectrum(rank, ALPHA).to(dev)
        coeffs = torch.randn(DP_ROWS, rank, device=dev, generator=g) * lam.sqrt()
        zero, errs = _block_errors_dev(coeffs)
        budgets = [int(16 * p / float(r)) for r in ratios]
        td = time.perf_counter()
        allocs = allocate(zero, errs, budgets)
        dp_s = time.perf_counter() - td
        plans = {float(r): Plan(p, float(r), bb, al.groups) for r, bb, al in zip(ratios, budgets, allocs)}
        width = max(pl.rank for pl in plans.values())
        parts = {}
        for kind in "kv":
            q = torch.linalg.qr(torch.randn(p, width, device=dev, generator=g))[0]
            parts[kind] = ((torch.randn(p, device=dev, generator=g) * 0.1).float(), q.to(torch.float16).contiguous())
        groups.append(
            BasisGroup((a, b), parts["k"][0], parts["k"][1], parts["v"][0], parts["v"][1], plans, dict(plans))
        )
        info["groups"].append(
            {
                "layers": [a, b],
                "p": p,
                "rank_cap": rank,
                "dp_seconds": round(dp_s, 2),
                "plans": {
                    f"{r:g}": {"rank": plans[float(r)].rank, "bits": plans[float(r)].kind_counts()} for r in ratios
                },
            }
        )
        del coeffs
    ident = hashlib.sha256(f"synthetic:{name}:{layer_groups}:{ratios}:{seed}:{ALPHA}".encode()).hexdigest()[:32]
    cal = Calibration(fp, groups, True, {"synthetic": True, "spectrum": f"i^-{ALPHA}", "seed": seed}, id=ident)
    info["seconds"] = round(time.perf_counter() - t0, 2)
    info["spectrum"] = f"lambda_i = i^-{ALPHA}, i = 1..min(p_g, {RANK_CAP})"
    return cal, info


# ============================================================================================ paged KV + data
class PagedCache:
    """Per-layer vLLM-flash-style caches [2, num_blocks, block_size, H, D] bf16; sequence b owns a random
    permutation slice of the blocks."""

    def __init__(self, L: int, nblocks: int, bs: int, H: int, D: int, dev, dtype=torch.bfloat16) -> None:
        self.caches = [torch.empty(2, nblocks, bs, H, D, dtype=dtype, device=dev) for _ in range(L)]
        self.L, self.nb, self.bs, self.H, self.D = L, nblocks, bs, H, D

    def views(self, layer: int):
        c = self.caches[layer]
        return c[0], c[1]

    def gather_seq(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.views(layer)
        n = ids.numel() * self.bs
        return k.index_select(0, ids).view(n, self.H, self.D), v.index_select(0, ids).view(n, self.H, self.D)


def fill_synthetic_kv(cache: PagedCache, cal, block_ids: list[torch.Tensor], T: int, seed: int) -> None:
    """KV from the calibration's own model (z ~ N(0, i^-alpha) on each group's basis, + mean), keys rotated at
    positions 0..T-1 of each sequence, written into the sequences' blocks."""
    from ..calibration.synthetic import spectrum
    from ..codec.rope import apply_rope

    fp = cal.fingerprint
    H, D, bs = fp.num_kv_heads, fp.head_dim, cache.bs
    dev = cache.caches[0].device
    g = torch.Generator(device=dev).manual_seed(seed)
    chunk = 4096
    for ids in block_ids:
        ids_d = ids.to(dev)
        for t0 in range(0, T, chunk):
            n = min(chunk, T - t0)
            pos = torch.arange(t0, t0 + n, device=dev)
            blk = ids_d[t0 // bs : (t0 + n) // bs]
            for grp in cal.groups:
                l0, l1 = grp.layers
                for kind, mean, basis in (("k", grp.k_mean, grp.k_basis), ("v", grp.v_mean, grp.v_basis)):
                    r = basis.shape[1]
                    z = torch.randn(n, r, device=dev, generator=g) * spectrum(r, ALPHA).to(dev).sqrt()
                    x = (z.half() @ basis.t()).float() + mean  # [n, p_g]
                    x = x.view(n, l1 - l0, H, D)
                    for i in range(l1 - l0):
                        xi = x[:, i]
                        if kind == "k":
                            xi = apply_rope(xi, pos, fp.rotary[l0 + i])
                        kv = cache.caches[l0 + i][0 if kind == "k" else 1]
                        kv.index_copy_(0, blk, xi.to(kv.dtype).view(-1, bs, H, D))


# ============================================================================================ random decoder
class RandomDecoder:
    """A random-initialised bf16 Llama-style decoder (or pipeline stage) of a real model's shape."""

    def __init__(self, dims: ModelDims, s: Shape, dev, seed: int = 0) -> None:
        self.d, self.s, self.dev = dims, s, dev
        g = torch.Generator(device=dev).manual_seed(seed)
        nh, nkv, hd, hid = dims.heads, s.kv_heads, s.head_dim, dims.hidden

        def w(*shape):
            return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g) * 0.02

        self.layers = [
            {
                "qkv": w(hid, (nh + 2 * nkv) * hd),
                "o": w(nh * hd, hid),
                "gu": w(hid, 2 * dims.inter),
                "d": w(dims.inter, hid),
            }
            for _ in range(s.layers)
        ]
        self.embed = w(dims.vocab, hid) if dims.embed else None
        self.head = w(hid, dims.vocab) if dims.head else None
        inv = 1.0 / (s.theta ** (torch.arange(0, hd, 2, device=dev).float() / hd))
        self.inv_freq = inv
        self.params = sum(t.numel() for lw in self.layers for t in lw.values()) + (
            (self.embed.numel() if self.embed is not None else 0) + (self.head.numel() if self.head is not None else 0)
        )

    def _cos_sin(self, pos: torch.Tensor):
        ang = pos.float()[:, None] * self.inv_freq[None, :]
        ang = torch.cat((ang, ang), -1)
        return ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)

    @staticmethod
    def _rope(x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin

    @staticmethod
    def _rms(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)

    def inputs(self, B: int, T: int, seed: int = 1):
        g = torch.Generator(device=self.dev).manual_seed(seed)
        if self.embed is not None:
            return torch.randint(0, self.d.vocab, (B, T), device=self.dev, generator=g)
        return torch.randn(B, T, self.d.hidden, device=self.dev, dtype=torch.bfloat16, generator=g)

    def _mlp(self, x, lw):
        gu = self._rms(x) @ lw["gu"]
        gt, up = gu.chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gt) * up) @ lw["d"]

    def prefill(self, inp) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        x = self.embed[inp] if self.embed is not None else inp
        B, T, _ = x.shape
        nh, nkv, hd = self.d.heads, self.s.kv_heads, self.s.head_dim
        cos, sin = self._cos_sin(torch.arange(T, device=self.dev))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            for lw in self.layers:
                qkv = self._rms(x) @ lw["qkv"]
                q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
                q = self._rope(q.view(B, T, nh, hd).transpose(1, 2), cos, sin)
                k = self._rope(k.view(B, T, nkv, hd).transpose(1, 2), cos, sin)
                v = v.view(B, T, nkv, hd).transpose(1, 2)
                rep = nh // nkv
                k = k[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)
                v = v[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)
                a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + a.transpose(1, 2).reshape(B, T, nh * hd) @ lw["o"]
                x = self._mlp(x, lw)
        last = x[:, -1]
        return self._rms(last) @ self.head if self.head is not None else last

    def step(self, inp, T: int, kv_of_layer, wait=None) -> torch.Tensor:
        """One decode token per sequence at position T, attending to the cached T tokens plus itself."""
        x = self.embed[inp] if self.embed is not None else inp  # [B, 1, hidden]
        B = x.shape[0]
        nh, nkv, hd = self.d.heads, self.s.kv_heads, self.s.head_dim
        rep = nh // nkv
        cos, sin = self._cos_sin(torch.tensor([T], device=self.dev))
        for i, lw in enumerate(self.layers):
            if wait is not None:
                wait(i)
            qkv = self._rms(x) @ lw["qkv"]
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = self._rope(q.view(B, 1, nh, hd).transpose(1, 2), cos, sin)  # [B, nh, 1, hd]
            k = self._rope(k.view(B, 1, nkv, hd).transpose(1, 2), cos, sin)
            v = v.view(B, 1, nkv, hd).transpose(1, 2)
            kc, vc = kv_of_layer(i)  # [B, T, nkv, hd]
            K = torch.cat((kc.transpose(1, 2), k), dim=2)
            V = torch.cat((vc.transpose(1, 2), v), dim=2)
            qg = q.reshape(B, nkv, rep, hd)  # the rep query heads of a KV head as rep query rows: exact GQA, no copies
            a = torch.nn.functional.scaled_dot_product_attention(qg, K, V)
            x = x + a.reshape(B, 1, nh * hd) @ lw["o"]
            x = self._mlp(x, lw)
        last = x[:, -1]
        return self._rms(last) @ self.head if self.head is not None else last

    def prefill_flops(self, B: int, T: int) -> float:
        per_tok = 2 * sum(t.numel() for lw in self.layers for t in lw.values())
        if self.head is not None:
            per_tok_head = 2 * self.head.numel() / T  # last token only
        else:
            per_tok_head = 0.0
        attn = 2 * 2 * self.d.heads * self.s.head_dim * T * T / 2 * len(self.layers)  # causal QK^T + PV per sequence
        return B * (T * per_tok + T * per_tok_head + attn)


def seq_kv(cache: PagedCache, ids: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    ks, vs = zip(*[cache.gather_seq(layer, ids) for layer in range(L)])
    return torch.stack(ks), torch.stack(vs)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
