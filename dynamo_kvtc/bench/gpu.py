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

This module drives the run (device, shared buffers, budget, which parts run, the JSON); one configuration's
measurements (a)-(d) are :mod:`.gpu_config`'s, the checks :mod:`.gpu_checks`', the decoder and synthetic KV
:mod:`.gpu_model`'s, the printed tables and plot :mod:`.gpu_report`'s.

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
from ..codec.entropy.registry import PORTABLE
from ..errors import ConfigError
from ..tiers.config import process_settings
from . import gpu_timing as gt
from .gpu_checks import codec_choice, cpu_path, measure_ceilings, nvcomp_sync_check, overlap_check, projection
from .gpu_config import layer_group_variant, run_config
from .gpu_model import ALPHA, MODELS, RANK_CAP, RandomDecoder, synthetic_calibration_gpu
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
from .gpu_timing import Budget, guarded, log_line
from .output import machine, write_json
from .shapes import SHAPES


def _select_device(args, smoke: bool) -> torch.device:
    if smoke:  # DYN_KVTC_BENCH_SMOKE: a code check on a CPU machine; numbers meaningless
        gt.cuda, gt.PIN[0], dev = gt.CpuCuda(), False, torch.device("cpu")
        args.tag = args.tag or PORTABLE
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
    dev = _select_device(args, settings.tool_settings().bench_smoke)
    budget = Budget(args.budget_s, tuple(getattr(args, "skip", None) or ()))
    args.tag = args.tag or process_settings()["codec"].gpu_tag
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
