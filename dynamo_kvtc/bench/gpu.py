"""``dynamo-kvtc bench gpu``: the GPU-speed benchmark of issue #6, one process, one run.

For each model shape (Llama-3.1-8B, Mistral-NeMo-12B, one 20-layer Llama-3.3-70B pipeline stage) and each batch
(8 x 8K and 2 x 16K tokens):

(a) recompute TTFT: prefill of a random-initialised bf16 decoder of that shape (per layer: RMSNorm, fused QKV, RoPE,
    causal SDPA (flash), output projection, SwiGLU MLP; embedding and LM head on the last token where the shape has
    them), i.e. what an engine does on a cache miss;
(b) raw restore: the uncompressed KV blocks from pinned host memory into the engine's paged blocks, layer by layer
    (what KVBM's host tier moves), plus the first decode step;
(c) kvtc restore from the host tier: compressed blobs in pinned host memory -> H2D -> CRC -> nvCOMP -> dequantize ->
    per-layer projection + mean + RoPE + scatter into the paged blocks, with the first decode step waiting on each
    layer's event (time to first layer, to all layers, TTFT);
(d) compress: the same KV gathered from the paged blocks -> blobs in pinned host memory,

each split by stage, with the roofline floor (FLOPs / measured GEMM rate, bytes / measured bandwidth) and
measured/floor. Also: accuracy of the fused path against the reference path, the choice of the GPU entropy codec
(Deflate, GDeflate, ANS), a check that nvCOMP decode queues without synchronising, the overlap check (how much a
concurrent forward pass is stretched by the dedicated stream's work), the CPU path on 2 cores against that machine's
GEMM floor, and the issue's targets with the miss factor where missed.

Calibrations are SYNTHETIC (random orthonormal bases, power-law spectrum i^-1.1; the DP runs for real on coefficients
drawn from that spectrum, so the retained rank and bit mix are what the DP keeps on such a spectrum; docs/performance.md
says how the spectrum was chosen against the real SmolLM2 calibration). Throughput only: errors here are not accuracy.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from .. import settings
from ..errors import ConfigError
from . import gpu_timing as gt
from .gpu_checks import (
    accuracy_check,
    codec_choice,
    cpu_path,
    measure_ceilings,
    nvcomp_sync_check,
    overlap_check,
    projection,
)
from .gpu_model import (
    ALPHA,
    MODELS,
    RANK_CAP,
    PagedCache,
    RandomDecoder,
    fill_synthetic_kv,
    synthetic_calibration_gpu,
)
from .gpu_report import (
    PAPER_TABLE5,
    plot,
    print_choice,
    print_config,
    print_overlap,
    print_summary,
    print_targets,
    target_rows,
)
from .gpu_timing import Budget, events_ms, guarded, log_line, med, sync
from .output import machine, write_json
from .shapes import SHAPES


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
    res["ttft_speedup_vs_recompute"] = res["recompute"]["ttft_ms"] / res["kvtc_restore"]["ttft_ms"]
    res["raw_ttft_speedup_vs_recompute"] = res["recompute"]["ttft_ms"] / res["raw_restore"]["ttft_ms"]
    res["kvtc_vs_raw_restore"] = res["kvtc_restore"]["all_layers_ms"] / res["raw_restore"]["all_layers_ms"]
    ctx["last"] = (run.fc, run.blobs, run.dest, run.targets, run.source, run.spans)
    return res


def _select_device(args) -> torch.device:
    if settings.env_value("bench_smoke"):  # code check on a CPU machine; numbers meaningless
        gt.cuda, gt.PIN[0], dev = gt.CpuCuda(), False, torch.device("cpu")
        args.tag = args.tag or "deflate"
    elif not torch.cuda.is_available():
        raise ConfigError("bench gpu needs CUDA")
    else:
        gt.cuda, gt.PIN[0], dev = torch.cuda, True, torch.device("cuda")
    return dev


def _parse(args) -> tuple[list[str], list[tuple[int, int]]]:
    """Shape names and (batch, tokens) pairs; the command line has checked their form already."""
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()] if isinstance(args.shapes, str) else args.shapes
    if isinstance(args.configs, str):
        configs = []
        for c in args.configs.split(","):
            b, t = c.lower().split("x")
            configs.append((int(b), int(t)))
    else:
        configs = list(args.configs)
    for s in shapes:
        if s not in SHAPES or s not in MODELS:
            raise ConfigError(f"unknown shape {s!r}; choose from {sorted(MODELS)}")
    return shapes, configs


def _results_header(args, dev: torch.device) -> dict[str, Any]:
    from ..codec.gpu import fused_status

    results: dict[str, Any] = {
        "benchmark": "gpu",
        "command": " ".join(["dynamo-kvtc", *sys.argv[1:]]),
        "machine": machine(),
        "fused": fused_status(dev, projection()),
        "settings": {
            "ratio": args.ratio, "tag": args.tag, "block_size": args.block_size, "repeat": args.repeat,
            "sinks": 4, "window": 128, "synthetic_spectrum": f"i^-{ALPHA}", "rank_cap": RANK_CAP,
            "calibration": "SYNTHETIC (random orthonormal bases, power-law spectrum, real DP): throughput only",
        },
        "paper_table5_h100": PAPER_TABLE5,
        "configs": [],
        "calibrations": {},
        "notes": [],
    }  # fmt: skip
    try:
        import triton

        results["machine"]["triton"] = triton.__version__
    except ImportError:
        pass
    return results


def _context(results: dict, dev: torch.device, shapes: list[str], configs: list[tuple[int, int]]) -> dict[str, Any]:
    """Restore stream, measured ceilings and the pinned host buffers every configuration shares."""
    log_line(f"bench gpu: {gt.cuda.get_device_name(0)}, torch {torch.__version__}, fused={results['fused']}")
    ctx: dict[str, Any] = {"dev": dev, "restore_stream": gt.cuda.Stream(dev)}
    ctx["ceil"] = results["ceilings"] = measure_ceilings(dev)
    c = ctx["ceil"]
    log_line(
        f"ceilings: copy {c['copy_GBps']:.0f} GB/s, H2D {c['h2d_GBps']:.1f} GB/s, D2H {c['d2h_GBps']:.1f} GB/s, "
        f"fp16 GEMM (fp32 out) {c.get('gemm_f16_f32out_TFLOPs', float('nan')):.0f} TFLOP/s, "
        f"bf16 {c['gemm_bf16_TFLOPs']:.0f}, fp32 {c['gemm_fp32_TFLOPs']:.0f}"
    )
    max_tokens = max(b * t for b, t in configs)
    max_raw = max(2 * SHAPES[s].layers * max_tokens * SHAPES[s].kv_heads * SHAPES[s].head_dim * 2 for s in shapes)
    ctx["host_raw"] = torch.empty(max_raw, dtype=torch.uint8, pin_memory=gt.PIN[0])
    ctx["host_blobs"] = torch.empty(max_raw // 8 + (256 << 20), dtype=torch.uint8, pin_memory=gt.PIN[0])
    return ctx


def _primary_extras(results: dict, ctx: dict, cal, model: RandomDecoder, args, budget: Budget) -> None:
    """On the primary shape's first configuration: nvCOMP sync check, overlap check, codec choice."""
    if budget.allow("nvCOMP sync check", 10):
        out = guarded(results, "nvcomp_sync", nvcomp_sync_check, ctx)
        if out is not None:
            results["nvcomp_sync"] = out
            log_line(f"  nvCOMP decode sync-free: {out}")
    if budget.allow("overlap check", 40):
        out = guarded(results, "overlap", overlap_check, ctx, cal, model, args)
        if out is not None:
            results["overlap"] = out
            print_overlap(out)
    if budget.allow("codec choice", 30):  # last: it reuses the pinned blob buffer
        out = guarded(results, "codec_choice", codec_choice, ctx, cal, args)
        if out is not None:
            results["codec_choice"] = out
            print_choice(out)
    write_json(args.json_path, results)


