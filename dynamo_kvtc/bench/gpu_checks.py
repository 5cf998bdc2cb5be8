"""The parts of ``bench gpu`` beside the per-configuration run: hardware ceilings, accuracy of the fused path,
the GPU entropy codec choice, nvCOMP sync check, overlap with a concurrent forward pass, and the CPU path."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ..codec.entropy.registry import PORTABLE
from ..errors import ConfigError
from ..tiers.config import process_settings
from . import gpu_timing as gt
from .gpu_model import ALPHA, PagedCache, RandomDecoder, fill_synthetic_kv, rel_error, seq_kv
from .gpu_timing import events_ms, med, sync


def projection() -> str:
    """The projection GEMMs' precision the benchmark runs: ``DYN_KVTC_PROJECTION``, as a worker's configuration."""
    return process_settings()["codec"].projection


# ============================================================================================ ceilings
def measure_ceilings(dev: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    smoke = dev.type == "cpu"
    n = (64 << 20) if smoke else (2 << 30)
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = med(events_ms(lambda: b.copy_(a), 10, 3))
    out["copy_GBps"] = 2 * n / ms / 1e6
    a = b = None  # free before the next buffers
    m = (16 << 20) if smoke else (1 << 30)
    h = torch.empty(m, dtype=torch.uint8, pin_memory=gt.PIN[0])
    h.numpy()[:] = 7
    d = torch.empty(m, dtype=torch.uint8, device=dev)
    out["h2d_GBps"] = m / med(events_ms(lambda: d.copy_(h, non_blocking=True), 5, 2)) / 1e6
    out["d2h_GBps"] = m / med(events_ms(lambda: h.copy_(d, non_blocking=True), 5, 2)) / 1e6
    h = d = None
    g = torch.Generator(device=dev).manual_seed(0)
    s = 1024 if smoke else 8192
    x = torch.randn(s, s, device=dev, dtype=torch.float16, generator=g)
    y = torch.randn(s, s, device=dev, dtype=torch.float16, generator=g)
    fl = 2 * s**3
    try:
        out["gemm_f16_f32out_TFLOPs"] = (
            fl / med(events_ms(lambda: torch.mm(x, y, out_dtype=torch.float32), 10, 3)) / 1e9
        )
    except (TypeError, RuntimeError) as e:
        out["gemm_f16_f32out_error"] = str(e)
    xb, yb = x.to(torch.bfloat16), y.to(torch.bfloat16)
    out["gemm_bf16_TFLOPs"] = fl / med(events_ms(lambda: xb @ yb, 10, 3)) / 1e9
    f = min(s, 4096)
    xf, yf = x[:f, :f].float(), y[:f, :f].float()
    out["gemm_fp32_TFLOPs"] = 2 * f**3 / med(events_ms(lambda: xf @ yf, 5, 2)) / 1e9
    out["gemm_rate_for_floors_TFLOPs"] = out.get("gemm_f16_f32out_TFLOPs", out["gemm_bf16_TFLOPs"])
    out["note"] = "copy counts bytes read + written; GEMMs on random data, median of 10 after 3 warm-ups"
    return out


def accuracy_check(cal, args, src, dst, block_ids, fc, blobs, L, dev) -> dict[str, Any]:
    """Sequence 0: reconstruction error of the fused path (already restored into ``dst``) and of the reference path
    (float32, KvtcCodec(fused=False)) on the same KV, and the reference decode of the fused blob."""
    from ..codec.kvtc import KvtcCodec

    ids = block_ids[0].to(dev)
    k, v = seq_kv(src, ids, L)
    kf, vf = seq_kv(dst, ids, L)
    T = k.shape[1]
    a, b = 4, T - 128
    ref = KvtcCodec(cal, ratio=args.ratio, device=dev, tag=PORTABLE, fused=False, projection=projection())
    pos = torch.arange(T)
    blob_ref = ref.encode(k, v, pos)
    kr, vr = ref.decode(blob_ref)
    t, off, n = blobs[0]
    kx, vx = ref.decode(memoryview(t.numpy())[off : off + n])
    out = {
        "tokens": T,
        "rel_error_k_fused": rel_error(kf[:, a:b], k[:, a:b]),
        "rel_error_v_fused": rel_error(vf[:, a:b], v[:, a:b]),
        "rel_error_k_reference": rel_error(kr[:, a:b], k[:, a:b]),
        "rel_error_v_reference": rel_error(vr[:, a:b], v[:, a:b]),
        "fused_blob_reference_decode_vs_fused_decode_k": rel_error(kx, kf),
        "fused_blob_reference_decode_vs_fused_decode_v": rel_error(vx, vf),
        "sinks_and_window_exact": bool(torch.equal(kf[:, b:], k[:, b:]) and torch.equal(vf[:, b:], v[:, b:])),
        "all_written": bool(torch.isfinite(kf).all() and torch.isfinite(vf).all()),
        "blob_bytes_reference": len(blob_ref),
        "blob_bytes_fused": n,
    }
    out["error_change_k"] = out["rel_error_k_fused"] / out["rel_error_k_reference"] - 1
    out["error_change_v"] = out["rel_error_v_fused"] / out["rel_error_v_reference"] - 1
    return out


# ============================================================================================ codec choice
def codec_choice(ctx: dict, cal, args) -> dict[str, Any]:
    """Every nvCOMP entropy codec (Deflate, GDeflate, ANS) on the same batch: stored size, entropy-stage GB/s both
    ways, restore time."""
    from ..codec.entropy.nvcomp import nvcomp_available
    from ..codec.entropy.registry import coder, nvcomp_tags
    from ..codec.gpu.fused import FusedCodec
    from ..codec.kvtc import KvtcCodec

    fc0, _, dest, targets, source, spans = ctx["last"]
    out: dict[str, Any] = {"tags": {}}
    if not nvcomp_available():
        out["error"] = "nvCOMP not available: only zlib Deflate on the host"
        return out
    for tag in nvcomp_tags():
        ref = KvtcCodec(cal, ratio=args.ratio, device=ctx["dev"], tag=tag, fused=False, projection=projection())
        fc = FusedCodec(ref)
        host = ctx["host_blobs"]
        fc.encode_batch(source, spans, host_out=host)
        encs, decs, walls = [], [], []
        for _ in range(2):
            placed = fc.encode_batch(source, spans, host_out=host)
            encs.append(dict(fc.last_timings))
            blobs = [(host, off, n) for off, n in placed]
            sync()
            t0 = time.perf_counter()
            job = fc.open(blobs)
            for _ in job.layers(dest=dest, targets=targets):
                pass
            decs.append(job.finish())
            walls.append((time.perf_counter() - t0) * 1e3)
        stored = sum(n for _, n in placed)
        payload = coded_payload_bytes(cal, args.ratio, spans)
        e_ms = med([d["encode_entropy_s"] for d in encs]) * 1e3
        d_ms = med([d["decode_entropy_s"] for d in decs]) * 1e3
        out["tags"][tag] = {
            "stored_bytes": stored,
            "coded_payload_bytes": payload,
            "entropy_encode_ms": e_ms,
            "entropy_decode_ms": d_ms,
            "entropy_encode_GBps": payload / e_ms / 1e6 if e_ms else None,
            "entropy_decode_GBps": payload / d_ms / 1e6 if d_ms else None,
            "restore_wall_ms": med(walls),
            "restore_all_layers_gpu_ms": med([d["decode_total_s"] for d in decs]) * 1e3,
            "nvcomp_decode_mode": fc.entropy.decode_mode,
            "cpu_readable": coder(tag).cpu,
        }
    t = out["tags"]
    base = t[PORTABLE]["stored_bytes"]
    ok = {k: v for k, v in t.items() if v["stored_bytes"] <= 1.05 * base}
    best = min(ok, key=lambda k: t[k]["restore_all_layers_gpu_ms"])
    out["rule"] = "fastest restore among codecs whose stored size is within 5% of Deflate's"
    out["chosen"] = best
    out["current_default"] = process_settings()["codec"].gpu_tag
    out["default_confirmed"] = best == out["current_default"]
    return out


def coded_payload_bytes(cal, ratio, spans) -> int:
    total = 0
    for sp in spans:
        nc = len(sp.positions) - 4 - 128
        for g in cal.groups:
            total += g.k_plans[float(ratio)].nbytes(nc) + g.v_plans[float(ratio)].nbytes(nc)
    return total


def nvcomp_sync_check(ctx: dict) -> dict[str, Any]:
    """Queue ~1 s of GPU sleep, then a whole restore (open, every layer written): if the calls return long before the
    sleep ends, nothing on the restore path (nvCOMP included) synchronised the host with the stream."""
    from ..codec.entropy.nvcomp import nvcomp_available

    fc, blobs, dest, targets, *_ = ctx["last"]
    if not nvcomp_available():
        return {"error": "nvCOMP not available"}
    stream = ctx["restore_stream"]
    out = {}
    with gt.cuda.stream(stream):
        sync()
        t0 = time.perf_counter()
        gt.cuda._sleep(int(2e9))  # ~1 s at 2 GHz
        job = fc.open(blobs)
        for _ in job.layers(dest=dest, targets=targets):
            pass
        call_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        job.finish()
        wait_ms = (time.perf_counter() - t1) * 1e3
    out["restore_calls_ms"] = call_ms
    out["then_waited_ms"] = wait_ms
    out["sync_free"] = wait_ms > 100 and call_ms < 800
    out["mode"] = fc.entropy.decode_mode
    return out


# ============================================================================================ overlap
def overlap_check(ctx: dict, cal, model: RandomDecoder, args) -> dict[str, Any]:
    """Foreground forward passes alone vs while the dedicated (lowest-priority) stream restores and compresses."""
    from ..codec.gpu.fused import FusedCodec, PagedBlocks, Span
    from ..codec.kvtc import KvtcCodec

    dev = ctx["dev"]
    fp = cal.fingerprint
    L, H, D, bs = fp.num_layers, fp.num_kv_heads, fp.head_dim, args.block_size
    T, B = (512 if dev.type == "cpu" else 8192), 2
    nbs = T // bs
    cache = PagedCache(L, B * nbs, bs, H, D, dev)
    ids = [torch.arange(b * nbs, (b + 1) * nbs) for b in range(B)]
    fill_synthetic_kv(cache, cal, ids, T, seed=5)
    flat = torch.cat(ids).to(dev)
    fc = FusedCodec(KvtcCodec(cal, ratio=args.ratio, device=dev, tag=args.tag, fused=False, projection=projection()))
    src = PagedBlocks(cache.views, L, ids)
    spans = [Span(b, 0, torch.arange(T)) for b in range(B)]
    host = torch.empty(cache.caches[0].numel() * 2 * L // 4 + (64 << 20), dtype=torch.uint8, pin_memory=gt.PIN[0])
    bg_stream = gt.cuda.Stream(dev, priority=0)  # the store's dedicated streams: the lowest priority
    with gt.cuda.stream(bg_stream):
        placed = fc.encode_batch(src, spans, host_out=host)
    blobs = [(host, o, n) for o, n in placed]
    dst = PagedCache(L, B * nbs, bs, H, D, dev)
    dest = PagedBlocks(dst.views, L, ids)
    step_in = model.inputs(B, 1, seed=9)
    kv = lambda i: tuple(x.view(B, T, H, D) for x in cache.gather_seq(i, flat))  # noqa: E731
    chunk_in = model.inputs(1, 256 if dev.type == "cpu" else 2048, seed=10)
    workloads = {
        "decode_step_b2_ctx8k": lambda: model.step(step_in, T, kv),
        "prefill_chunk_2048": lambda: model.prefill(chunk_in),
    }
    stop = threading.Event()
    done = [0]

    def cycle(stream) -> None:
        with gt.cuda.stream(stream):
            job = fc.open(blobs)
            for _ in job.layers(dest=dest, targets=[(b, 0) for b in range(B)]):
                pass
            job.finish()
            fc.encode_batch(src, spans, host_out=host)

    def background(stream) -> None:
        while not stop.is_set():
            cycle(stream)
            done[0] += 1

    def stretch(fg, stream) -> dict[str, Any]:
        res = {}
        for wname, fn in workloads.items():
            with gt.cuda.stream(fg):
                alone = events_ms(fn, repeat=8, warmup=2)
                stop.clear()
                done[0] = 0
                th = threading.Thread(target=background, args=(stream,), daemon=True)
                th.start()
                try:
                    time.sleep(0.3)
                    t0 = time.perf_counter()
                    shared = events_ms(fn, repeat=8, warmup=1)
                    dt = time.perf_counter() - t0
                finally:
                    stop.set()
                    th.join()
            res[wname] = {
                "alone_ms": med(alone),
                "with_kvtc_ms": med(shared),
                "stretch": med(shared) / med(alone) - 1,
                "background_iterations_per_s": done[0] / max(dt + 0.3, 1e-9),
            }
        return res

    out: dict[str, Any] = {"background": "loop of: restore 2 x 8K tokens + compress 2 x 8K tokens (fused)"}
    for prio_name, prio in (("equal_priority", 0), ("forward_high_priority", -1)):
        for wname, r in stretch(gt.cuda.Stream(dev, priority=prio), bg_stream).items():
            out[f"{prio_name}/{wname}"] = r
    out["green_contexts"] = green_curve(dev, cycle, stretch, getattr(args, "codec_sms", None) or [])
    return out


def green_curve(dev, cycle, stretch, sms_list) -> dict[str, Any]:
    """The interference curve: for each SM count, the codec's cycle time alone in a green context of that size and
    the forward pass's stretch (at high priority) while the codec loops there. Whole GPU = the lowest-priority row."""
    from ..tiers.streams import green_stream

    curve: dict[str, Any] = {}
    if dev.type != "cuda":
        return {"skipped": "needs CUDA"}
    for sms in sms_list:
        stream = green_stream(dev, sms)
        if stream is None:
            curve[str(sms)] = {"skipped": "green contexts unavailable (see the log)"}
            continue
        cycle(stream)  # warm-up in this context
        t = []
        for _ in range(3):
            gt.cuda.synchronize(dev)
            t0 = time.perf_counter()
            cycle(stream)
            gt.cuda.synchronize(dev)
            t.append(time.perf_counter() - t0)
        curve[str(sms)] = {"codec_cycle_alone_ms": med(t) * 1e3, **stretch(gt.cuda.Stream(dev, priority=-1), stream)}
    full = []
    for _ in range(3):
        gt.cuda.synchronize(dev)
        t0 = time.perf_counter()
        cycle(gt.cuda.Stream(dev, priority=0))
        gt.cuda.synchronize(dev)
        full.append(time.perf_counter() - t0)
    curve["all"] = {"codec_cycle_alone_ms": med(full) * 1e3}
    return curve


