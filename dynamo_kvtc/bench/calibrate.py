"""``dynamo-kvtc bench calibrate``: how long a calibration takes and how much memory it needs, per model shape.

Each model (``shape:NAME[@LAYERS]`` random-initialised from :mod:`dynamo_kvtc.calibration.shapes`, or any ``--model``
value ``calibrate`` takes) runs the real ``dynamo-kvtc calibrate`` work (:func:`calibration.build.calibrate_run`) in a
child process of its own, so that its peak host memory (``ru_maxrss``) and peak GPU memory
(``torch.cuda.max_memory_allocated``) are its alone and a model that runs out of memory does not end the others. The
JSON gives the wall time split into load, capture, checkpoint, PCA, DP and save, the capture rate in tokens/s, both
peaks, the PCA's rank, solver and orthonormality, and the machine. ``--reference DIR`` compares each calibration
with another one of the same model (say the CPU one): principal angles between their bases, plan ranks.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from .output import machine, write_json

GIB = 1 << 30


def model_spec(name: str) -> str:
    """A shape's name as a ``--model`` value (``llama-3.1-8b@40`` -> ``shape:llama-3.1-8b@40``); others unchanged."""
    from ..calibration.shapes import SHAPES, is_shape

    return f"shape:{name}" if not is_shape(name) and name.partition("@")[0] in SHAPES else name


def calibrate_args(model: str, out: str, opts: dict[str, Any]) -> Namespace:
    """The arguments of ``dynamo-kvtc calibrate`` for one run (its defaults, then ``opts``)."""
    args = Namespace(
        model=model, out=out, data=None, tokens=65536, ratios=(8, 16, 32, 64), layer_groups=[1], rank=None,
        dp_tokens=16384, seq_len=2048, length_mix=None, budget_tokens=0, budget_error="relative",
        group_error_weights=None, share_kv=False, no_shared_budget=False, seed=0, device="cpu", dtype="auto",
        tp_rank=0, tp_size=1, keep_rope=False, checkpoint_every=None, stop_after_tokens=0, progress=True,
    )  # fmt: skip
    for k, v in opts.items():
        setattr(args, k, v)
    return args


def _peak_host_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_one(model: str, opts: dict[str, Any], out: str, reference: str | None = None) -> dict[str, Any]:
    """Calibrate one model in this process and measure it."""
    import torch

    from ..calibration.artifact import Calibration
    from ..calibration.build import calibrate_run
    from ..calibration.shapes import is_shape, parse_shape

    cuda = torch.cuda.is_available() and torch.device(opts.get("device", "cpu")).type == "cuda"
    if cuda:
        torch.cuda.init()  # resetting a device's peak stats before CUDA is initialised is "Invalid device argument"
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
    res: dict[str, Any] = {"model": model}
    if is_shape(model):
        _, shape = parse_shape(model)
        res.update(layers=shape.layers, params=shape.params(), features_per_kind=shape.kv_features())
    t0 = time.time()
    try:
        run = calibrate_run(calibrate_args(model, out, opts))
    except torch.OutOfMemoryError as e:
        res.update(status="out of memory", error=str(e).splitlines()[0])
    except Exception as e:  # any failure is this model's result, the others still run
        res.update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
    else:
        cal = Calibration.load(run["out"])
        prov = cal.provenance
        sec = run["seconds"]
        res.update(
            status="ok",
            calibration_id=cal.id,
            tokens=prov["tokens"],
            seconds=sec,
            tokens_per_s=round(prov["tokens"] / max(sec["capture"], 1e-9), 1),
            tokens_per_s_overall=round(prov["tokens"] / max(sec["total"], 1e-9), 1),
            checkpoint_gib=round(run["checkpoint_bytes"] / GIB, 2),  # what one checkpoint writes
            pca=prov.get("pca"),
            model_dtype=prov.get("model_dtype", "float32"),
            widths={
                f"g{i}.{kind}": int(getattr(g, f"{kind}_basis").shape[1])
                for i, g in enumerate(cal.groups)
                for kind in "kv"
            },  # fmt: skip
        )
        if reference:
            res["reference"] = compare(cal, Calibration.load(reference))
    res["wall_s"] = round(time.time() - t0, 2)
    if cuda:
        peaks = [torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())]
        reserved = [torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count())]
        res.update(
            peak_gpu_bytes=peaks,
            peak_gpu_gib=round(max(peaks) / GIB, 2),
            peak_gpu_reserved_gib=round(max(reserved) / GIB, 2),
        )
    res["peak_host_rss_gib"] = round(_peak_host_bytes() / GIB, 3)
    return res