def _run_shape(results: dict, ctx: dict, name: str, configs, args, budget: Budget, primary: str):
    """Every configuration of one shape on its synthetic calibration; returns the calibration."""
    s = SHAPES[name]
    log_line(f"--- {name}: {s.layers} layers x {s.kv_heads} KV heads x {s.head_dim}")
    ratios = sorted({8.0, 16.0, 32.0, 64.0, float(args.ratio)})
    cal, info = synthetic_calibration_gpu(name, s, ratios, dev=ctx["dev"])
    results["calibrations"][name] = info
    log_line(
        "  synthetic calibration: retained rank per ratio "
        + ", ".join(f"{r}x: {v['rank']}" for r, v in info["groups"][0]["plans"].items())
        + f" (p = {info['groups'][0]['p']}); {info['seconds']} s"
    )
    model = RandomDecoder(MODELS[name], s, ctx["dev"])
    for ci, (B, T) in enumerate(configs):
        if not budget.allow(f"{name} {B}x{T}", 25):
            continue
        t0 = time.perf_counter()
        r = guarded(results, f"{name} {B}x{T}", run_config, ctx, name, cal, model, B, T, args, budget)
        if r is None:
            ctx.pop("last", None)
            continue
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results["configs"].append(r)
        ctx["results"] = results["configs"]
        print_config(r)
        write_json(args.json_path, results)  # partial results survive a timeout
        if name == primary and ci == 0:
            _primary_extras(results, ctx, cal, model, args, budget)
        ctx.pop("last", None)
        gt.cuda.empty_cache()
    del model
    gt.cuda.empty_cache()
    return cal


