"""``kvtc``: a compressed secondary tier for vLLM's OffloadingConnector (``TieringOffloadingSpec``).

vLLM's tiered offloading keeps a raw CPU *primary* tier (the only tier the GPU copies to and from) and cascades every
chunk it stores there to its *secondary* tiers; a chunk found only in a secondary tier is promoted back into a
primary slot before the GPU loads it. This tier holds those chunks as KVTC blobs: a small raw hot tier in front of a
large compressed warm tier, in the ``kv_connector_extra_config`` users already write for OffloadingConnector::

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4000000000,
     "secondary_tiers": [{"type": "kvtc", "cpu_cache_gb": 64, "ratio": 16,
                          "disk_cache_gb": 500, "disk_cache_dir": "/nvme/kvtc"}]}

``type: kvtc`` is registered by :mod:`dynamo_kvtc.connector.offload_register` (vLLM loads it through the
``vllm.general_plugins`` entry point of the installed package); without the entry point the out-of-tree form works
too: ``{"type": "KvtcSecondaryTier", "module_path": "dynamo_kvtc.connector.offload_tier", ...}``.

Everything here runs in the scheduler process, as vLLM requires of secondary tiers: ``submit_store`` and
``submit_load`` queue a job and return; a small thread pool reads the chunk out of the primary tier's memory view,
encodes it with :class:`~dynamo_kvtc.codec.KvtcCodec` (on the GPU when one is present, else on the CPU) and keeps the
blob in a byte-budgeted LRU host tier whose victims move to an optional disk tier; a promotion decodes the blob and
writes the chunk back into the primary slot vLLM allocated. Positions (for the keys' RoPE) come from vLLM's
per-request record of each chunk's end token; a chunk without one is stored raw. A failed or missing blob is a failed
promotion: vLLM recomputes those tokens.

Tier options (each validated here; an error names the key):

=================  =======================================================================================
``calibration``    calibration directory (default: the shipped/cached one named after the model folder)
``ratio``          compression ratio, one of the calibration's plans (default 16)
``ratio_policy``   ``fixed`` (every chunk at ``ratio``) or ``raw`` (every chunk stored uncompressed: lossless)
``window``         trailing tokens of every chunk kept raw (default 0)
``cpu_cache_gb``   host-tier budget of compressed bytes (default 4)
``disk_cache_gb``  disk-tier budget (default 0: no disk tier); needs ``disk_cache_dir``
``disk_cache_dir`` directory the disk tier owns (created 0700)
``device``         ``auto`` (CUDA when available), ``cpu`` or ``cuda``: where chunks are encoded and decoded
``page_layout``    ``auto``, ``nhd``, ``hnd`` or ``cpu``: how a layer's block is laid out in a primary chunk
``threads``        encode/decode threads (default 2)
=================  =======================================================================================
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from ..errors import ConfigError, KvtcError

log = logging.getLogger(__name__)

TIER_TYPE = "kvtc"
PAGE_LAYOUTS = ("auto", "nhd", "hnd", "cpu")
RATIO_POLICIES = ("fixed", "raw")
DEVICES = ("auto", "cpu", "cuda")


def _err(key: str, msg: str) -> ConfigError:
    return ConfigError(f"secondary_tiers[type={TIER_TYPE}].{key}: {msg}")


@dataclass(frozen=True)
class KvtcTierOptions:
    """The tier's options, from its entry in ``secondary_tiers`` (see the module docstring)."""

    calibration: str | None = None
    ratio: float = 16.0
    ratio_policy: str = "fixed"
    window: int = 0
    cpu_cache_gb: float = 4.0
    disk_cache_gb: float = 0.0
    disk_cache_dir: str | None = None
    device: str = "auto"
    page_layout: str = "auto"
    threads: int = 2
    locality: str | None = None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> KvtcTierOptions:
        known = set(cls.__dataclass_fields__)
        for key in cfg:
            if key not in known:
                raise _err(key, f"unknown option; known: {', '.join(sorted(known))}")
        out: dict[str, Any] = {}
        for key, conv in (("ratio", float), ("cpu_cache_gb", float), ("disk_cache_gb", float)):
            if key in cfg:
                try:
                    out[key] = conv(cfg[key])
                except (TypeError, ValueError):
                    raise _err(key, f"must be a number, got {cfg[key]!r}") from None
        for key in ("window", "threads"):
            if key in cfg:
                v = cfg[key]
                if isinstance(v, bool) or not isinstance(v, int):
                    raise _err(key, f"must be an integer, got {v!r}")
                out[key] = v
        for key in ("calibration", "disk_cache_dir", "ratio_policy", "device", "page_layout", "locality"):
            if key in cfg and cfg[key] is not None:
                if not isinstance(cfg[key], (str, os.PathLike)):
                    raise _err(key, f"must be a string, got {cfg[key]!r}")
                out[key] = str(cfg[key])
        opts = cls(**out)
        opts._validate()
        return opts

    def _validate(self) -> None:
        if self.ratio <= 1:
            raise _err("ratio", f"must be > 1, got {self.ratio:g}")
        if self.ratio_policy not in RATIO_POLICIES:
            raise _err("ratio_policy", f"must be one of {', '.join(RATIO_POLICIES)}, got {self.ratio_policy!r}")
        if self.window < 0:
            raise _err("window", f"must be >= 0, got {self.window}")
        if self.cpu_cache_gb <= 0:
            raise _err("cpu_cache_gb", f"must be > 0, got {self.cpu_cache_gb:g}")
        if self.disk_cache_gb < 0:
            raise _err("disk_cache_gb", f"must be >= 0, got {self.disk_cache_gb:g}")
        if self.disk_cache_gb > 0 and not self.disk_cache_dir:
            raise _err("disk_cache_dir", "is required when disk_cache_gb > 0")
        if self.device not in DEVICES:
            raise _err("device", f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise _err("device", "'cuda' requested but CUDA is not available in the scheduler process")
        if self.page_layout not in PAGE_LAYOUTS:
            raise _err("page_layout", f"must be one of {', '.join(PAGE_LAYOUTS)}, got {self.page_layout!r}")
        if not 1 <= self.threads <= 64:
            raise _err("threads", f"must be in 1..64, got {self.threads}")
        if self.locality is not None and self.locality not in ("LOCAL", "REMOTE"):
            raise _err("locality", f"must be LOCAL or REMOTE, got {self.locality!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


# --------------------------------------------------------------------------------------------------------- layout
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    m = _LAYER_INDEX.search(name) or re.search(r"\.(\d+)\.", name)
    if not m:
        raise ConfigError(f"cannot tell the layer index of KV cache layer {name!r}")
    return int(m.group(1))


class ChunkLayout:
    """How one worker's part of a primary-tier chunk holds K and V: per layer (in the KV group's layer order),
    ``blocks_per_chunk`` consecutive pages of one engine block each. A page is:

    - ``nhd``: ``[block_size, H, 2, D]`` (vLLM 0.31's logical ``[B, H, N, C]`` in the LBNHC layout, C = K then V);
    - ``hnd``: ``[H, block_size, 2, D]`` (LBHNC);
    - ``cpu``: vLLM's CPU attention block ``[H, 2, block_size * D]``, each half in the kernel's own element order
      (``k_offsets``/``v_offsets``, probed through the kernel as :func:`.vllm_parts.probe_cpu_offsets` does).

    :meth:`unpack` turns a chunk's bytes into ``(keys, values)`` ``[L, T, H, D]`` in model layer order,
    :meth:`pack` is its exact inverse."""

    def __init__(
        self,
        *,
        layers: list[int],
        block_size: int,
        blocks_per_chunk: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kind: str,
        k_offsets: torch.Tensor | None = None,
        v_offsets: torch.Tensor | None = None,
    ) -> None:
        if sorted(layers) != list(range(len(layers))):
            raise ConfigError(f"KV cache layers are not one of each of 0..{len(layers) - 1}: {layers}")
        self.slots = layers  # slot i of the chunk holds model layer layers[i]
        self.order = torch.tensor(sorted(range(len(layers)), key=lambda i: layers[i]))  # layer -> slot
        self.L, self.bs, self.bpc, self.H, self.D = len(layers), block_size, blocks_per_chunk, num_heads, head_dim
        self.dtype, self.kind = dtype, kind
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.page_bytes = block_size * num_heads * 2 * head_dim * self.elem
        self.bytes = self.L * self.bpc * self.page_bytes
        self.tokens = block_size * blocks_per_chunk
        self.k_offsets, self.v_offsets = k_offsets, v_offsets
        if kind == "cpu" and k_offsets is not None:
            self.k_inv = torch.argsort(k_offsets)
            self.v_inv = torch.argsort(v_offsets)

    def unpack(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``raw``: this worker's ``self.bytes`` bytes of one chunk (uint8/int8, any device)."""
        x = raw[: self.bytes].view(self.dtype)
        L, P, bs, H, D = self.L, self.bpc, self.bs, self.H, self.D
        if self.kind == "nhd":
            x = x.view(L, P, bs, H, 2, D)
            k, v = x[..., 0, :], x[..., 1, :]
        elif self.kind == "hnd":
            x = x.view(L, P, H, bs, 2, D).permute(0, 1, 3, 2, 4, 5)
            k, v = x[..., 0, :], x[..., 1, :]
        else:
            x = x.view(L, P, H, 2, bs * D)
            k, v = x[:, :, :, 0], x[:, :, :, 1]
            if self.k_offsets is not None:  # element at logical t*D+d lives at offsets[t*D+d]
                k = k[..., self.k_offsets.to(k.device)]
                v = v[..., self.v_offsets.to(v.device)]
            k = k.reshape(L, P, H, bs, D).transpose(2, 3)
            v = v.reshape(L, P, H, bs, D).transpose(2, 3)
        order = self.order.to(x.device)
        k = k.reshape(L, P * bs, H, D)[order].contiguous()
        v = v.reshape(L, P * bs, H, D)[order].contiguous()
        return k, v

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``(keys, values)`` ``[L, T, H, D]`` in model layer order -> the chunk's bytes (uint8, on their device)."""
        L, P, bs, H, D = self.L, self.bpc, self.bs, self.H, self.D
        slots = torch.tensor(self.slots, device=k.device)
        k = k.to(self.dtype)[slots].reshape(L, P, bs, H, D)
        v = v.to(self.dtype)[slots].reshape(L, P, bs, H, D)
        if self.kind == "nhd":
            x = torch.stack((k, v), dim=4)  # L P bs H 2 D
        elif self.kind == "hnd":
            x = torch.stack((k, v), dim=4).permute(0, 1, 3, 2, 4, 5)  # L P H bs 2 D
        else:
            k = k.transpose(2, 3).reshape(L, P, H, bs * D)
            v = v.transpose(2, 3).reshape(L, P, H, bs * D)
            if self.k_offsets is not None:
                k = k[..., self.k_inv.to(k.device)]
                v = v[..., self.v_inv.to(v.device)]
            x = torch.stack((k, v), dim=3)  # L P H 2 bs*D
        return x.contiguous().view(-1).view(torch.uint8)


def _torch_dtype(name: str) -> torch.dtype:
    name = str(name).removeprefix("torch.")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ConfigError(f"KV cache dtype {name!r} is not a torch dtype")
    return dt


def resolve_page_layout(requested: str, kv_cache_layout: str | None) -> str:
    """``auto``: vLLM's CPU attention layout on a CPU platform, else from the engine's resolved KV cache layout."""
    if requested != "auto":
        return requested
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return "cpu"
    except ImportError:  # pragma: no cover - vLLM is imported above
        pass
    name = (kv_cache_layout or "LBNHC").upper()
    if name in ("LBNHC", "NHD"):
        return "nhd"
    if name in ("LBHNC", "HND"):
        return "hnd"
    raise ConfigError(
        f"KV cache layout {kv_cache_layout!r} keeps several layers in one block; the kvtc tier reads per-layer "
        "layouts (LBNHC, LBHNC) only: set secondary_tiers[type=kvtc].page_layout explicitly if you know it"
    )


def cpu_offsets(num_heads: int, block_size: int, head_dim: int, dtype: torch.dtype):
    """Element order of vLLM's CPU attention kernel inside a block (None: plain ``[block_size, D]`` halves)."""
    from .vllm_parts import probe_cpu_offsets

    try:
        return probe_cpu_offsets(torch.empty(1, num_heads, block_size, 2 * head_dim, dtype=dtype), block_size)
    except Exception as e:  # the kernel is not there: the plain layout
        log.warning("kvtc tier: CPU attention layout probe failed (%s); assuming plain [block_size, D] halves", e)
        return None


# --------------------------------------------------------------------------------------------------------- storage
class BlobCache:
    """Blobs by key: a byte-budgeted LRU in host memory whose victims move to an optional byte-budgeted disk
    directory (one file per blob, written to ``.tmp`` then renamed), itself LRU. Thread-safe."""

    def __init__(self, host_bytes: int, disk_bytes: int = 0, disk_dir: str | None = None) -> None:
        self.host_cap, self.disk_cap = host_bytes, disk_bytes
        self.host: OrderedDict[bytes, bytes] = OrderedDict()
        self.disk: OrderedDict[bytes, int] = OrderedDict()
        self.host_used = self.disk_used = 0
        self.lock = threading.Lock()
        self.removed: list[bytes] = []  # keys no tier holds any more (for KV events)
        self.stats = {"demoted": 0, "dropped": 0, "disk_reads": 0, "disk_errors": 0}
        self.dir: Path | None = None
        if disk_bytes > 0:
            assert disk_dir
            self.dir = Path(disk_dir)
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.dir.is_symlink() or (self.dir.stat().st_mode & 0o002):
                raise _err("disk_cache_dir", f"{self.dir} is a symlink or world-writable")
            for f in self.dir.glob("*.tmp"):
                f.unlink(missing_ok=True)
            for f in self.dir.glob("*.kvtc"):  # a restart forgets the old disk tier (no key survives the engine)
                f.unlink(missing_ok=True)

    def __contains__(self, key: bytes) -> bool:
        with self.lock:
            return key in self.host or key in self.disk

    def _path(self, key: bytes) -> Path:
        assert self.dir is not None
        return self.dir / f"{key.hex()}.kvtc"

    def put(self, key: bytes, blob: bytes) -> bool:
        with self.lock:
            if key in self.host or key in self.disk:
                return True
            if len(blob) > self.host_cap:
                return self._to_disk(key, blob)
            while self.host_used + len(blob) > self.host_cap and self.host:
                old, ob = self.host.popitem(last=False)
                self.host_used -= len(ob)
                self._to_disk(old, ob)
            self.host[key] = blob
            self.host_used += len(blob)
            return True

    def _to_disk(self, key: bytes, blob: bytes) -> bool:  # under the lock
        if self.dir is None or len(blob) > self.disk_cap:
            self.stats["dropped"] += 1
            self.removed.append(key)
            return False
        while self.disk_used + len(blob) > self.disk_cap and self.disk:
            old, size = self.disk.popitem(last=False)
            self.disk_used -= size
            self._path(old).unlink(missing_ok=True)
            self.stats["dropped"] += 1
            self.removed.append(old)
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("kvtc tier: disk write failed (%s); blob dropped", e)
            tmp.unlink(missing_ok=True)
            self.stats["disk_errors"] += 1
            self.removed.append(key)
            return False
        self.disk[key] = len(blob)
        self.disk_used += len(blob)
        self.stats["demoted"] += 1
        return True

    def get(self, key: bytes) -> bytes | None:
        with self.lock:
            blob = self.host.get(key)
            if blob is not None:
                self.host.move_to_end(key)
                return blob
            if key not in self.disk:
                return None
            self.disk.move_to_end(key)
            path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            with self.lock:
                if self.disk.pop(key, None) is not None:
                    self.stats["disk_errors"] += 1
                    self.removed.append(key)
            return None
        with self.lock:
            self.stats["disk_reads"] += 1
        return data  # the codec checks every section's CRC before anything is written

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark keys as recently used (vLLM calls this for chunks a request reuses)."""
        with self.lock:
            for key in keys:
                if key in self.host:
                    self.host.move_to_end(key)
                elif key in self.disk:
                    self.disk.move_to_end(key)

    def forget(self, key: bytes) -> None:
        with self.lock:
            blob = self.host.pop(key, None)
            if blob is not None:
                self.host_used -= len(blob)
            size = self.disk.pop(key, None)
            if size is not None:
                self.disk_used -= size
                self._path(key).unlink(missing_ok=True)

    def take_removed(self) -> list[bytes]:
        with self.lock:
            out, self.removed = self.removed, []
        return out


# --------------------------------------------------------------------------------------------------------- the tier
@dataclass
class _Job:
    job_id: int
    keys: list[OffloadKey]
    chunk_ids: list[int]
    positions: list[int | None] = field(default_factory=list)


class KvtcSecondaryTier(SecondaryTierManager):
    """vLLM secondary tier ``kvtc``: primary-tier chunks kept as KVTC blobs (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.opts = KvtcTierOptions.from_config(options)
        self.locality = Locality(self.opts.locality) if self.opts.locality else None
        cfg = offloading_spec.config
        if len(cfg.groups) != 1:
            raise ConfigError(f"the kvtc tier needs one KV cache group (got {len(cfg.groups)}: hybrid models)")
        if cfg.parallel.world_size != 1:
            raise ConfigError(
                f"the kvtc tier encodes one worker's KV per chunk; this engine has {cfg.parallel.world_size} "
                "workers (tensor/pipeline parallel): use KvtcConnector for TP"
            )
        self.device = self.opts.torch_device
        self.cal = self._calibration(cfg)
        fp = self.cal.fingerprint
        dtype = _torch_dtype(cfg.model.dtype) if cfg.model.dtype not in ("auto", "") else _torch_dtype(fp.dtype)
        if dtype.is_floating_point is False or dtype.itemsize == 1:
            raise ConfigError(f"the kvtc tier encodes 16/32-bit float KV caches, not {dtype}")
        group = cfg.groups[0]
        layers = [layer_index(n) for n in group.layer_names]
        kind = resolve_page_layout(self.opts.page_layout, getattr(cfg, "kv_cache_layout", None))
        offsets = (None, None)
        if kind == "cpu":
            offsets = cpu_offsets(fp.num_kv_heads, group.tokens_per_block, fp.head_dim, dtype) or (None, None)
        self.layout = ChunkLayout(
            layers=layers,
            block_size=group.tokens_per_block,
            blocks_per_chunk=offloading_spec.blocks_per_chunk,
            num_heads=fp.num_kv_heads,
            head_dim=fp.head_dim,
            dtype=dtype,
            kind=kind,
            k_offsets=offsets[0],
            v_offsets=offsets[1],
        )
        if len(layers) != fp.num_layers:
            raise ConfigError(f"engine has {len(layers)} KV layers, calibration {self.cal.id[:12]} {fp.num_layers}")
        if not 0 <= self.block_size_bytes - self.layout.bytes < 4096:  # rows are padded to a page, no more
            raise ConfigError(
                f"a primary chunk is {self.block_size_bytes} bytes but {len(layers)} layers x {self.layout.bpc} "
                f"blocks x {group.tokens_per_block} tokens x {fp.num_kv_heads} heads x {fp.head_dim} x K,V x "
                f"{self.layout.elem} bytes make {self.layout.bytes}: calibration {self.cal.id[:12]} is not for "
                "this model"
            )
        from ..codec import KvtcCodec

        self.codec = KvtcCodec(self.cal, ratio=self.opts.ratio, device=self.device, window=self.opts.window)
        self.cache = BlobCache(
            int(self.opts.cpu_cache_gb * 1e9), int(self.opts.disk_cache_gb * 1e9), self.opts.disk_cache_dir
        )
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view[:]
        # the primary tier's rows as one uint8 tensor (no copy): [num_chunks, chunk bytes]
        self._primary: torch.Tensor | None = torch.frombuffer(self._flat, dtype=torch.uint8).view(
            -1, self.block_size_bytes
        )
        self._pool = ThreadPoolExecutor(self.opts.threads, thread_name_prefix="kvtc_tier")
        self._lock = threading.Lock()
        self._done: list[JobResult] = []
        self._futures: set[Future] = set()
        self._stored_keys: list[OffloadKey] = []
        self._events = bool(getattr(offloading_spec.kv_events_config, "enable_kv_cache_events", False))
        self.stats: dict[str, float] = {
            "stored_chunks": 0,
            "stored_raw_chunks": 0,
            "raw_bytes": 0,
            "blob_bytes": 0,
            "store_failures": 0,
            "loaded_chunks": 0,
            "load_failures": 0,
            "encode_seconds": 0.0,
            "decode_seconds": 0.0,
        }
        log.info(
            "kvtc secondary tier ready: %d layers, page layout %s, %d tokens per chunk, calibration %s, %s, "
            "device %s, host %.2f GB, disk %.2f GB",
            len(layers),
            kind,
            self.layout.tokens,
            self.cal.id[:12],
            "raw (lossless)" if self.opts.ratio_policy == "raw" else f"ratio {self.opts.ratio:g}",
            self.device,
            self.opts.cpu_cache_gb,
            self.opts.disk_cache_gb,
        )

    def _calibration(self, cfg: Any):
        from ..calibration.artifact import Calibration
        from ..calibration.catalog import find_calibration

        path = self.opts.calibration
        if path is None:
            found = find_calibration(Path(cfg.model.name).name) or find_calibration(cfg.model.name)
            if found is None:
                raise _err(
                    "calibration",
                    f"no calibration found for model {cfg.model.name!r}: set it, or put one in calibrations/<model "
                    "folder name> or $DYN_KVTC_CALIBRATIONS/<name> (`dynamo-kvtc calibrate`)",
                )
            path = str(found)
        if not (Path(path) / "calibration.json").is_file():
            raise _err("calibration", f"{path} has no calibration.json")
        cal = Calibration.load(path)
        if self.opts.ratio_policy == "fixed" and float(self.opts.ratio) not in [float(r) for r in cal.ratios]:
            raise _err("ratio", f"{self.opts.ratio:g} has no plan in calibration {path} ({cal.ratios})")
        return cal

    # ------------------------------------------------------------------ scheduler-facing hooks (non-blocking)
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.cache else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys, req_context: ReqContext) -> None:
        self.cache.touch(keys)

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job = _Job(job_metadata.job_id, keys, [int(c) for c in job_metadata.chunk_ids])
        job.positions = [job_metadata.req_context.get_offload_key_position(k) for k in keys]
        self._submit(self._store, job)

    def submit_load(self, job_metadata: TransferJob) -> None:
        job = _Job(job_metadata.job_id, list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids])
        self._submit(self._load, job)

    def _submit(self, fn, job: _Job) -> None:
        fut = self._pool.submit(fn, job)
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._retire)

    def _retire(self, fut: Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._futures)

    def drain_jobs(self) -> None:
        while True:
            with self._lock:
                futs = list(self._futures)
            if not futs:
                return
            for f in futs:
                f.exception()

    def take_events(self) -> Iterable[OffloadingEvent]:
        removed = self.cache.take_removed()
        with self._lock:
            stored, self._stored_keys = self._stored_keys, []
        if not self._events:
            return ()
        out = []
        if stored:
            out.append(OffloadingEvent(stored, self.medium, False, self.locality, ownership=self.tier_type))
        if removed:
            out.append(OffloadingEvent(removed, self.medium, True, self.locality, ownership=self.tier_type))
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._primary = None  # drop the tensor over the primary's memory, then the view, so vLLM can unmap it
        import gc

        gc.collect()
        try:
            self._flat.release()
        except BufferError:
            log.warning("kvtc tier: the primary tier's memory is still referenced at shutdown")

    def snapshot(self) -> dict[str, Any]:
        """Counters, sizes and fills (for tests, logs and benchmarks)."""
        with self._lock:
            s = dict(self.stats)
        with self.cache.lock:
            s.update(
                host_blobs=len(self.cache.host),
                host_bytes=self.cache.host_used,
                disk_blobs=len(self.cache.disk),
                disk_bytes=self.cache.disk_used,
                **self.cache.stats,
            )
        s["ratio"] = s["raw_bytes"] / s["blob_bytes"] if s["blob_bytes"] else None
        return s

    # ------------------------------------------------------------------ the work (pool threads)
    def _row(self, chunk_id: int) -> torch.Tensor:
        assert self._primary is not None, "the kvtc tier was shut down"
        return self._primary[chunk_id, : self.layout.bytes]

    def _finish(self, result: JobResult, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                self.stats[k] += v
            self._done.append(result)

    def _store(self, job: _Job) -> None:
        t0 = time.perf_counter()
        raw_bytes = blob_bytes = raw_chunks = stored = failed = 0
        done_keys = []
        for key, cid, end in zip(job.keys, job.chunk_ids, job.positions):
            if key in self.cache:
                continue
            try:
                k, v = self.layout.unpack(self._row(cid).to(self.device))
                T = self.layout.tokens
                raw = self.opts.ratio_policy == "raw" or end is None
                start = 0 if end is None else int(end) - T
                positions = torch.arange(start, start + T)
                blob = self.codec.encode(k, v, positions, window=T if raw else None)
            except (KvtcError, RuntimeError, ValueError) as e:
                log.warning("kvtc tier: encoding a chunk failed (%s); it is not stored", e)
                failed += 1
                continue
            if self.cache.put(key, blob):
                done_keys.append(key)
            stored += 1
            raw_chunks += raw
            raw_bytes += self.layout.bytes
            blob_bytes += len(blob)
        with self._lock:
            self._stored_keys.extend(done_keys)
        self._finish(
            JobResult(job.job_id, success=True, transfer_time=time.perf_counter() - t0, transfer_bytes=blob_bytes),
            stored_chunks=stored,
            stored_raw_chunks=raw_chunks,
            raw_bytes=raw_bytes,
            blob_bytes=blob_bytes,
            store_failures=failed,
            encode_seconds=time.perf_counter() - t0,
        )

    def _load(self, job: _Job) -> None:
        t0 = time.perf_counter()
        ok: list[OffloadKey] = []
        nbytes = 0
        for key, cid in zip(job.keys, job.chunk_ids):
            blob = self.cache.get(key)
            if blob is None:
                break
            try:
                k, v = self.codec.decode(blob)
                if k.shape[1] != self.layout.tokens:
                    raise KvtcError(f"blob holds {k.shape[1]} tokens, a chunk {self.layout.tokens}")
                data = self.layout.pack(k, v).cpu()
            except (KvtcError, RuntimeError, ValueError) as e:
                log.warning("kvtc tier: restoring a chunk failed (%s); vLLM recomputes it", e)
                self.cache.forget(key)
                break
            self._row(cid).copy_(data)
            ok.append(key)
            nbytes += len(blob)
        success = len(ok) == len(job.keys)
        self._finish(
            JobResult(
                job.job_id,
                success=success,
                successful_keys=None if success else (tuple(ok) or None),
                transfer_time=time.perf_counter() - t0,
                transfer_bytes=nbytes,
            ),
            loaded_chunks=len(ok),
            load_failures=0 if success else 1,
            decode_seconds=time.perf_counter() - t0,
        )
