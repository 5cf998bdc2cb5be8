"""``dynamo-kvtc bench serve``: a workload replayed against each system at each host budget (and arrival rate);
JSON and plots.

The decoder has a real model's shape and random weights (speed only); the calibration is synthetic (a power-law
spectrum on random bases, the real DP), so compressed sizes and codec times are real, reconstruction errors are not
meaningful. ``none`` does not depend on the budget and runs once (per rate).
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigError
from ...tiers.layout import PagedKV
from ..gpu_model import MODELS, ModelDims, RandomDecoder
from ..output import machine, write_json
from ..shapes import SHAPES, Shape
from . import workloads as wl
from .cascade import CascadeTier
from .engine import EngineConfig, ServeEngine, max_tokens
from .latency import RunRecord, summarize
from .rawtier import RawDmaConfig, RawDmaTier
from .systems import SYSTEMS, host_budget, tier_config

log = logging.getLogger(__name__)

__all__ = ["SERVE_MODELS", "ServeBench", "run_bench_serve", "slo_break"]

NOTE = "random weights and a synthetic calibration: speed only (replies and reconstruction errors mean nothing)"
# model name -> (decoder dims, KV shape); "tiny" is for CPU smoke runs
SERVE_MODELS: dict[str, tuple[ModelDims, Shape]] = {
    name: (MODELS[name], SHAPES[name]) for name in ("llama-3.1-8b", "mistral-nemo-12b", "smollm2-135m")
}
SERVE_MODELS["tiny"] = (ModelDims(128, 4, 256, 32000, True, True), Shape(4, 2, 32, 1e4))


def make_calibration(name: str, s: Shape, ratios: tuple[float, ...], device: str, layer_groups: int = 1):
    """The synthetic calibration: on a GPU bench gpu's (``layer_groups`` consecutive groups of layers, each with its
    own basis: a restore decodes group 0 before later groups' bytes arrive); on the CPU one group."""
    if torch.device(device).type == "cuda":
        from ..gpu_model import synthetic_calibration_gpu

        return synthetic_calibration_gpu(name, s, ratios, layer_groups=layer_groups, dev=torch.device(device))[0]
    if layer_groups != 1:
        raise ConfigError(f"--layer-groups {layer_groups}: bench serve builds multi-group calibrations on CUDA only")
    from ...calibration.synthetic import synthetic_calibration

    return synthetic_calibration(s.layers, s.kv_heads, s.head_dim, s.theta, ratios=ratios, dp_rows=512, name=name)


