"""The checks every codec runs before it trusts its input: K/V tensors and positions to encode, and blobs to decode
(header against the calibration, the section sizes they imply, readable entropy tags).

``codec`` below is a codec of one calibration: it has ``cal``, ``fp``, ``device``, ``tables`` (per basis group:
``layers``, ``ids``, ``k_plans``, ``v_plans``), ``order``, ``token_sets`` and ``token_ranges(tokens)`` — the reference
codec and the fused one (through its reference) alike.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CorruptBlobError, DecodeError, InputError, WrongCalibrationError
from .container import group_segments, parse_blob
from .entropy.sections import check_readable
from .model import DTYPES, ModelFingerprint
from .sinks import sink_bytes


def check_inputs(
    fp: ModelFingerprint, keys: Any, values: Any, positions: Any, finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(
                f"{name} must be [num_layers, num_tokens, num_kv_heads, head_dim], got shape {tuple(t.shape)}"
            )
        if t.dtype not in DTYPES.values():
            raise InputError(f"{name} dtype {t.dtype} not supported (bfloat16, float16, float32)")
    if keys.shape != values.shape:
        raise InputError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
    if keys.dtype != values.dtype:
        raise InputError(f"keys ({keys.dtype}) and values ({values.dtype}) differ in dtype")
    L, T, H, D = keys.shape
    expect = (fp.num_layers, fp.num_kv_heads, fp.head_dim)
    if (L, H, D) != expect:
        raise InputError(
            f"KV shape (layers={L}, kv_heads={H}, head_dim={D}) does not match the calibration's "
            f"(layers={expect[0]}, kv_heads={expect[1]}, head_dim={expect[2]}) for "
            f"{fp.model_name or fp.architecture} (tp rank {fp.tp_rank}/{fp.tp_size})"
        )
    if T == 0:
        raise InputError("cannot encode zero tokens")
    if not isinstance(positions, torch.Tensor):
        try:
            positions = torch.as_tensor(positions)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(f"positions must be a sequence of integers: {e}") from None
    if positions.dim() != 1 or positions.numel() != T:
        raise InputError(
            f"positions must be 1-D with one entry per token ({T}), got shape {tuple(positions.shape)}"
        )
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.is_complex():
        raise InputError(f"positions must be integers, got {positions.dtype}")
    positions = positions.to("cpu", torch.int64)
    if int(positions[0]) < 0:
        raise InputError(f"positions must be >= 0, got {int(positions[0])}")
    if T > 1 and not bool((positions[1:] > positions[:-1]).all()):
        raise InputError("positions must be strictly increasing (one absolute position per token)")
    if int(positions[-1]) >= 1 << 40:
        raise InputError("positions exceed 2^40")
    for name, t in (("keys", keys), ("values", values)) if finite else ():
        if not bool(torch.isfinite(t).all()):
            raise InputError(f"{name} contain NaN or Inf; refusing to store them")
    return keys, values, positions


def _check_header(codec: Any, h: dict[str, Any]) -> None:
    fp = codec.fp
    if h["cal"] != codec.cal.id:
        raise WrongCalibrationError(
            f"blob was encoded with calibration {h['cal'][:12]}, this codec holds {codec.cal.id[:12]} "
            f"({fp.model_name or fp.architecture})"
        )
    if h.get("kv") != getattr(codec, "kv_source", None):
        raise WrongCalibrationError(
            f"blob holds values of a {h.get('kv') or h['dtype']} KV cache, "
            f"this engine's cache is {getattr(codec, 'kv_source', None) or 'a 16/32-bit one'}"
        )
    if (h["layers"], h["heads"], h["head_dim"]) != (fp.num_layers, fp.num_kv_heads, fp.head_dim):
        raise CorruptBlobError("blob shape fields disagree with its calibration")
    if h["groups"] != [list(t.layers) for t in codec.tables]:
        raise CorruptBlobError("blob layer groups disagree with its calibration")
    if h.get("order") != (None if codec.order is None else list(codec.order)):
        raise CorruptBlobError("blob layer order disagrees with its calibration")
    if h.get("token_sets") != (codec.token_ranges(h["tokens"]) if codec.token_sets else None):
        raise CorruptBlobError("blob token sets disagree with its calibration")
    if h["mode"] == "kvtc":
        if h["ratio"] is None or float(h["ratio"]) not in codec.tables[0].k_plans:
            raise CorruptBlobError(f"blob names ratio {h['ratio']!r}, which its calibration has no plan for")
    elif h["sinks"] or h["window"] != h["tokens"]:
        raise CorruptBlobError("raw-mode blob must hold every token in its window")

def _expected_sizes(codec: Any, h: dict[str, Any]) -> list[tuple[str, int]]:
    H, D = h["heads"], h["head_dim"]
    item = DTYPES[h["dtype"]].itemsize
    out = []
    for gi, tab in enumerate(codec.tables):
        _, ns, nc, nw = group_segments(h, gi)
        Lg = tab.layers[1] - tab.layers[0]
        out.append((f"{gi}.sinks", sink_bytes(Lg, ns, H, D)))
        for kind, plans in (("k", tab.k_plans), ("v", tab.v_plans)):
            out.append((f"{gi}.{kind}", plans[float(h["ratio"])].nbytes(nc) if nc else 0))
        out.append((f"{gi}.window", 2 * Lg * nw * H * D * item))
    return out

def check_blob(codec: Any, blob: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list]:
    """Parse ``blob`` and check it fits this codec: its calibration, shapes, layer groups, plan, the section sizes
    they imply and readable entropy tags. Returns the header dict and section records (section CRCs are not
    checked here); raises :class:`~dynamo_kvtc.errors.DecodeError` otherwise. Both decode paths start here."""
    try:
        h, recs = parse_blob(blob)
    except DecodeError:
        raise
    except Exception as e:  # never let a malformed blob escape as anything but DecodeError
        raise CorruptBlobError(f"malformed blob: {type(e).__name__}: {e}") from None
    _check_header(codec, h)
    expected = _expected_sizes(codec, h)
    if [(r.name, r.raw_len) for r in recs] != expected:
        raise CorruptBlobError("blob section table does not match the sizes its header and calibration imply")
    for r in recs:
        if r.name.endswith(("sinks", "window")) and r.tag != "store":
            raise CorruptBlobError(f"section {r.name} must be stored, has tag {r.tag!r}")
        check_readable(r.tag, codec.device)
    return h, recs
