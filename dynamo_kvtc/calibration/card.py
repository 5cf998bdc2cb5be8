"""A calibration's card read from ``calibration.json`` alone, without torch: what ``dynamo-kvtc inspect DIR`` prints.

It checks what can be checked without loading the tensors (format name and version, the tensor file's SHA-256) and
reports the same summary as :meth:`Calibration.summary <dynamo_kvtc.calibration.artifact.Calibration.summary>`. The
calibration id (a hash over the tensors) is what the metadata says; :meth:`Calibration.load` recomputes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..errors import CalibrationError
from .verdict import summary as verdict_summary

# the artifact's names (this torch-free module owns them; calibration/artifact.py imports them)
FORMAT_NAME = "dynamo-kvtc-calibration"
FORMAT_VERSION = 1
META_FILE = "calibration.json"
TENSOR_FILE = "tensors.safetensors"
# bits per coordinate of each quantizer and the per-group metadata (codec/quant.py, which imports torch)
BITS = {"none": 0, "int2": 2, "int4": 4, "fp8": 8}
META_BITS = 32


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _plan_rank_bits(plan: dict[str, Any]) -> tuple[int, int]:
    """(retained rank, bits per token) of a plan record ``{"runs": [[start, size, kind, count], ...]}``."""
    rank, bits = 0, 0
    for start, size, kind, count in plan["runs"]:
        start, size, count = int(start), int(size), int(count)
        rank = max(rank, start + size * count)
        bits += count * (0 if kind == "none" else BITS[kind] * size + META_BITS)
    return rank, bits


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The checked metadata of a calibration directory (raises CalibrationError naming the problem)."""
    path = Path(path)
    meta_path, tensor_path = path / META_FILE, path / TENSOR_FILE
    if not path.is_dir():
        raise CalibrationError(f"calibration directory {path} does not exist")
    if not meta_path.is_file() or not tensor_path.is_file():
        raise CalibrationError(
            f"{path} is not a finished calibration (needs {META_FILE} and {TENSOR_FILE}; an interrupted run "
            "leaves neither in place)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise CalibrationError(f"{meta_path}: unreadable metadata: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CalibrationError(f"{meta_path} is not a {FORMAT_NAME} file")
    if meta.get("version") != FORMAT_VERSION:
        raise CalibrationError(f"{path}: calibration format version {meta.get('version')} not supported")
    if sha256(tensor_path) != meta.get("tensors_sha256"):
        raise CalibrationError(f"{tensor_path}: checksum mismatch (file corrupted or replaced)")
    return meta


def card(path: str | os.PathLike) -> dict[str, Any]:
    """Summary (id, model, features, layer groups, ratios, per-ratio rank and bits, per-layer token sets where the
    calibration has them), provenance without stats, and the accuracy verdict (``check``) where check.json holds
    one."""
    meta = read_meta(path)
    try:
        fp, groups = meta["fingerprint"], meta["groups"]
        ratios = sorted(float(p["ratio"]) for p in groups[0]["k_plans"])
        out: dict[str, Any] = {
            "id": meta["id"],
            "model": fp.get("model_name") or fp["architecture"],
            "features_per_token": int(fp["num_layers"]) * int(fp["num_kv_heads"]) * int(fp["head_dim"]),
            "layer_groups": len(groups),
            "ratios": ratios,
            "rope_removed": bool(meta["rope_removed"]),
            "tp": f"{fp['tp_rank']}/{fp['tp_size']}",
        }
        if "layer_order" in meta:  # per-layer token sets: which layers each group holds, and how many last tokens
            order = meta["layer_order"]
            out["token_sets"] = [
                {"layers": order[g["layers"][0] : g["layers"][1]], "tokens": g.get("tokens", 0) or "all"}
                for g in groups
            ]
        for r in ratios:
            plan: dict[str, Any] = {}
            for kind in ("k", "v"):
                per_group = [
                    _plan_rank_bits(next(p for p in g[f"{kind}_plans"] if float(p["ratio"]) == r)) for g in groups
                ]
                plan[kind] = {"rank": sum(x[0] for x in per_group), "bits_per_token": sum(x[1] for x in per_group)}
            out[f"plan_{r:g}x"] = plan
    except (KeyError, TypeError, ValueError, StopIteration) as e:
        raise CalibrationError(f"{path}: malformed calibration metadata: {e!r}") from e
    provenance = meta.get("provenance") or {}
    out["provenance"] = {k: v for k, v in provenance.items() if k != "stats"}
    verdict = verdict_summary(path, out["id"])  # check.json: the verdict of `dynamo-kvtc check --write`, if any
    if verdict is not None:
        out["check"] = verdict
    return out