# ============================================================================================ CPU path
def cpu_path(cal, args, dev) -> dict[str, Any]:
    """Reference decode on 2 CPU threads (torch + zlib) of one blob, against a 2-thread fp32 GEMM floor."""
    from ..codec.entropy import base as entropy
    from ..codec.kvtc import KvtcCodec

    fp = cal.fingerprint
    L, H, D = fp.num_layers, fp.num_kv_heads, fp.head_dim
    nc = args.cpu_tokens
    T = nc + 4 + 128
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    entropy.set_cpu_threads(2)
    try:
        from ..calibration.synthetic import spectrum
        from ..codec.rope import apply_rope

        grp = cal.groups[0]
        g = torch.Generator(device=dev).manual_seed(11)
        xs = []
        for basis, mean in ((grp.k_basis, grp.k_mean), (grp.v_basis, grp.v_mean)):
            z = torch.randn(T, basis.shape[1], device=dev, generator=g) * spectrum(basis.shape[1], ALPHA).to(dev).sqrt()
            x = ((z.half() @ basis.t()).float() + mean).view(T, -1, H, D)
            xs.append(x)
        pos = torch.arange(T)
        L0 = cal.groups[0].layers[1]
        if len(cal.groups) != 1 or L0 != L:
            raise ConfigError("cpu path expects a one-group calibration")
        k = torch.stack([apply_rope(xs[0][:, i], pos.to(dev), fp.rotary[i]) for i in range(L)]).to(torch.bfloat16)
        v = xs[1].permute(1, 0, 2, 3).to(torch.bfloat16)
        gpu_ref = KvtcCodec(cal, ratio=args.ratio, device=dev, tag=PORTABLE, fused=False, projection=projection())
        blob = gpu_ref.encode(k, v, pos)  # Deflate: CPU-readable
        cpu = KvtcCodec(
            cal, ratio=args.ratio, device="cpu", tag=PORTABLE, fused=False, profile=True, projection=projection()
        )
        cpu.decode(blob)
        times, stages = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            cpu.decode(blob)
            times.append(time.perf_counter() - t0)
            stages.append({k2: v2 for k2, v2 in cpu.last_timings.items() if k2.startswith("decode_")})
        r = grp.k_plans[args.ratio].rank
        rv = grp.v_plans[args.ratio].rank
        flops = 2 * nc * L * H * D * (r + rv)
        a = torch.randn(nc, r)
        bm = torch.randn(r, H * D)
        a @ bm
        t0 = time.perf_counter()
        for _ in range(3):
            a @ bm
        rate = 3 * 2 * nc * r * H * D / (time.perf_counter() - t0)
        raw = 2 * L * T * H * D * 2
        median_s = med(times)
        return {
            "threads": 2,
            "shape_tokens": T,
            "coded_tokens": nc,
            "decode_s": median_s,
            "decode_GBps": raw / median_s / 1e9,
            "stages_s": {k2: med([s[k2] for s in stages]) for k2 in stages[0]},
            "gemm_flops": flops,
            "cpu_gemm_GFLOPs_2_threads": rate / 1e9,
            "gemm_floor_s": flops / rate,
            "fraction_of_gemm_floor": (flops / rate) / median_s,
        }
    finally:
        torch.set_num_threads(old)
        entropy.set_cpu_threads(0)
