"""What a blob holds and what it saves: sizes, the ratios of the paper's accounting and others, the plan summary."""

from __future__ import annotations

from typing import Any

from .container import group_segments
from .model import DTYPES


def blob_stats(codec: Any, blob: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Sizes, ratios (paper accounting and others), plan summary and the last encode/decode timings."""
    h, recs = codec.check_blob(blob)
    T, H, D, L = h["tokens"], h["heads"], h["head_dim"], h["layers"]
    ns, nw = h["sinks"], h["window"]
    nc = T - ns - nw
    per_tok16 = 2 * L * H * D * 2  # K+V bytes per token at 16 bits
    # 16-bit bytes of what the layers hold (a layer with a token set holds only its tokens), in total, of the
    # compressed tokens (sinks and coded) and of the coded ones: the same as per_tok16 * tokens without sets
    raw16 = {"all": 0, "compressed": 0, "coded": 0}
    for gi, tab in enumerate(codec.tables):
        _, gs, gc, gw = group_segments(h, gi)
        per_layer_tok = 2 * len(tab.ids) * H * D * 2
        raw16["all"] += per_layer_tok * (gs + gc + gw)
        raw16["compressed"] += per_layer_tok * (gs + gc)
        raw16["coded"] += per_layer_tok * gc
    stored = {"sinks": 0, "k": 0, "v": 0, "window": 0}
    for r in recs:
        stored[r.name.split(".", 1)[1]] += r.stored_len
    sections_total = sum(stored.values())
    compressed_stored = stored["sinks"] + stored["k"] + stored["v"]
    out: dict[str, Any] = {
        "mode": h["mode"],
        "ratio_target": h["ratio"],
        "tokens": T,
        "sink_tokens": ns,
        "coded_tokens": nc,
        "window_tokens": nw,
        "raw_bytes_16bit": per_tok16 * T,
        "held_bytes_16bit": raw16["all"],  # what the layers hold at 16 bits (= raw_bytes_16bit without sets)
        "held_compressed_bytes_16bit": raw16["compressed"],
        "token_sets": h.get("token_sets"),
        "input_bytes": 2 * L * H * D * T * DTYPES[h["dtype"]].itemsize,
        "blob_bytes": len(memoryview(blob)),
        "header_bytes": len(memoryview(blob)) - sections_total,
        "stored_bytes": stored,
        "ratio": (raw16["compressed"] / compressed_stored) if compressed_stored else None,
        "ratio_with_window": raw16["all"] / sections_total if sections_total else None,
        "ratio_blob": per_tok16 * T / len(memoryview(blob)),
        "codec_tag": sorted({r.tag for r in recs if r.name.endswith((".k", ".v"))}),
    }
    if h["mode"] == "kvtc":
        ratio = float(h["ratio"])
        out["plan"] = {
            kind: {
                "rank": sum(getattr(t, f"{kind}_plans")[ratio].rank for t in codec.tables),
                "bits_per_token": sum(getattr(t, f"{kind}_plans")[ratio].bits_per_token for t in codec.tables),
                "budget_bits": sum(getattr(t, f"{kind}_plans")[ratio].budget_bits for t in codec.tables),
                "coordinates_by_type": _sum_dicts(
                    getattr(t, f"{kind}_plans")[ratio].kind_counts() for t in codec.tables
                ),
            }
            for kind in ("k", "v")
        }
        out["ratio_before_entropy"] = (
            raw16["coded"] / sum(r.raw_len for r in recs if r.name.endswith((".k", ".v"))) if nc else None
        )
    out["timings"] = dict(codec.last_timings)
    return out


def _sum_dicts(ds) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