class ServeBench:
    """One model, one calibration and one workload, run against systems at host budgets. Owns the decoder and the
    calibration (built once); builds a fresh store per run and closes it after; never changes the workload."""

    def __init__(
        self, model: str, workload: wl.Workload, cfg: EngineConfig, device: str, layer_groups: int = 1, **tier_kw: Any
    ) -> None:
        dims, self.shape = SERVE_MODELS[model]
        self.model, self.cfg, self.device, self.tier_kw = model, cfg, device, tier_kw
        self.cal = make_calibration(model, self.shape, (16.0, 32.0), device, layer_groups)
        self.decoder = RandomDecoder(dims, self.shape, torch.device(device))
        s = self.shape
        self.bytes_per_token = 2 * s.layers * s.kv_heads * s.head_dim * 2  # K and V, bf16
        self.use(workload)

    def use(self, workload: wl.Workload) -> None:
        """Run ``workload`` from now on (the same model and calibration)."""
        self.w = workload
        self.ws_blocks = wl.working_set_blocks(workload.requests, self.cfg.block_size)
        self.ws_bytes = self.ws_blocks * self.cfg.block_size * self.bytes_per_token

    def store(self, system_name: str, host_bytes: int, disk_dir: str | None, kv: PagedKV | None = None):
        """A fresh store of ``system_name`` at ``host_bytes`` (None for ``none``); ``kv``: the engine's paged pool to
        restore into in place."""
        from ...tiers import KvtcStore

        sysm = SYSTEMS[system_name]
        if not sysm.offload:
            return None
        if sysm.dma:
            s = self.shape
            return RawDmaTier(RawDmaConfig(host_bytes, s.layers, s.kv_heads, s.head_dim, self.cfg.block_size),
                              self.device, kv=kv)  # fmt: skip
        kw = dict(self.tier_kw)
        if kw.get("disk_bytes"):
            kw["disk_dir"] = tempfile.mkdtemp(prefix=f"serve-{system_name}-", dir=disk_dir)
        primary = int(host_bytes * sysm.primary_share)
        cfg = tier_config(sysm, host_bytes - primary, **kw)
        store = KvtcStore(
            self.cal, cfg, device=self.device, block_size=self.cfg.block_size, span_tokens=self.cfg.span_tokens, kv=kv
        )
        store.warm_up()  # as the connector does at start-up: first-use costs are not part of any timed request
        if not primary:
            return store
        s = self.shape
        raw = RawDmaConfig(primary, s.layers, s.kv_heads, s.head_dim, self.cfg.block_size)
        return CascadeTier(RawDmaTier(raw, self.device, kv=kv), store, kv)

    def kv_memory(self) -> torch.Tensor:
        """One KV pool for every run of this bench (the workload's ``max_seqs`` slots of its longest request): each
        engine carves its pool from it, so a run never holds two (a store closed by a run may keep its view a while)."""
        bs = self.cfg.block_size
        need = self.shape.layers * 2 * self.cfg.max_seqs * max_tokens(self.w, bs) * self.shape.kv_heads
        need *= self.shape.head_dim
        if getattr(self, "_kv_memory", None) is None or self._kv_memory.numel() < need:
            self._kv_memory = None
            self._kv_memory = torch.empty(need, dtype=torch.bfloat16, device=self.device)
        return self._kv_memory

    def warm_up(self, systems: list[str], sessions: int = 2) -> None:
        """Every turn of the workload's first ``sessions`` sessions once per system, untimed, so codec set-up, kernel
        compilation (for the workload's own span and batch shapes) and the allocator are not in the first run."""
        first = list(dict.fromkeys(r.session for r in self.w.requests))[:sessions]
        w = wl.Workload(self.w.name, self.w.seed, self.w.params, [r for r in self.w.requests if r.session in first])
        cfg = replace(self.cfg, stretch_samples=0)  # nothing to measure: no replay
        for name in systems:
            engine = ServeEngine(self.decoder, None, cfg, self.device)
            store = engine.store = self.store(name, 1 << 30, None, engine.alloc(w, self.kv_memory()))
            try:
                engine.run(w)
            finally:
                close(store)

    def run(self, system_name: str, fraction: float | None, disk_dir: str | None = None) -> RunRecord:
        host = host_budget(fraction or 0.0, self.ws_blocks, self.cfg.block_size, self.bytes_per_token)
        engine = ServeEngine(self.decoder, None, self.cfg, self.device)
        store = engine.store = self.store(system_name, host, disk_dir, engine.alloc(self.w, self.kv_memory()))
        try:
            ms = engine.run(self.w)
            snap = store.snapshot() if store is not None else {}
        finally:
            close(store)
        summary = summarize(ms, self.cfg.slo_s, self.cfg.slo_tpot_s, engine.steps)
        # raw / stored bytes the kvtc tiers held at the end (each blob once): what the workload's conversations got
        summary["effective_ratio"] = snap.get("effective_ratio")
        rec = RunRecord(system_name, fraction, host if store is not None else 0, summary)
        rec.requests = [m.to_json() for m in ms]
        rec.metrics = ms
        rec.store = {k: v for k, v in snap.items() if isinstance(v, (int, float))}
        return rec


def close(store) -> None:
    """Close a run's store and remove the disk tier's folder it made (each run writes a fresh one)."""
    if store is None:
        return
    store.close()
    if isinstance(store, RawDmaTier):
        return
    if store.cfg.disk_bytes and store.cfg.disk_dir is not None:
        shutil.rmtree(store.cfg.disk_dir, ignore_errors=True)


