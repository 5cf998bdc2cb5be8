"""One configuration of ``dynamo-kvtc bench gpu`` (:mod:`dynamo_kvtc.bench.gpu` drives the run): for one (shape,
batch, tokens) the recompute TTFT, the raw restore from pinned host memory, the fused compress into host blobs and
the kvtc restore from them into poisoned paged blocks, each against its roofline floor; plus the layer-group variant
of the primary shape, which reruns one configuration on a calibration with several layer groups.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..errors import ConfigError
from . import gpu_timing as gt
from .gpu_checks import accuracy_check, projection
from .gpu_model import PagedCache, RandomDecoder, fill_synthetic_kv, synthetic_calibration_gpu
from .gpu_report import print_config
from .gpu_timing import Budget, events_ms, guarded, med, sync


# ============================================================================================ one configuration
class ConfigRun:
    """One (shape, batch, tokens) configuration: owns its source and destination paged caches and the restore
    stream's work; fills ``res`` part by part. Never frees the context's pinned host buffers (shared across runs)."""

    def __init__(self, ctx: dict, name: str, cal, model: RandomDecoder, B: int, T: int, args) -> None:
        self.ctx, self.name, self.cal, self.model, self.B, self.T, self.args = ctx, name, cal, model, B, T, args
        self.dev = ctx["dev"]
        fp = cal.fingerprint
        L, H, D, bs = fp.num_layers, fp.num_kv_heads, fp.head_dim, args.block_size
        if T % bs:
            raise ConfigError(f"tokens {T} must be a multiple of the block size {bs}")
        self.L, self.H, self.D, self.bs = L, H, D, bs
        nbs = T // bs
        self.nblocks = B * nbs
        self.raw_bytes = 2 * L * B * T * H * D * 2
        self.res: dict[str, Any] = {"shape": name, "batch": B, "tokens": T, "raw_bytes": self.raw_bytes}
        self.res["ratio"] = args.ratio
        perm = torch.randperm(self.nblocks, generator=torch.Generator().manual_seed(B * 7 + T))
        self.block_ids = [perm[b * nbs : (b + 1) * nbs].clone() for b in range(B)]
        self.flat_ids = torch.cat(self.block_ids).to(self.dev)
        t0 = time.perf_counter()
        self.src = PagedCache(L, self.nblocks, bs, H, D, self.dev)
        fill_synthetic_kv(self.src, cal, self.block_ids, T, seed=B * 1000 + T)
        self.dst = PagedCache(L, self.nblocks, bs, H, D, self.dev)
        self.res["setup_kv_s"] = round(time.perf_counter() - t0, 2)
        self.step_in = model.inputs(B, 1, seed=3)
        self.rstream = ctx["restore_stream"]

    def kv_of(self, cache):
        B, T, H, D = self.B, self.T, self.H, self.D
        return lambda layer: tuple(x.view(B, T, H, D) for x in cache.gather_seq(layer, self.flat_ids))

    def recompute(self, recompute: dict | None) -> None:
        """(a) recompute TTFT (reused from an earlier run of the same shape when given) and one decode step."""
        model, B, T, args = self.model, self.B, self.T, self.args
        if recompute is None:
            inp = model.inputs(B, T)
            pre = events_ms(lambda: model.prefill(inp), repeat=max(1, args.repeat - 1), warmup=1)
            del inp
            recompute = {
                "ttft_ms": med(pre),
                "runs_ms": pre,
                "flops": model.prefill_flops(B, T),
                "floor_ms": model.prefill_flops(B, T) / (self.ctx["ceil"]["gemm_bf16_TFLOPs"] * 1e9),
            }
            recompute["fraction_of_roofline"] = recompute["floor_ms"] / recompute["ttft_ms"]
        self.res["recompute"] = recompute
        step = med(events_ms(lambda: model.step(self.step_in, T, self.kv_of(self.src)), repeat=3, warmup=1))
        self.res["decode_step_ms"] = step

    def _raw_restore_once(self, host, stage, step: bool):
        cuda, L, dst, flat_ids = gt.cuda, self.L, self.dst, self.flat_ids
        start = cuda.Event(enable_timing=True)
        start.record()
        self.rstream.wait_event(start)
        evs = []
        with cuda.stream(self.rstream):
            for layer in range(L):
                stage.copy_(host[layer], non_blocking=True)
                k, v = dst.views(layer)
                k.index_copy_(0, flat_ids, stage[0])
                v.index_copy_(0, flat_ids, stage[1])
                ev = cuda.Event(enable_timing=True)
                ev.record()
                evs.append(ev)
        end = cuda.Event(enable_timing=True)
        if step:
            self.model.step(
                self.step_in, self.T, self.kv_of(dst), wait=lambda i: cuda.current_stream().wait_event(evs[i])
            )
        else:
            cuda.current_stream().wait_event(evs[-1])
        end.record()
        end.synchronize()
        return start.elapsed_time(evs[0]), start.elapsed_time(evs[-1]), start.elapsed_time(end)

    def raw_restore(self) -> None:
        """(b) raw restore from pinned host memory, layer by layer, plus the first decode step."""
        L, H, D, bs, nblocks, args = self.L, self.H, self.D, self.bs, self.nblocks, self.args
        per_layer = 2 * nblocks * bs * H * D  # elements
        host = self.ctx["host_raw"][: L * per_layer * 2].view(torch.bfloat16).view(L, 2, nblocks, bs, H, D)
        for layer in range(L):  # the host pool holds each sequence's blocks in order
            k, v = self.src.views(layer)
            host[layer, 0].copy_(k.index_select(0, self.flat_ids))
            host[layer, 1].copy_(v.index_select(0, self.flat_ids))
        sync()
        stage = torch.empty(2, nblocks, bs, H, D, dtype=torch.bfloat16, device=self.dev)
        self._raw_restore_once(host, stage, False)
        runs = [self._raw_restore_once(host, stage, False) for _ in range(args.repeat)]
        ttft = [self._raw_restore_once(host, stage, True)[2] for _ in range(max(1, args.repeat - 1))]
        self.res["raw_restore"] = {
            "first_layer_ms": med([r[0] for r in runs]),
            "all_layers_ms": med([r[1] for r in runs]),
            "ttft_ms": med(ttft),
            "floor_ms": self.raw_bytes / (self.ctx["ceil"]["h2d_GBps"] * 1e6),
        }

    def compress(self) -> None:
        """(d) compress: paged blocks -> blobs in pinned host memory, by stage, against its roofline floor."""
        from ..codec.gpu.fused import FusedCodec, PagedBlocks, Span
        from ..codec.kvtc import KvtcCodec

        cal, args, B, T, H, D = self.cal, self.args, self.B, self.T, self.H, self.D
        codec = KvtcCodec(cal, ratio=args.ratio, device=self.dev, tag=args.tag, fused=False, projection=projection())
        fc = self.fc = FusedCodec(codec)
        self.source = PagedBlocks(self.src.views, self.L, self.block_ids)
        self.spans = [Span(b, 0, torch.arange(T)) for b in range(B)]
        blobs_host = self.ctx["host_blobs"]
        fc.encode_batch(self.source, self.spans, host_out=blobs_host)  # warm-up (Triton compiles here the first time)
        enc_wall, enc_st = [], []
        for _ in range(args.repeat):
            sync()
            t0 = time.perf_counter()
            placed = fc.encode_batch(self.source, self.spans, host_out=blobs_host)
            enc_wall.append((time.perf_counter() - t0) * 1e3)
            enc_st.append(dict(fc.last_timings))
        self.blobs = [(blobs_host, off, n) for off, n in placed]
        stored = self.stored = sum(n for _, n in placed)
        st = {k: med([d[k] for d in enc_st]) * 1e3 for k in enc_st[0] if k.endswith("_s")}
        gpu_ms = sum(v for k, v in st.items() if k not in ("encode_total_s", "encode_d2h_s"))
        ranks = sum(
            (g.layers[1] - g.layers[0]) * H * D * (g.k_plans[args.ratio].rank + g.v_plans[args.ratio].rank)
            for g in cal.groups
        )
        self.enc_flops = 2 * ranks * sum(T - min(T, 4 + 128) for _ in range(B))
        self.gemm_rate = self.ctx["ceil"]["gemm_rate_for_floors_TFLOPs"] * 1e9  # FLOP per ms
        ceil = self.ctx["ceil"]
        enc_floor = max(self.enc_flops / self.gemm_rate, (self.raw_bytes + stored) / (ceil["copy_GBps"] * 1e6))
        self.res["compress"] = {
            "wall_ms": med(enc_wall),
            "gpu_ms": gpu_ms,
            "stages_ms": {k.removeprefix("encode_").removesuffix("_s"): v for k, v in st.items()},
            "stored_bytes": stored,
            "ratio_with_window": self.raw_bytes / stored,
            "gemm_flops": self.enc_flops,
            "coded_rows": B * (T - 4 - 128),
            "floor_ms": enc_floor,
            "floor_basis": "max(GEMM FLOPs / measured fp16 GEMM rate, (raw read + compressed write) / HBM bandwidth)",
            "bf16_retry": bool(enc_st[-1].get("encode_bf16_retry", 0.0)),
            "ops": fc.ops.name,
            "kernel_errors": list(fc.kernel_errors),
        }
        self.res["compress"]["fraction_of_roofline"] = enc_floor / gpu_ms if gpu_ms else None

    def _kvtc_restore_once(self, step: bool):
        cuda, rstream = gt.cuda, self.rstream
        start = cuda.Event(enable_timing=True)
        start.record()
        rstream.wait_event(start)
        evs = []
        with cuda.stream(rstream):
            job = self.fc.open(self.blobs)
            gen = job.layers(dest=self.dest, targets=self.targets)
        waits = {}

        def wait(i):
            if i not in waits:
                with cuda.stream(rstream):
                    while len(evs) <= i:
                        next(gen)
                        ev = cuda.Event(enable_timing=True)
                        ev.record()
                        evs.append(ev)
                waits[i] = True
            cuda.current_stream().wait_event(evs[i])

        if step:
            self.model.step(self.step_in, self.T, self.kv_of(self.dst), wait=wait)
        else:
            wait(self.L - 1)
        for _ in gen:  # (nothing left)
            pass
        end = cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        with cuda.stream(rstream):
            stages = job.finish()
        return start.elapsed_time(evs[0]), start.elapsed_time(evs[-1]), start.elapsed_time(end), stages

    def kvtc_restore(self) -> None:
        """(c) kvtc restore from the host tier into poisoned paged blocks, by stage, plus the first decode step."""
        from ..codec.gpu.fused import PagedBlocks

        for c in self.dst.caches:  # poison: the raw restore left exact KV here; every element must be rewritten
            c.fill_(float("nan"))
        self.dest = PagedBlocks(self.dst.views, self.L, self.block_ids)
        self.targets = [(b, 0) for b in range(self.B)]
        args, ceil = self.args, self.ctx["ceil"]
        self._kvtc_restore_once(False)
        runs = [self._kvtc_restore_once(False) for _ in range(args.repeat)]
        ttft = [self._kvtc_restore_once(True)[2] for _ in range(max(1, args.repeat - 1))]
        dst_st = {k: med([r[3][k] for r in runs]) * 1e3 for k in runs[0][3]}
        dec_gpu = sum(dst_st.get(f"decode_{k}_s", 0.0) for k in ("entropy", "dequantize", "project"))
        # same GEMM FLOPs (inverse projection); bytes: compressed read + raw write
        dec_floor = max(self.enc_flops / self.gemm_rate, (self.raw_bytes + self.stored) / (ceil["copy_GBps"] * 1e6))
        host_floor = max(dec_floor, self.stored / (ceil["h2d_GBps"] * 1e6))
        self.res["kvtc_restore"] = {
            "first_layer_ms": med([r[0] for r in runs]),
            "all_layers_ms": med([r[1] for r in runs]),
            "ttft_ms": med(ttft),
            "stages_ms": {k.removeprefix("decode_").removesuffix("_s"): v for k, v in dst_st.items()},
            "decompress_gpu_ms": dec_gpu,
            "decompress_floor_ms": dec_floor,
            "fraction_of_roofline": dec_floor / dec_gpu if dec_gpu else None,
            "restore_floor_ms": host_floor,
            "restore_fraction_of_roofline": host_floor / med([r[1] for r in runs]),
            "nvcomp_decode_mode": self.fc.entropy.decode_mode,
        }

    def accuracy(self, budget: Budget) -> None:
        """Accuracy of the fused path against the reference path (sequence 0), once per shape."""
        ctx, name, res = self.ctx, self.name, self.res
        if ctx.get("accuracy_done", {}).get(name) is None and budget.allow(f"accuracy {name}", 20):
            ctx.setdefault("accuracy_done", {})[name] = True
            acc = guarded(
                res, "accuracy", accuracy_check,
                self.cal, self.args, self.src, self.dst, self.block_ids, self.fc, self.blobs, self.L, self.dev,
            )  # fmt: skip
            if acc is not None:
                res["accuracy"] = acc


def run_config(
    ctx: dict, name: str, cal, model: RandomDecoder, B: int, T: int, args, budget: Budget, recompute=None
) -> dict:
    """Recompute, raw restore, compress and kvtc restore of one configuration (see the module docstring)."""
    run = ConfigRun(ctx, name, cal, model, B, T, args)
    run.recompute(recompute)
    run.raw_restore()
    run.compress()
    run.kvtc_restore()
    run.accuracy(budget)
    res = run.res
    if getattr(args, "kv_dtype", "auto") != "auto":  # restore into an FP8 cache vs a raw copy of it
        from .gpu_fp8 import fp8_restore

        out = guarded(res, "fp8", fp8_restore, run, args.kv_dtype)
        if out is not None:
            res["fp8"] = out
            print(f"  {args.kv_dtype} cache: {out}")
    res["ttft_speedup_vs_recompute"] = res["recompute"]["ttft_ms"] / res["kvtc_restore"]["ttft_ms"]
    res["raw_ttft_speedup_vs_recompute"] = res["recompute"]["ttft_ms"] / res["raw_restore"]["ttft_ms"]
    res["kvtc_vs_raw_restore"] = res["kvtc_restore"]["all_layers_ms"] / res["raw_restore"]["all_layers_ms"]
    ctx["last"] = (run.fc, run.blobs, run.dest, run.targets, run.source, run.spans)
    return res


def layer_group_variant(ctx, name, s, model, args, budget, config) -> dict[str, Any]:
    """The primary shape (NeMo) with ``--layer-groups`` groups, each with its own basis (hierarchical-PCA-like):
    ~3x fewer projection FLOPs at 4 groups. Throughput only: the accuracy cost is not measured here."""
    ratios = sorted({16.0, float(args.ratio)})
    cal, info = synthetic_calibration_gpu(name, s, ratios, layer_groups=args.layer_groups, dev=ctx["dev"])
    B, T = config
    base = next((r for r in ctx.get("results", []) if r["shape"] == name and (r["batch"], r["tokens"]) == (B, T)), None)
    r = run_config(
        ctx, name + f"-lg{args.layer_groups}", cal, model, B, T, args, budget,
        recompute=base["recompute"] if base else None,
    )  # fmt: skip
    r["calibration"] = info
    r["note"] = "layer groups cut projection FLOPs; their accuracy cost is not measured by this benchmark"
    print_config(r)
    ctx.pop("last", None)
    return r
