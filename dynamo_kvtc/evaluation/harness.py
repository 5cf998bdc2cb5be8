"""Run methods over samples the way the paper evaluates (§4): prefill the context once, replace the KV cache by each
method's reconstruction (everything but the sinks and the recent window), then score with the reconstructed cache.

The prompt's last token is held back and fed after the replacement, so even the first answer token is computed from
the reconstructed cache. The cache is the bf16 cache an engine stores; "vanilla" scores with it unchanged.

Sliding-window layers (Gemma 3): the capture holds every layer's KV of every token; the cache built for scoring is
the model's own (``DynamicCache(config=...)``), whose sliding layers keep only their window, so a method's
reconstruction of tokens outside a layer's window is never read (kvtc with per-layer token sets does not code them).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..calibration.mla import hf_cache_layers, is_mla
from ..calibration.models import capture_kv, input_device
from .methods import Method
from .tasks import Sample, answer_score

log = logging.getLogger(__name__)


def build_cache(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, config: Any = None):
    """A transformers DynamicCache holding KV [L, T, H, D]; with the model's ``config`` its layers are the model's
    (a sliding-window layer keeps only the last ``sliding_window - 1`` tokens, as after the model's own prefill)."""
    from transformers import DynamicCache

    c = DynamicCache(config=config)
    if config is not None and is_mla(config):  # latent rows: back to transformers' (latent, k_pe) per layer
        for layer, (a, b) in enumerate(hf_cache_layers(config, k, v)):
            c.update(a.to(dtype), b.to(dtype), layer)
        return c
    for layer in range(k.shape[0]):
        c.update(k[layer].transpose(0, 1)[None].to(dtype), v[layer].transpose(0, 1)[None].to(dtype), layer)
    return c


@torch.no_grad()
def score(model: Any, inputs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Log-probs [len(inputs), vocab] of the next token after each input, reading KV (k, v) for the context."""
    dtype = next(model.parameters()).dtype
    pos = torch.arange(start, start + inputs.numel(), device=inputs.device)[None]
    cache = build_cache(k, v, dtype, model.config)
    out = model(input_ids=inputs[None], past_key_values=cache, position_ids=pos, use_cache=True)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


@torch.no_grad()
def generate(
    model: Any, last: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, max_new: int, eos: int | None
) -> list[int]:
    """Greedy tokens after ``last``, reading KV (k, v) for the context."""
    dtype = next(model.parameters()).dtype
    cache = build_cache(k, v, dtype, model.config)
    ids, out, pos = last.reshape(1, 1), [], start
    for _ in range(max_new):
        at = torch.tensor([[pos]], device=ids.device)
        o = model(input_ids=ids, past_key_values=cache, position_ids=at, use_cache=True)
        nxt = int(o.logits[0, -1].argmax())
        if eos is not None and nxt == eos:
            break
        out.append(nxt)
        ids = torch.tensor([[nxt]], device=last.device)
        pos += 1
    return out


def agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two greedy token sequences (how long a method's reply stays vanilla's)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _mean_se(xs: Sequence[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    m = statistics.fmean(xs)
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return m, se


def run(
    model: Any, tokenizer: Any, methods: Sequence[Method], samples: Iterable[Sample], progress: bool = True
) -> dict[str, Any]:
    """Per-sample records for every method, and the aggregate table."""
    from tqdm.auto import tqdm

    records: list[dict[str, Any]] = []
    eos = tokenizer.eos_token_id
    samples = list(samples)
    t0 = time.time()
    dev = input_device(model)  # samples are built on the host; the model may sit on a GPU
    bar = tqdm(total=len(samples) * len(methods), desc="eval", disable=not progress, dynamic_ncols=True)
    for si, s in enumerate(samples):
        prompt = s.prompt.to(dev)
        pre, last = prompt[:-1], prompt[-1:]
        k, v, pos = capture_kv(model, pre)
        T = pre.numel()
        ref_lp = None
        for m in methods:
            bar.set_postfix_str(f"{s.task} {s.meta.get('length', '')} {m.name}")
            rec = m.reconstruct(k, v, pos)
            if m.lossless and not (torch.equal(rec.keys, k) and torch.equal(rec.values, v)):
                raise RuntimeError(f"{m.name} claims to be lossless but changed the cache")
            r: dict[str, Any] = {
                "sample": si,
                "task": s.task,
                "method": m.name,
                "family": m.family,
                **s.meta,
                "ratio": rec.ratio,
                "ratio_with_window": rec.ratio_with_window,
                "tokens": T,
            }
            ref = next((x for x in reversed(records) if x["sample"] == si and x["method"] == "vanilla"), None)
            if m.lossless and ref is not None and m.name != "vanilla":  # identical cache, identical scores
                keys = ("nll", "accuracy", "kl", "top1_agreement", "output", "output_ids", "agree_len", "exact")
                r.update({key: ref[key] for key in keys if key in ref})
            elif s.target is not None:
                tgt = s.target.to(dev)
                inputs = torch.cat((last, tgt[:-1]))
                lp = score(model, inputs, rec.keys, rec.values, T)
                nll = float(-lp.gather(1, tgt[:, None]).mean())
                r["nll"] = nll
                r["accuracy"] = float((lp.argmax(-1) == tgt).float().mean())
                if ref_lp is None:
                    ref_lp = lp
                r["kl"] = float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean())
                r["top1_agreement"] = float((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean())
            else:
                out = generate(model, last, rec.keys, rec.values, T, s.max_new, eos)
                text = tokenizer.decode(out)
                r["output"] = text
                if s.task == "gen":  # fidelity: against vanilla's greedy tokens (vanilla runs first)
                    base = out if ref is None else ref["output_ids"]
                    r["output_ids"] = out
                    r["agree_len"] = float(agreement(out, base))
                    r["exact"] = float(out == base)
                    r["accuracy"] = r["exact"]
                else:
                    r["accuracy"] = answer_score(s.task, s.answers, text)
            records.append(r)
            bar.update(1)
    bar.close()
    return {"records": records, "seconds": time.time() - t0, "summary": summarise(records)}


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per method: ratios and each task's metric as mean and standard error over samples."""
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    order: list[str] = []
    for r in records:
        if r["method"] not in by_method:
            order.append(r["method"])
        by_method[r["method"]].append(r)
    vanilla = {r["sample"]: r for r in by_method.get("vanilla", [])}
    rows = []
    for name in order:
        rs = by_method[name]
        row: dict[str, Any] = {"method": name, "family": rs[0]["family"]}
        row["ratio"], _ = _mean_se([r["ratio"] for r in rs if r["ratio"]])
        lo = [r["ratio"] for r in rs if r["ratio"]]
        row["ratio_min"], row["ratio_max"] = (min(lo), max(lo)) if lo else (None, None)
        row["ratio_with_window"], _ = _mean_se([r["ratio_with_window"] for r in rs])
        for task in sorted({r["task"] for r in rs}):
            tr = [r for r in rs if r["task"] == task]
            metric = {"ppl": "kl", "copy": "accuracy", "gen": "agree_len"}.get(task, "accuracy")
            row[f"{task}_n"] = len(tr)
            row[f"{task}"], row[f"{task}_se"] = _mean_se([r[metric] for r in tr])
            if task == "ppl":
                d = [
                    100 * (r["nll"] - vanilla[r["sample"]]["nll"]) / vanilla[r["sample"]]["nll"]
                    for r in tr
                    if r["sample"] in vanilla
                ]
                row["ppl_dnll_pct"], row["ppl_dnll_pct_se"] = _mean_se(d)
                row["ppl_top1"], row["ppl_top1_se"] = _mean_se([r["top1_agreement"] for r in tr])
            if task == "gen":
                row["gen_exact"], row["gen_exact_se"] = _mean_se([r["exact"] for r in tr])
        rows.append(row)
    return rows
