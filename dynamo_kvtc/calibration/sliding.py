"""Sliding-window hybrids (Gemma 3, gpt-oss, Llama-4-style): what they hold, and mixed precision for their
full-attention layers.

A sliding-window layer keeps only its last ``window`` tokens (vLLM's hybrid KV cache manager frees the rest), so a
calibration with per-layer token sets (:func:`~dynamo_kvtc.calibration.config.group_plan`) codes a sliding group's
last ``tokens`` tokens only, and a full-attention group every token. A fair raw tier stores the same:
:func:`window_raw_bytes` is the size of a span in such a tier, the denominator of every ratio stated for these models.

At 2-8K tokens the few full-attention layers hold most of the KV and carry all retrieval of old tokens; their V
needs several bits per value, more than a joint PCA basis at 16x gives it. :func:`mixed_precision` builds a
calibration whose full-attention groups code V (and optionally K) *directly*: an identity basis (the features
themselves, mean removed) with a uniform plan of one quantizer (``int4``/``fp8``/``int2`` in groups of
``group_size`` features, one fp16 shift and scale per group and token: KIVI-style per-token quantization). The
sliding groups keep their PCA plans. Blobs are ordinary KVTC blobs (the format does not change); the plans are keyed
by the ratio they reach at ``span_tokens`` against :func:`window_raw_bytes`, so the number an operator sets is the
number they get at that span length (shorter spans come out a little higher, longer ones a little lower).
"""

from __future__ import annotations

from typing import Any

import torch

from ..codec.model import BasisGroup, ModelFingerprint
from ..codec.plan import GROUP_SIZES, Plan
from ..codec.quant import BITS, group_cost_bits
from ..errors import CalibrationError
from .artifact import Calibration

DIRECT_KINDS = ("fp8", "int4", "int2")


def held_tokens(window: int, tokens: int) -> int:
    """Tokens of a ``tokens``-token span that a layer keeping the last ``window`` (0: all) holds."""
    return min(window, tokens) if window else tokens


def window_raw_bytes(fp: ModelFingerprint, tokens: int, itemsize: int = 2) -> int:
    """Bytes of a ``tokens``-token span in a raw tier that stores only what each layer holds (a sliding layer's
    window, a full layer's every token), K and V at ``itemsize`` bytes per value."""
    windows = fp.windows or (0,) * fp.num_layers
    per_token = 2 * fp.num_kv_heads * fp.head_dim * itemsize
    return sum(held_tokens(w, tokens) for w in windows) * per_token


def coded_bits(cal: Calibration, ratio: float, tokens: int) -> int:
    """Bits of a ``tokens``-token span under the plans at ``ratio``, each group's tokens counted as held (plan bits:
    before entropy coding, without the raw sinks and window the codec adds)."""
    total = 0
    for g in cal.groups:
        per = g.k_plans[float(ratio)].bits_per_token + g.v_plans[float(ratio)].bits_per_token
        total += per * held_tokens(g.tokens, tokens)
    return total


def plan_ratio(cal: Calibration, ratio: float, tokens: int) -> float:
    """The ratio the plans at ``ratio`` reach on a ``tokens``-token span against :func:`window_raw_bytes`."""
    return 8 * window_raw_bytes(cal.fingerprint, tokens) / max(coded_bits(cal, ratio, tokens), 1)


def direct_plan(features: int, kind: str, group_size: int, ratio: float) -> Plan:
    """Every feature coded with one quantizer, in aligned groups of ``group_size``."""
    if kind not in DIRECT_KINDS:
        raise CalibrationError(f"direct coding kind must be one of {DIRECT_KINDS}, got {kind!r}")
    if group_size not in GROUP_SIZES or features % group_size:
        raise CalibrationError(f"group size {group_size} must be one of {GROUP_SIZES} and divide {features} features")
    groups = tuple((s, group_size, kind) for s in range(0, features, group_size))
    bits = len(groups) * group_cost_bits(kind, group_size)
    return Plan(features, float(ratio), bits, groups)


def _spec(value: Any, name: str) -> float | str | None:
    """A full-attention coding spec: None (the ratio's own PCA plan), a ratio of the calibration, or a direct kind."""
    if value is None or value == "pca":
        return None
    if isinstance(value, str) and value in DIRECT_KINDS:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CalibrationError(f"{name} must be 'pca', a ratio or one of {DIRECT_KINDS}, got {value!r}") from None


