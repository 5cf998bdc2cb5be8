"""The fused codec's device state, shared by its encode runs (:mod:`.encode`) and restore jobs (:mod:`.restore`):
per-group device tables, the stage backend with its Triton-to-torch switch, the batched entropy coder, the projection
GEMMs, RoPE tables and reusable pinned buffers. Importing it imports neither Triton nor anything CUDA-specific."""

from __future__ import annotations

import logging
import os
import threading

import torch

from .batch_entropy import BatchEntropy
from .ops import TorchOps, device_tensor, get_ops, rope_tables
from .projection import make_projector

log = logging.getLogger(__name__)


class GroupTables:
    """Per layer group device tables of the fused path: fp32 means, the calibration's fp16 bases, plan buckets."""

    def __init__(self, g, device: torch.device) -> None:
        self.layers = g.layers
        self.k_mean = g.k_mean.to(device, torch.float32).contiguous()
        self.v_mean = g.v_mean.to(device, torch.float32).contiguous()
        self.k_basis = g.k_basis.to(device, torch.float16).contiguous()  # exactly the calibration's fp16 basis
        self.v_basis = g.v_basis.to(device, torch.float16).contiguous()
        self.k_plans, self.v_plans = g.k_plans, g.v_plans
        self._starts: dict[tuple, torch.Tensor] = {}

    def starts(self, kind: str, ratio: float, bucket_index: int, bucket) -> torch.Tensor:
        key = (kind, ratio, bucket_index)
        t = self._starts.get(key)
        if t is None:
            t = self._starts[key] = device_tensor(bucket.starts, torch.int64, self.k_mean.device)  # no host block
        return t


class FusedDevice:
    """The device state of the fused codec for one reference codec (``codec``: its config, fingerprint, calibration,
    blob checks and headers): per-group device tables, the stage backend (Triton, falling back to torch for good on
    a kernel failure unless ``strict``), the batched entropy coder, the projection GEMMs and reusable pinned buffers.
    Encode runs and restore jobs take it as their argument; it runs no stage order of its own."""

    def __init__(self, codec, *, ops: str = "auto", strict: bool = False) -> None:
        self.codec = codec
        self.device = codec.device
        self.cfg = codec.config
        self.fp = codec.fp
        if ops == "auto" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            ops = "torch"  # Triton kernels run on CUDA, or on the CPU only under its interpreter
        self.ops = get_ops(ops)
        self.torch_ops = TorchOps()
        self.entropy = BatchEntropy(self.device)
        self.tables = [GroupTables(g, self.device) for g in codec.cal.groups]
        self.strict = strict
        self.projector = make_projector(self.cfg.projection, self.device)  # fp16, fp8 or fp8-emulated (CPU)
        self._rope_cfgs = list(self.fp.rotary)
        self.last_timings: dict[str, float] = {}
        self.kernel_errors: list[str] = []
        self._pinned: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # one encode at a time (its pinned buffer)
        self.restore_lock = threading.Lock()  # one restore staging at a time

    # ------------------------------------------------------------------------------------------ helpers
    def run_stage(self, name: str, *args, **kw):
        """Run a stage with the Triton op; if it fails to compile or launch, switch to torch for good."""
        if self.ops.name == "triton":
            try:
                return getattr(self.ops, name)(*args, **kw)
            except Exception as e:  # noqa: BLE001 - compilation/launch problems of an optional backend
                if self.strict:
                    raise
                msg = f"triton {name} failed ({type(e).__name__}: {e}); using torch ops"
                self.kernel_errors.append(msg)
                log.warning("kvtc fused codec: %s", msg)
                self.ops = self.torch_ops
        return getattr(self.torch_ops, name)(*args, **kw)

    def pinned_buf(self, n: int, purpose: str) -> torch.Tensor:
        """A reusable host buffer of at least ``n`` bytes for ``purpose`` (pinned on CUDA)."""
        buf = self._pinned.get(purpose)
        if buf is None or buf.numel() < n:
            pin = self.device.type == "cuda"
            buf = self._pinned[purpose] = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=pin)
        return buf

    def rope(self, cache: dict, layer: int, pos: torch.Tensor, inverse: bool):
        """RoPE tables of ``layer``'s rotary config at ``pos`` (cached in ``cache`` per config and direction)."""
        cfg = self._rope_cfgs[layer]
        key = (cfg, inverse)
        if key not in cache:
            cache[key] = rope_tables(cfg, pos, self.fp.head_dim, inverse=inverse)
        return cache[key]