def _optional_parts(results: dict, ctx: dict, cal_last, primary: str, configs, args, budget: Budget) -> None:
    """The layer-group variant of the primary shape and the CPU path, as the budget allows."""
    dev = ctx["dev"]
    if args.layer_groups > 1 and budget.allow("layer-group variant", 40):
        model = RandomDecoder(MODELS[primary], SHAPES[primary], dev)
        out = guarded(
            results, "layer_groups_variant", layer_group_variant, ctx, primary, SHAPES[primary], model, args, budget,
            configs[0],
        )  # fmt: skip
        if out is not None:
            results["layer_groups_variant"] = out
        del model
        gt.cuda.empty_cache()
    cp = None
    if cal_last is not None and budget.allow("cpu path", 30):
        cp = guarded(results, "cpu_path", cpu_path, cal_last, args, dev)
    if cp is not None:
        results["cpu_path"] = cp
        log_line(
            f"CPU path (2 threads, {cal_last.fingerprint.model_name}, {cp['coded_tokens']} coded tokens): decode "
            f"{cp['decode_s'] * 1e3:.0f} ms = {cp['decode_GBps']:.3f} GB/s; 2-thread GEMM floor "
            f"{cp['gemm_floor_s'] * 1e3:.0f} ms ({cp['cpu_gemm_GFLOPs_2_threads']:.0f} GFLOP/s) -> "
            f"{cp['fraction_of_gemm_floor']:.0%} of the floor"
        )


def run_bench_gpu(args) -> int:
    dev = _select_device(args)
    budget = Budget(args.budget_s, tuple(getattr(args, "skip", None) or ()))
    args.tag = args.tag or settings.env_value("gpu_entropy")
    shapes, configs = _parse(args)
    results = _results_header(args, dev)
    ctx = _context(results, dev, shapes, configs)
    cal_last = None
    primary = "mistral-nemo-12b" if "mistral-nemo-12b" in shapes else shapes[0]
    results["primary"] = {"shape": primary, "batch": configs[0][0], "tokens": configs[0][1]}
    try:
        for name in shapes:
            cal_last = _run_shape(results, ctx, name, configs, args, budget, primary)
        _optional_parts(results, ctx, cal_last, primary, configs, args, budget)
        results["targets"] = target_rows(results)
        print_summary(results)
        print_targets(results["targets"])
    finally:  # an interrupted run (Ctrl-C, a deadline's SIGINT) still leaves what it measured
        results["skipped_for_time"] = budget.skipped
        results["seconds"] = round(time.perf_counter() - budget.t0, 1)
        write_json(args.json_path, results)
    if args.plot_path:
        try:
            plot(results, args.plot_path)
            log_line(f"plot: {args.plot_path}")
        except Exception as e:  # noqa: BLE001 - matplotlib missing or headless trouble: the JSON is what matters
            log_line(f"plot failed: {type(e).__name__}: {e}")
    return 0


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