def mixed_precision(
    cal: Calibration,
    ratios: list[float] | tuple[float, ...] | None = None,
    *,
    full_k: Any = None,
    full_v: Any = "int4",
    group_size: int = 64,
    span_tokens: int = 4096,
) -> Calibration:
    """A calibration whose full-attention groups code K and V as ``full_k``/``full_v`` say, its sliding groups as
    the source's plans at each of ``ratios`` (default: all). A spec is ``"pca"``/None (that ratio's PCA plan), a
    ratio of ``cal`` (its PCA plan at that ratio: more bits for the few full layers) or a direct kind
    (``int4``/``fp8``/``int2``: identity basis, :func:`direct_plan`). Each result is keyed by :func:`plan_ratio` at
    ``span_tokens`` (rounded to 0.1). Only calibrations with per-layer token sets have full-attention groups to
    treat apart (CalibrationError otherwise)."""
    if not any(g.tokens for g in cal.groups):
        raise CalibrationError("mixed precision needs a calibration with sliding-window groups (per-layer token sets)")
    ks, vs = _spec(full_k, "full_k"), _spec(full_v, "full_v")
    src = sorted(float(r) for r in (ratios or cal.ratios))
    missing = [r for r in src + [s for s in (ks, vs) if isinstance(s, float)] if r not in cal.ratios]
    if missing:
        raise CalibrationError(f"no plans for ratios {sorted(set(missing))}; available: {cal.ratios}")
    hd = cal.fingerprint.num_kv_heads * cal.fingerprint.head_dim
    plans: dict[tuple[int, str], dict[float, Plan]] = {}
    keys: dict[float, float] = {}
    for r in src:
        chosen: dict[tuple[int, str], Plan] = {}
        for i, g in enumerate(cal.groups):
            p = g.num_layers * hd
            for kind, spec in (("k", ks), ("v", vs)):
                own = getattr(g, f"{kind}_plans")
                if g.tokens or spec is None:
                    chosen[(i, kind)] = own[r]
                elif isinstance(spec, float):
                    chosen[(i, kind)] = own[spec]
                else:
                    chosen[(i, kind)] = direct_plan(p, spec, group_size, r)
        bits = sum(pl.bits_per_token * held_tokens(cal.groups[i].tokens, span_tokens) for (i, _), pl in chosen.items())
        key = round(8 * window_raw_bytes(cal.fingerprint, span_tokens) / max(bits, 1), 1)
        if key in plans.get((0, "k"), {}):
            raise CalibrationError(f"ratios {keys[key]:g} and {r:g} both reach {key:g}x at {span_tokens} tokens")
        keys[key] = r
        for (i, kind), pl in chosen.items():
            plans.setdefault((i, kind), {})[key] = Plan(pl.features, key, pl.bits_per_token, pl.groups)
    groups = []
    for i, g in enumerate(cal.groups):
        parts = {}
        for kind, spec in (("k", ks), ("v", vs)):
            mean, basis = getattr(g, f"{kind}_mean"), getattr(g, f"{kind}_basis")
            if not g.tokens and isinstance(spec, str):
                basis = torch.eye(mean.numel(), dtype=basis.dtype)
            parts[kind] = (mean, basis)
        groups.append(
            BasisGroup(g.layers, *parts["k"], *parts["v"], plans[(i, "k")], plans[(i, "v")], g.tokens)  # type: ignore[misc]
        )
    prov = {
        **cal.provenance,
        "mixed_precision": {
            "source": cal.id,
            "full_k": "pca" if ks is None else ks,
            "full_v": "pca" if vs is None else vs,
            "group_size": group_size,
            "span_tokens": span_tokens,
            "plans": {f"{k:g}": v for k, v in keys.items()},  # key -> the source ratio of the sliding groups
        },
    }
    return Calibration(cal.fingerprint, groups, cal.rope_removed, prov, layer_order=cal.layer_order)


def bits_per_value(kind: str, group_size: int) -> float:
    """Stored bits per value of a direct kind, shift and scale included (int4 in 64s: 4.5)."""
    return BITS[kind] + 32 / group_size


def full_attention_from_args(
    cal: Calibration, full_k: Any, full_v: Any, group_size: int = 64, span_tokens: int = 0
) -> Calibration:
    """``dynamo-kvtc calibrate --full-attention-k/-v``: ``cal`` unchanged when both are unset or ``pca``, else
    :func:`mixed_precision` of every ratio (``span_tokens`` 0: 4096)."""
    if _spec(full_k, "full_k") is None and _spec(full_v, "full_v") is None:
        return cal
    return mixed_precision(
        cal, full_k=full_k, full_v=full_v or "pca", group_size=group_size, span_tokens=span_tokens or 4096
    )
