"""Inputs of the codec and tier benchmarks: a real calibration with captured (or saved) KV, or a synthetic shape."""

from __future__ import annotations

from typing import Any

import torch

from ..calibration.artifact import Calibration
from ..calibration.catalog import find_calibration
from ..errors import ConfigError


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def real_inputs(args) -> tuple[Calibration, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict[str, Any]]:
    path = args.calibration or find_calibration(args.model)
    if path is None:
        raise ConfigError(
            f"no calibration for {args.model}: pass --calibration DIR (make one with `dynamo-kvtc calibrate`)"
        )
    cal = Calibration.load(path)
    if args.kv:
        from safetensors.torch import load_file

        t = load_file(args.kv)
        spans = [(t["keys"], t["values"], t["positions"])]
        src = {"kv": str(args.kv)}
    else:
        from ..calibration.data import heldout_texts
        from ..calibration.models import capture_kv, load_model

        model, tok = load_model(args.model)
        ids = tok("\n\n".join(heldout_texts()), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        spans = [capture_kv(model, ids[: args.tokens])]
        src = {"model": args.model, "text": "held-out Paul Graham essays", "tokens": int(spans[0][2].numel())}
    return cal, spans, {"calibration": str(path), "calibration_id": cal.id, **src}


def synthetic_inputs(args):
    from ..calibration.synthetic import synthetic_calibration, synthetic_kv
    from .shapes import SHAPES

    if args.synthetic not in SHAPES:
        raise ConfigError(f"unknown synthetic shape {args.synthetic!r}; choose one of {sorted(SHAPES)}")
    s = SHAPES[args.synthetic]
    cal = synthetic_calibration(
        s.layers,
        s.kv_heads,
        s.head_dim,
        s.theta,
        device=args.device,
        name=args.synthetic,
        ratios=args.ratios or (8, 16, 32, 64),
        rotary=s.rotary(),
    )
    spans = [synthetic_kv(cal, args.tokens, start=0, device=args.device, seed=1 + b) for b in range(args.batch)]
    return (
        cal,
        spans,
        {
            "synthetic": args.synthetic,
            "tokens": args.tokens,
            "batch": args.batch,
            "note": "synthetic calibration and KV: throughput only, errors are not meaningful",
        },
    )


def load_inputs(args) -> tuple[Calibration, list, dict[str, Any]]:
    """(calibration, [(keys, values, positions)], source description) for ``--synthetic`` or a real model."""
    dev = args.device
    if torch.device(dev).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but CUDA is not available")
    return synthetic_inputs(args) if args.synthetic else real_inputs(args)
