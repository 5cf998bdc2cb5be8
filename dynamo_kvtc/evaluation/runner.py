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


def methods_for(cal: Calibration, ratios, ablations: bool, extra: dict[str, Calibration]) -> list:
    ms = [Vanilla()]
    ms += [Kvtc(cal, r) for r in ratios]
    ms += [Fp8(), Int8PerToken(), Kivi(4), Kivi(2), DeflateRaw()]
    if ablations:
        if 64.0 in cal.ratios:
            ms.append(Kvtc(cal, 64, sinks=0, label="kvtc-64x-sinks-compressed"))
        if 16.0 in cal.ratios:
            ms.append(Kvtc(cal, 16, window=16, label="kvtc-16x-window16"))
    for name, c in extra.items():
        ms.append(Kvtc(c, 16 if 16.0 in c.ratios else c.ratios[0], label=f"kvtc-16x-{name}"))
    return ms


def run_eval(args) -> int:
    torch.manual_seed(0)
    path = args.calibration or find_calibration(args.model)
    if path is None:
        raise ConfigError(f"no calibration for {args.model}: pass --calibration DIR")
    cal = Calibration.load(path)
    model, tok = load_model(args.model)
    cal.check_model(fingerprint_of(model, tok))
    extra = {}
    for spec in args.ablation or []:
        name, _, d = spec.partition("=")
        if not d:
            raise ConfigError(f"--ablation takes NAME=DIR, got {spec!r}")
        extra[name] = Calibration.load(d)
        extra[name].check_model(fingerprint_of(model, tok))
    ratios = args.ratios or cal.ratios
    for r in ratios:
        if float(r) not in cal.ratios:
            raise ConfigError(f"ratio {r:g} not in calibration ({cal.ratios})")
    ablations = args.preset == "full" if args.ablations is None else args.ablations
    ms = methods_for(cal, ratios, ablations, extra)
    samples = list(tasks.build(tok, args.preset, tuple(args.tasks) if args.tasks else None, seed=args.seed))
    result = harness.run(model, tok, ms, samples)
    meta = {
        "model": args.model,
        "calibration": str(path),
        "calibration_id": cal.id,
        "preset": args.preset,
        "seconds": result["seconds"],
        "machine": machine(),
        "methods": [m.name for m in ms],
        "ablations": {k: v.id for k, v in extra.items()},
    }
    files = report.write(Path(args.out), result, meta)
    print(report.markdown(result["summary"], meta))
    print("wrote " + ", ".join(str(p) for p in files.values()))
    return 0
