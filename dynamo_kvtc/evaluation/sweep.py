"""The runner behind ``dynamo-kvtc eval``: the offline accuracy harness (JSON, Markdown table, PNG plot)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..bench.output import machine
from ..calibration.artifact import Calibration
from ..calibration.catalog import find_calibration
from ..calibration.models import fingerprint_of, load_model
from ..errors import ConfigError
from . import harness, report, tasks
from .methods import DeflateRaw, Fp8, Int8PerToken, Kivi, Kvtc, Vanilla

log = logging.getLogger(__name__)


def methods_for(
    cal: Calibration,
    ratios,
    ablations: bool,
    extra: dict[str, Calibration],
    *,
    projections=("fp16",),
    ablation_ratios=None,
    baselines: bool = True,
) -> list:
    """The methods of one run, in table order: vanilla, kvtc at each ratio and projection, the baselines, the
    sinks/window ablations, then each extra calibration (``--ablation NAME=DIR``) at each of ``ablation_ratios`` it
    has a plan for (default: 16x, else its first ratio) and each projection."""
    ms = [Vanilla()]
    ms += [Kvtc(cal, r, projection=p) for p in projections for r in ratios]
    if baselines:
        ms += [Fp8(), Int8PerToken(), Kivi(4), Kivi(2), DeflateRaw()]
    if ablations:
        if 64.0 in cal.ratios:
            ms.append(Kvtc(cal, 64, sinks=0, label="kvtc-64x-sinks-compressed"))
        if 16.0 in cal.ratios:
            ms.append(Kvtc(cal, 16, window=16, label="kvtc-16x-window16"))
    for name, c in extra.items():
        for r in ablation_ratios_of(c, ablation_ratios):
            for p in projections:
                suffix = "" if p == "fp16" else f"-{p}"
                ms.append(Kvtc(c, r, projection=p, label=f"kvtc-{r:g}x-{name}{suffix}"))
    return ms


def ablation_ratios_of(cal: Calibration, wanted=None) -> list[float]:
    """The ratios an extra calibration is evaluated at: ``wanted`` (each must have a plan), else 16x if it has a
    plan for it, else its first ratio."""
    if wanted is None:
        return [16.0 if 16.0 in cal.ratios else cal.ratios[0]]
    missing = [r for r in wanted if float(r) not in cal.ratios]
    if missing:
        raise ConfigError(
            f"ablation calibration {cal.id[:12]} has no plan for {', '.join(f'{r:g}x' for r in missing)} "
            f"(plans: {', '.join(f'{r:g}x' for r in cal.ratios)})"
        )
    return [float(r) for r in wanted]


def run_eval(args) -> int:
    torch.manual_seed(0)
    path = args.calibration or find_calibration(args.model)
    if path is None:
        raise ConfigError(f"no calibration for {args.model}: pass --calibration DIR")
    cal = Calibration.load(path)
    extra = {}
    for spec in args.ablation or []:
        name, _, d = spec.partition("=")
        if not d:
            raise ConfigError(f"--ablation takes NAME=DIR, got {spec!r}")
        extra[name] = Calibration.load(d)
    ratios = args.ratios or cal.ratios
    for r in ratios:
        if float(r) not in cal.ratios:
            raise ConfigError(f"ratio {r:g} not in calibration ({cal.ratios})")
    for c in extra.values():
        ablation_ratios_of(c, args.ablation_ratios)  # refuse a missing plan before the model loads
    model, tok = load_model(args.model)
    fp = fingerprint_of(model, tok)
    for c in (cal, *extra.values()):
        c.check_model(fp)
    ablations = args.preset == "full" if args.ablations is None else args.ablations
    projections = tuple(args.projections)
    ms = methods_for(
        cal,
        ratios,
        ablations,
        extra,
        projections=projections,
        ablation_ratios=args.ablation_ratios,
        baselines=args.baselines,
    )
    kv_dtype = getattr(args, "kv_dtype", "auto")
    if kv_dtype != "auto":
        from .methods.fp8_input import Fp8Input

        ms = [Fp8Input(m, kv_dtype) for m in ms]
    lengths = tuple(args.lengths) if getattr(args, "lengths", None) else None
    samples = list(tasks.build(tok, args.preset, tuple(args.tasks) if args.tasks else None, args.seed, lengths))
    if not samples:
        raise ConfigError(f"preset {args.preset!r} has no samples of tasks {args.tasks} and lengths {lengths}")
    result = harness.run(model, tok, ms, samples)
    meta = {
        "model": args.model,
        "calibration": str(path),
        "calibration_id": cal.id,
        "preset": args.preset,
        "lengths": list(lengths) if lengths else None,
        "seconds": result["seconds"],
        "machine": machine(),
        "methods": [m.name for m in ms],
        "ablations": {k: v.id for k, v in extra.items()},
        "ablation_layer_groups": {k: v.layer_groups for k, v in extra.items()},
        "layer_groups": cal.layer_groups,
        "projections": list(projections),
        "kv_dtype": kv_dtype,
    }
    files = report.write(Path(args.out), result, meta)
    print(report.markdown(result["summary"], meta))
    print("wrote " + ", ".join(str(p) for p in files.values()))
    return 0
