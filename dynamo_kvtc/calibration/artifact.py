"""The calibration artifact: a directory with ``tensors.safetensors`` and ``calibration.json``.

``tensors.safetensors`` holds, per layer group ``g``: ``g{g}.k_mean``/``g{g}.v_mean`` (float32 [p_g]) and
``g{g}.k_basis``/``g{g}.v_basis`` (float16 [p_g, r], trimmed to the widest shipped plan). ``calibration.json`` holds
the format name and version, the model fingerprint (including each layer's rotary config), the layer groups, one DP
plan per ratio for K and V, whether RoPE was removed, provenance (data, tokens, seed, time, machine), the SHA-256 of
the tensor file, and the calibration id (a hash of tensors and metadata).

``save`` writes into a temporary sibling directory and renames it into place, metadata last, so a partial artifact
is never mistaken for a finished one. ``load`` checks everything and raises
:class:`~dynamo_kvtc.errors.CalibrationError` naming the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..codec.model import BasisGroup, ModelFingerprint
from ..codec.plan import Plan
from ..errors import CalibrationError
from .card import FORMAT_NAME, FORMAT_VERSION, META_FILE, TENSOR_FILE, read_meta
from .card import sha256 as _sha256


@dataclass
class Calibration:
    """Per-model (per TP shard) KVTC calibration: bases, means and DP plans. See the module docstring."""

    fingerprint: ModelFingerprint
    groups: list[BasisGroup]
    rope_removed: bool = True
    provenance: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    layer_order: tuple[int, ...] | None = None  # the groups' layer ranges are over this permutation (None: identity)

    def __post_init__(self) -> None:
        self._validate()
        if not self.id:
            self.id = self._compute_id()

    # ------------------------------------------------------------------ properties
    @property
    def ratios(self) -> list[float]:
        return sorted(self.groups[0].k_plans)

    @property
    def layer_groups(self) -> int:
        return len(self.groups)

    def plan(self, ratio: float, kind: str = "k", group: int = 0) -> Plan:
        plans = self.groups[group].k_plans if kind == "k" else self.groups[group].v_plans
        if float(ratio) not in plans:
            raise CalibrationError(f"no plan for ratio {ratio}; available: {self.ratios}")
        return plans[float(ratio)]

    def summary(self) -> dict[str, Any]:
        fp = self.fingerprint
        out: dict[str, Any] = {
            "id": self.id,
            "model": fp.model_name or fp.architecture,
            "features_per_token": fp.features,
            "layer_groups": self.layer_groups,
            "ratios": self.ratios,
            "rope_removed": self.rope_removed,
            "tp": f"{fp.tp_rank}/{fp.tp_size}",
        }
        for r in self.ratios:
            out[f"plan_{r:g}x"] = {
                kind: {
                    "rank": sum(getattr(g, f"{kind}_plans")[r].rank for g in self.groups),
                    "bits_per_token": sum(getattr(g, f"{kind}_plans")[r].bits_per_token for g in self.groups),
                }
                for kind in ("k", "v")
            }
        return out

    def subset(self, ratios: list[float]) -> Calibration:
        """A calibration with only these ratios' plans and the bases trimmed to what they code (for shipping)."""
        keep = sorted(float(r) for r in ratios)
        missing = [r for r in keep if r not in self.ratios]
        if missing or not keep:
            raise CalibrationError(f"cannot keep ratios {missing or keep}; available: {self.ratios}")
        groups = []
        for g in self.groups:
            kp = {r: g.k_plans[r] for r in keep}
            vp = {r: g.v_plans[r] for r in keep}
            kw = max(p.rank for p in kp.values())
            vw = max(p.rank for p in vp.values())
            groups.append(
                BasisGroup(
                    g.layers, g.k_mean, g.k_basis[:, :kw].clone(), g.v_mean, g.v_basis[:, :vw].clone(), kp, vp, g.tokens
                )
            )
        prov = {**self.provenance, "subset_of": {"id": self.id, "ratios": self.ratios}}
        return Calibration(self.fingerprint, groups, self.rope_removed, prov, layer_order=self.layer_order)

    @property
    def token_sets(self) -> bool:
        """Whether some group encodes only a span's last tokens, or groups range over a permuted layer order."""
        return self.layer_order is not None or any(g.tokens for g in self.groups)

    def check_model(self, fingerprint: ModelFingerprint) -> None:
        """Refuse (CalibrationMismatchError) if this calibration was made for another model or shard."""
        self.fingerprint.check_matches(fingerprint)

    # ------------------------------------------------------------------ consistency
    def _validate(self) -> None:
        fp = self.fingerprint
        if not self.groups:
            raise CalibrationError("calibration has no layer groups")
        if self.layer_order is not None:
            self.layer_order = tuple(int(x) for x in self.layer_order)
            if sorted(self.layer_order) != list(range(fp.num_layers)):
                raise CalibrationError(f"layer_order {self.layer_order} is not a permutation of {fp.num_layers} layers")
        if any(g.tokens < 0 for g in self.groups):
            raise CalibrationError("a layer group's token set must be >= 0 tokens (0: all)")
        prev = 0
        ratios = None
        hd = fp.num_kv_heads * fp.head_dim
        for i, g in enumerate(self.groups):
            if g.layers[0] != prev or g.layers[1] <= g.layers[0]:
                raise CalibrationError(f"layer group {i} {g.layers} does not continue from layer {prev}")
            prev = g.layers[1]
            p = g.num_layers * hd
            for kind in ("k", "v"):
                mean, basis = getattr(g, f"{kind}_mean"), getattr(g, f"{kind}_basis")
                plans: dict[float, Plan] = getattr(g, f"{kind}_plans")
                if tuple(mean.shape) != (p,) or basis.dim() != 2 or basis.shape[0] != p:
                    raise CalibrationError(
                        f"group {i} {kind}: mean {tuple(mean.shape)} / basis {tuple(basis.shape)} do not fit p={p}"
                    )
                if not plans:
                    raise CalibrationError(f"group {i} {kind}: no DP plans")
                for r, plan in plans.items():
                    if plan.rank > basis.shape[1]:
                        raise CalibrationError(
                            f"group {i} {kind} plan {r:g}x needs {plan.rank} components, basis has {basis.shape[1]}"
                        )
                    if plan.features != p:
                        raise CalibrationError(f"group {i} {kind} plan {r:g}x is for {plan.features} features, not {p}")
                keys = sorted(plans)
                if ratios is None:
                    ratios = keys
                elif keys != ratios:
                    raise CalibrationError(f"group {i} {kind} has ratios {keys}, expected {ratios}")
        if prev != fp.num_layers:
            raise CalibrationError(f"layer groups cover {prev} layers, model has {fp.num_layers}")

    def _meta(self) -> dict[str, Any]:
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "fingerprint": self.fingerprint.to_dict(),
            "rope_removed": self.rope_removed,
            "groups": [
                {
                    "layers": list(g.layers),
                    "k_plans": [g.k_plans[r].to_dict() for r in sorted(g.k_plans)],
                    "v_plans": [g.v_plans[r].to_dict() for r in sorted(g.v_plans)],
                    **({"tokens": g.tokens} if g.tokens else {}),  # keys only where used: older ids unchanged
                }
                for g in self.groups
            ],
        }
        if self.layer_order is not None:
            meta["layer_order"] = list(self.layer_order)
        return meta

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, g in enumerate(self.groups):
            for kind in ("k", "v"):
                plans = getattr(g, f"{kind}_plans")
                width = max(p.rank for p in plans.values())
                out[f"g{i}.{kind}_mean"] = getattr(g, f"{kind}_mean").float().contiguous()
                out[f"g{i}.{kind}_basis"] = getattr(g, f"{kind}_basis")[:, :width].to(torch.float16).contiguous()
        return out

    def _compute_id(self) -> str:
        h = hashlib.sha256(json.dumps(self._meta(), sort_keys=True).encode())
        for name, t in sorted(self._tensors().items()):
            h.update(name.encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()[:32]

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> Path:
        """Write the artifact directory atomically (temporary sibling, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            save_file(self._tensors(), str(tmp / TENSOR_FILE), metadata={"format": FORMAT_NAME})
            meta = self._meta()
            meta["provenance"] = self.provenance
            meta["tensors_sha256"] = _sha256(tmp / TENSOR_FILE)
            meta["id"] = self.id
            with open(tmp / META_FILE, "w") as f:
                json.dump(meta, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            if path.exists():
                old = path.with_name(f".{path.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                path.rename(old)
                tmp.rename(path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        path = Path(path)
        meta = read_meta(path)  # the checked JSON card, tensor checksum included
        tensor_path = path / TENSOR_FILE
        try:
            tensors = load_file(str(tensor_path))
        except (SafetensorError, OSError, ValueError) as e:
            raise CalibrationError(f"{tensor_path}: unreadable tensors: {e}") from e
        try:
            fp = ModelFingerprint.from_dict(meta["fingerprint"])
            groups = []
            for i, gm in enumerate(meta["groups"]):
                kp = {p.ratio: p for p in map(Plan.from_dict, gm["k_plans"])}
                vp = {p.ratio: p for p in map(Plan.from_dict, gm["v_plans"])}
                groups.append(
                    BasisGroup(
                        (int(gm["layers"][0]), int(gm["layers"][1])),
                        tensors[f"g{i}.k_mean"],
                        tensors[f"g{i}.k_basis"],
                        tensors[f"g{i}.v_mean"],
                        tensors[f"g{i}.v_basis"],
                        kp,
                        vp,
                        int(gm.get("tokens", 0)),
                    )
                )
            order = meta.get("layer_order")
            cal = cls(
                fp,
                groups,
                bool(meta["rope_removed"]),
                dict(meta.get("provenance") or {}),
                id="",
                layer_order=None if order is None else tuple(order),
            )
        except KeyError as e:
            raise CalibrationError(f"{path}: missing field or tensor {e}") from e
        except (TypeError, ValueError) as e:
            raise CalibrationError(f"{path}: malformed calibration: {e}") from e
        if cal.id != meta.get("id"):
            raise CalibrationError(f"{path}: calibration id mismatch (metadata {meta.get('id')}, content {cal.id})")
        return cal