def sweep(
    bench: ServeBench, systems: list[str], fractions: list[float], disk_dir: str | None, on_record=None
) -> list[RunRecord]:
    """Every system at every budget (``none`` once); ``on_record(records so far)`` after each run."""
    out: list[RunRecord] = []
    for name in systems:
        for f in [None] if not SYSTEMS[name].offload else fractions:
            t0 = time.perf_counter()
            rec = bench.run(name, f, disk_dir)
            s = rec.summary
            print(
                f"{name:>7} budget {'-' if f is None else f'{f:.3f}':>6}: hit {s['hit_rate']:.3f}  TTFT mean "
                f"{s['ttft_mean_s']:.3f} p50 {s['ttft_p50_s']:.3f} p99 {s['ttft_p99_s']:.3f} s  "
                f"TPOT p50 {_ms(s['tpot_p50_s'])} p99 {_ms(s['tpot_p99_s'])}  ITL p99 {_ms(s['itl_p99_s'])}  "
                f"stretch {_x(s.get('step_stretch'))}  "
                f"{s['output_tok_s']:.1f} out tok/s  goodput {s['goodput_rps']:.3f} req/s "
                f"(with TPOT {s['goodput_ttft_tpot_rps']:.3f})  held {_x(s.get('effective_ratio'))}  "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
            rec.qps = bench.w.params.get("qps")
            out.append(rec)
            if on_record is not None:
                on_record(out)
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _label(r: RunRecord) -> str:
    b = "" if r.budget_fraction is None else f" @{r.budget_fraction:g}"
    return f"{r.system}{b}" + ("" if r.qps is None else f" {r.qps:g} qps")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path: str, title: str) -> None:
    """Title the figure, write it to ``path`` (its folder created) and close it: the end of every plot here."""
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_distributions(records: list[RunRecord], path: str, title: str) -> str | None:
    """Two panels: the TTFT and the inter-token-latency distributions (empirical CDFs), one line per run. Returns why
    not when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot"
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    for r in records:
        for ax, xs in zip(axes, ([m.ttft_s for m in r.metrics], [g for m in r.metrics for g in m.itl_s])):
            xs = sorted(xs)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=_label(r), drawstyle="steps-post")
    slo = records[0].summary if records and records[0].summary else {}
    marks = (
        (axes[0], "TTFT (s)", "requests", "slo_s", "TTFT SLO"),
        (axes[1], "inter-token latency (s)", "token gaps", "slo_tpot_s", "TPOT SLO (a per-request mean)"),
    )
    for ax, name, what, key, label in marks:
        ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel(f"fraction of {what}")
        ax.grid(alpha=0.3)
        if slo.get(key) is not None:
            ax.axvline(slo[key], color="gray", ls=":", label=f"{label} {slo[key]:g} s")
        ax.legend(fontsize=8)
    axes[0].set_title("TTFT distribution")
    axes[1].set_title("ITL distribution (every gap between two tokens of a request)")
    _save(plt, fig, path, title)
    return None


def plot_qps(records: list[RunRecord], path: str, title: str) -> str | None:
    """A QPS sweep: p90 TTFT, p90 TPOT, p99 ITL and goodput under both SLOs against the arrival rate, one line per
    (system, budget), the SLOs as dotted lines."""
    plt = _pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot"
    keys = [
        ("ttft_p90_s", "p90 TTFT (s)", "slo_s"),
        ("tpot_p90_s", "p90 TPOT (s)", "slo_tpot_s"),
        ("itl_p99_s", "p99 ITL (s)", None),
        ("goodput_ttft_tpot_rps", "goodput, TTFT and TPOT SLOs (req/s)", None),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(20, 5))
    for key in dict.fromkeys((r.system, r.budget_fraction) for r in records):
        rs = sorted((r for r in records if (r.system, r.budget_fraction) == key), key=lambda r: r.qps or 0.0)
        lab = key[0] + ("" if key[1] is None else f" @{key[1]:g}")
        for ax, (k, _, _) in zip(axes, keys):
            ax.plot([r.qps for r in rs], [r.summary.get(k) for r in rs], marker="o", label=lab)
    s0 = records[0].summary if records else {}
    for ax, (_, label, slo) in zip(axes, keys):
        if slo and s0.get(slo) is not None:
            ax.axhline(s0[slo], color="gray", ls=":")
        ax.set_xlabel("arrival rate (QPS)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    _save(plt, fig, path, title)
    return None


def plot(records: list[RunRecord], path: str, title: str) -> str | None:
    """Hit rate, mean/p50/p99 TTFT, output tokens/s and goodput vs host budget, one line per system (``none`` as a
    horizontal line). Returns why not when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot"
    keys = [
        ("hit_rate", "hit rate"),
        ("ttft_mean_s", "mean TTFT (s)"),
        ("ttft_p50_s", "p50 TTFT (s)"),
        ("ttft_p99_s", "p99 TTFT (s)"),
        ("output_tok_s", "output tokens/s"),
        ("goodput_rps", "goodput (req/s)"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    names = list(dict.fromkeys(r.system for r in records))
    for ax, (k, label) in zip(axes.flat, keys):
        for n in names:
            rs = [r for r in records if r.system == n]
            if rs[0].budget_fraction is None:
                ax.axhline(rs[0].summary[k], ls="--", color="gray", label=n)
                continue
            rs.sort(key=lambda r: r.budget_fraction)
            ax.plot([r.budget_fraction for r in rs], [r.summary[k] for r in rs], marker="o", label=n)
        ax.set_xscale("log")
        fr = sorted({r.budget_fraction for r in records if r.budget_fraction is not None})
        ax.set_xticks(fr, [f"{f:g}" for f in fr])
        ax.minorticks_off()
        ax.set_xlabel("host budget / raw working set")
        ax.set_title(label)
    axes.flat[0].legend()
    _save(plt, fig, path, title)
    return None


def at_slo(records: list[RunRecord], slo_s: float) -> list[dict[str, Any]]:
    """Per (system, budget) of a ``--qps`` sweep: the highest arrival rate whose p90 TTFT met the SLO, and the
    request and output-token throughput there (None: no rate met it)."""
    out = []
    for key in dict.fromkeys((r.system, r.budget_fraction) for r in records):
        ok = [r for r in records if (r.system, r.budget_fraction) == key and r.summary["ttft_p90_s"] <= slo_s]
        best = max(ok, key=lambda r: r.qps or 0.0, default=None)
        s = best.summary if best is not None else {}
        out.append(
            {
                "system": key[0],
                "budget_fraction": key[1],
                "qps": best.qps if best is not None else None,
                "requests_per_s": s["requests"] / s["span_s"] if s else None,
                "output_tok_s": s.get("output_tok_s"),
            }
        )
    return out


def meets_slo(summary: dict[str, Any], attainment: float) -> bool:
    """A run meets the SLO when at least ``attainment`` of its requests met both the TTFT and the TPOT SLO."""
    return summary["slo_ttft_tpot_attainment"] >= attainment


def slo_break(records: list[RunRecord], attainment: float = 0.9) -> list[dict[str, Any]]:
    """Per (system, budget) of a ``--qps`` sweep, in rising rate: the first rate where the run broke the SLO (fewer
    than ``attainment`` of its requests met both the TTFT and the TPOT SLO; None: it held at every rate swept), the
    highest rate below that which held (None: it broke at the lowest), the goodput under both SLOs there, and every
    rate's attainment."""
    out = []
    for key in dict.fromkeys((r.system, r.budget_fraction) for r in records):
        rs = sorted((r for r in records if (r.system, r.budget_fraction) == key), key=lambda r: r.qps or 0.0)
        broke = next((r for r in rs if not meets_slo(r.summary, attainment)), None)
        held = [r for r in rs if broke is None or (r.qps or 0.0) < (broke.qps or 0.0)]
        last = held[-1] if held else None
        out.append(
            {
                "system": key[0],
                "budget_fraction": key[1],
                "breaks_at_qps": broke.qps if broke is not None else None,
                "holds_up_to_qps": last.qps if last is not None else None,
                "goodput_ttft_tpot_rps": last.summary["goodput_ttft_tpot_rps"] if last is not None else None,
                "attainment": {f"{r.qps:g}": r.summary["slo_ttft_tpot_attainment"] for r in rs},
            }
        )
    return out


def load_workload(args, qps: float | None = None) -> wl.Workload:
    """The trace of ``--trace``, or the one ``--workload``/``--param``/``--seed`` generate (``qps`` overrides the
    generator's rate; saved to ``--save-trace``); a bad file or parameter is a :class:`ConfigError`."""
    try:
        if args.trace:
            return wl.load(args.trace)
        params = dict(args.param or {})
        if qps is not None:
            params["qps"] = qps
        if getattr(args, "duration_s", None) is not None:
            params["duration_s"] = args.duration_s
        w = wl.generate(args.workload, args.seed, **params)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"workload: {e}") from None
    if args.save_trace:
        wl.save(w, args.save_trace)
    return w


def run_bench_serve(args) -> int:
    if args.qps and args.trace:
        raise ConfigError("--qps regenerates the workload at each rate: it cannot replay a --trace")
    if args.duration_s is not None and args.trace:
        raise ConfigError("--duration-s shortens a generated workload: it cannot cut a --trace")
    if not args.qps and not args.trace and "qps" not in (args.param or {}) and args.workload in wl.PRESET_QPS:
        args.qps = list(wl.PRESET_QPS[args.workload])  # the preset's sweep
        print(f"--workload {args.workload}: QPS sweep {','.join(f'{q:g}' for q in args.qps)} (--qps to change)")
    w = load_workload(args, args.qps[0] if args.qps else None)
    cfg = EngineConfig(args.token_budget, args.max_seqs, args.block_size, args.span_tokens, args.slo, args.slo_tpot,
                       args.stretch_samples)  # fmt: skip
    tier_kw: dict[str, Any] = {"window": args.window}
    if args.disk_gb:
        tier_kw["disk_bytes"] = int(args.disk_gb * 1e9)
    bench = ServeBench(args.model, w, cfg, args.device, getattr(args, "layer_groups", 1), **tier_kw)
    print(f"bench serve: {args.model} on {args.device} ({NOTE}); workload {w.name}: {w.stats()}")
    print(f"raw working set: {bench.ws_blocks} blocks = {bench.ws_bytes / 1e9:.3f} GB")
    if not args.no_warmup:
        bench.warm_up(args.systems)
    data = {
        "benchmark": "serve",
        "command": " ".join(["dynamo-kvtc", *sys.argv[1:]]),
        "note": NOTE,
        "model": args.model,
        "device": args.device,
        "engine": asdict(cfg),
        "slo": {"ttft_s": args.slo, "tpot_s": args.slo_tpot, "attainment": args.slo_attainment},
        "window": args.window,
        "layer_groups": len(bench.cal.groups),
        "disk_gb": args.disk_gb,
        "workload": wl.describe(w),
        "raw_working_set_bytes": bench.ws_bytes,
        "machine": machine(),
        "runs": [],
    }

    def partial(records: list[RunRecord]) -> None:  # a run cut short keeps the runs it finished
        data["runs"] = [r.to_json() for r in records]
        write_json(args.json_path, data)

    records: list[RunRecord] = []
    for q in args.qps or [None]:
        if q is not None:  # the same sessions at another arrival rate
            print(f"--- qps {q:g}")
            bench.use(load_workload(args, qps=q))
        before = list(records)
        records += sweep(bench, args.systems, args.budgets, args.disk_dir, lambda rs, b=before: partial([*b, *rs]))
    if args.qps:
        data["throughput_at_slo"] = at_slo(records, args.slo)
        for row in data["throughput_at_slo"]:
            print(f"at p90 TTFT <= {args.slo:g} s: {row}")
        data["slo_break"] = slo_break(records, args.slo_attainment)
        for row in data["slo_break"]:
            print(f"SLO (TTFT <= {args.slo:g} s and TPOT <= {args.slo_tpot * 1e3:g} ms for >= "
                  f"{args.slo_attainment:.0%} of requests): {row}")  # fmt: skip
    partial(records)
    if args.plot:
        title = f"bench serve: {args.model}, {w.name} ({NOTE})"
        stem = Path(args.plot)
        dist = stem.with_name(f"{stem.stem}-dist{stem.suffix or '.png'}")
        top = [r for r in records if r.qps == max(args.qps)] if args.qps else records  # the highest rate
        why = plot(top, args.plot, title)
        data["plot"] = why or str(args.plot)
        if why is None:
            plot_distributions(top, str(dist), title)
            data["plot_distributions"] = str(dist)
            if args.qps:
                qp = stem.with_name(f"{stem.stem}-qps{stem.suffix or '.png'}")
                plot_qps(records, str(qp), title)
                data["plot_qps"] = str(qp)
        else:
            print(why)
    write_json(args.json_path, data)
    return 0