def compare(a: Any, b: Any, top: tuple[int, ...] = (64, 256, 1024)) -> dict[str, Any]:
    """How close calibration ``a`` is to ``b`` (same model): per group and kind, the sine of the largest principal
    angle between their leading-``k`` bases (0: the same subspace), the relative distance of their means, and both
    plans' ranks per ratio."""
    import torch

    from ..calibration.pca import subspace_gap

    out: dict[str, Any] = {"id": b.id, "same_id": a.id == b.id}
    if len(a.groups) != len(b.groups):
        return {**out, "error": f"{len(a.groups)} vs {len(b.groups)} basis groups"}
    for i, (ga, gb) in enumerate(zip(a.groups, b.groups)):
        for kind in "kv":
            ba, bb = getattr(ga, f"{kind}_basis").float(), getattr(gb, f"{kind}_basis").float()
            ma, mb = getattr(ga, f"{kind}_mean").float(), getattr(gb, f"{kind}_mean").float()
            w = min(ba.shape[1], bb.shape[1])
            pa, pb = getattr(ga, f"{kind}_plans"), getattr(gb, f"{kind}_plans")
            out[f"g{i}.{kind}"] = {
                "max_sin_angle": {str(k): round(subspace_gap(ba[:, :k], bb[:, :k]), 4) for k in top if k <= w},
                "mean_rel_diff": round(float((ma - mb).norm() / mb.norm().clamp_min(1e-30)), 5),
                "rank": {f"{r:g}": [pa[r].rank, pb[r].rank] for r in pa if r in pb},
                "rel_error_dp_sample": {
                    f"{r:g}": [_stat(a, i, kind, r), _stat(b, i, kind, r)] for r in pa if r in pb
                },  # each on its own DP sample
            }
            del ba, bb
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def _stat(cal: Any, g: int, kind: str, r: float) -> float | None:
    v = (cal.provenance.get("stats") or {}).get(f"g{g}.{kind}.{r:g}x", {}).get("relative_error_dp_sample")
    return None if v is None else round(float(v), 5)


def _child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    res = run_one(spec["model"], spec["opts"], spec["out"], spec.get("reference"))
    Path(spec["result"]).write_text(json.dumps(res, default=float))
    return 0


def run_bench_calibrate(args: Any) -> int:
    """``bench calibrate``: one calibration per model (each in a child process unless ``--in-process``), JSON."""
    t0 = time.time()
    models = [model_spec(m) for m in args.shapes]
    opts: dict[str, Any] = {
        "tokens": args.tokens,
        "device": args.device,
        "dtype": args.dtype,
        "ratios": tuple(args.ratios),
        "rank": args.rank,
        "dp_tokens": args.dp_tokens,
        "seq_len": args.seq_len,
        # none by default: the run measures calibration; `checkpoint_gib` says what each checkpoint would write
        "checkpoint_every": args.checkpoint_every or args.tokens + 1,
        "progress": not args.no_progress,
    }
    report: dict[str, Any] = {
        "benchmark": "calibrate",
        "machine": machine(),
        "config": {**opts, "models": models, "in_process": bool(args.in_process), "budget_s": args.budget_s},
        "results": [],
    }
    work = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="kvtc-bench-cal-"))
    work.mkdir(parents=True, exist_ok=True)
    status = 0
    for m in models:
        left = args.budget_s - (time.time() - t0) if args.budget_s else None
        if left is not None and left < 30:
            report["results"].append({"model": m, "status": "skipped: time budget spent"})
            continue
        out = str(work / m.replace(":", "_").replace("@", "_L"))
        print(f"== bench calibrate: {m} ({args.tokens} tokens on {args.device})", flush=True)
        if args.in_process:
            res = run_one(m, opts, out, args.reference)
        else:
            res = _run_child(m, opts, out, args.reference, work, left)
        report["results"].append(res)
        status = status or (0 if res.get("status") == "ok" else 1)
        print(_line(res), flush=True)
        write_json(args.json_path, report)  # after every model: a later failure keeps the earlier results
    report["total_s"] = round(time.time() - t0, 1)
    write_json(args.json_path, report)
    return status


def _run_child(m: str, opts: dict, out: str, reference: str | None, work: Path, left: float | None) -> dict:
    spec = {"model": m, "opts": opts, "out": out, "reference": reference, "result": out + ".result.json"}
    spec_path = Path(out + ".spec.json")
    spec_path.write_text(json.dumps(spec))
    t = time.time()
    try:
        p = subprocess.run(
            [sys.executable, "-m", __name__, str(spec_path)], timeout=left, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    except subprocess.TimeoutExpired:
        return {"model": m, "status": f"stopped at the time budget after {time.time() - t:.0f} s"}
    rp = Path(spec["result"])
    if rp.is_file():
        return json.loads(rp.read_text())
    return {"model": m, "status": f"child exited with status {p.returncode} (killed: out of host memory?)"}


def _line(res: dict) -> str:
    if res.get("status") != "ok":
        return f"   {res['model']}: {res.get('status')} {res.get('error', '')}"
    s = res["seconds"]
    return (
        f"   {res['model']}: {res['tokens']} tokens in {s['total']:.0f} s (load {s['load']:.0f}, capture "
        f"{s['capture']:.0f} at {res['tokens_per_s']:.0f} tok/s, checkpoint {s['checkpoint']:.0f}, PCA {s['pca']:.0f}, "
        f"DP {s['dp']:.0f}, save {s['save']:.0f}); peak GPU {res.get('peak_gpu_gib', 0)} GiB, host "
        f"{res['peak_host_rss_gib']} GiB"
    )


if __name__ == "__main__":  # the child process of one model
    sys.exit(_child(sys.argv[1]))
