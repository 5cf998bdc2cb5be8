"""``kvtc``: an LMCache serde that stores each LMCache chunk as a KVTC blob on its L2 tier.

LMCache's multi-process storage path hands an L2 adapter's serde every chunk it stores as one KV-shaped object,
``[2, num_layers, tokens, kv_heads * head_dim]`` in the model's dtype, and asks it for a byte buffer. Importing this
module registers ``kvtc`` with LMCache's serde factory (when LMCache is installed); an L2 adapter selects it with::

    {"type": "fs", "base_path": "/nvme/lmcache",
     "serde": {"type": "kvtc", "calibration": "/calibrations/llama-3.1-8b-instruct", "ratio": 16}}

Options (``serde`` keys; the settings table's ``lmcache_serde`` rows, docs/configuration.md; an error names the key):
``calibration`` (directory, required: LMCache asks for a buffer size before it shows a chunk, and names no model),
``ratio`` (default 16; ``auto``: the calibration's checked ratio), ``ratio_policy`` (``fixed`` or ``raw``: every chunk
stored uncompressed, lossless), ``device`` (``auto``: the chunk's own device when it is a GPU tensor, else CUDA when
present, else the CPU), ``chunk_window`` (trailing tokens of every chunk kept raw, default 0), ``max_workers`` (serde
threads, default 1). The start-up checks (the calibration, MLA refused, ``auto``, the plan, CUDA for ``device:
cuda``) are the three ways in's one start-up, :func:`~dynamo_kvtc.connector.startup.open_tier`, with its rule:
invalid configuration stops LMCache with one line naming the ``serde`` key; a runtime limitation (an MLA
calibration, no CUDA) serves without the tier (every chunk's serialization fails: LMCache stores nothing, every load
a miss) with one WARNING line (LMCache has no metrics route for a serde: ``KvtcChunkCoder.disabled`` holds the
reason). Codecs come from :func:`~dynamo_kvtc.codec.factory.make_codec`.

**Size contract.** LMCache allocates the serialized buffer from ``estimate_serialized_size`` before serializing, and
``serialize`` returns the bytes it wrote, to which LMCache's ``AsyncSerdeProcessor`` narrows the buffer, so the L2
adapter stores exactly those. The estimate is a strict upper bound fixed by the plan: the size of the blob with its
entropy stage off (its sections' sizes follow from the DP plan, not the data) plus zlib's worst-case expansion and a
16-byte length prefix (for 16x on SmolLM2's 256-token chunks: 413 KB for 5.9 MB raw; DEFLATE stores less).
The deserializer reads the prefix, verifies the blob (every section's CRC) and writes the chunk; a blob it cannot
decode fails the load (LMCache then treats the chunk as missing).

**Positions.** KVTC removes RoPE from keys before its projection; LMCache gives a serde no token positions unless the
object carries ``cached_positions``. Without them a chunk is encoded at positions ``0..T-1``: decoding is the codec's
exact inverse (the blob records the positions it used), but keys of later chunks are projected while still rotated by
their offset, which costs a lot of accuracy at 16x (relative key error 0.94 instead of 0.21 on the test model; a
``--keep-rope`` calibration needs no positions but measures 0.75). LMCache 0.5's multi-process path sets no
positions, so there only a prompt's first chunk keeps KVTC's accuracy: prefer ``ratio_policy: raw`` or a lower ratio,
or one of the other two ways in (docs/ways-in.md). The serde logs this once when it happens.
"""

from __future__ import annotations

import logging
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ... import settings
from ...codec.entropy.registry import PORTABLE, coder
from ...codec.options import CodecOptions
from ...errors import ConfigError, DecodeError, KvtcError
from ...logs import operator_logging
from ..startup import CodecSpec, open_tier, torch_device

log = logging.getLogger(__name__)

SERDE_TYPE = "kvtc"
WAY = "lmcache_serde"  # the settings table's name of this way in
PREFIX = struct.Struct("<4sIQ")  # magic, version, blob length
MAGIC = b"KVTS"
REFERENCE = CodecOptions(fused="0")  # the serde codes on the reference path (chunks come one at a time)


@dataclass(frozen=True)
class SerdeOptions:
    """The serde's options (the settings table's ``lmcache_serde`` rows)."""

    calibration: str | Path
    ratio: float | str = settings.default("ratio")
    ratio_policy: str = settings.default("ratio_policy")
    device: str = settings.default("device")
    chunk_window: int = settings.default("chunk_window")
    max_workers: int = settings.default("max_workers")

    @classmethod
    def from_kwargs(cls, kw: dict[str, Any]) -> SerdeOptions:
        values = settings.read_options(WAY, kw)
        if values["calibration"] is None:
            raise ConfigError(f"{settings.origin(WAY, 'calibration')}: is required (the calibration directory of the "
                              "served model)")  # fmt: skip
        return cls(**values)


class KvtcChunkCoder:
    """LMCache-independent core: a ``[2, L, T, H*D]`` chunk <-> length-prefixed KVTC blob in a byte buffer."""

    def __init__(self, opts: SerdeOptions) -> None:
        operator_logging("lmcache")  # the ready line and warnings in LMCache's log at its level
        self.opts = opts
        self.opened = open_tier(
            WAY,
            calibration=opts.calibration,
            model=None,
            ratio=opts.ratio,
            policy=opts.ratio_policy,
            serves_mla=False,
            device=opts.device,
        ).settle(WAY)  # invalid configuration: ConfigError naming the option; a limitation: one WARNING line
        self.disabled = self.opened.why_not  # serve without the tier: every chunk's store and load fails (a miss)
        self.cal = self.opened.calibration
        fp = self.cal.fingerprint if self.cal is not None else None
        self.L, self.H, self.D = (fp.num_layers, fp.num_kv_heads, fp.head_dim) if fp is not None else (0, 0, 0)
        self._codecs: dict[tuple[str, str], Any] = {}
        self._bounds: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._warned = False

    def _device(self, t: torch.Tensor | None) -> torch.device:
        return torch_device(self.opts.device, t)

    def codec(self, device: torch.device, tag: str = "deflate"):
        if self.disabled is not None:
            raise KvtcError(f"the kvtc serde serves without the tier ({self.disabled.reason}): {self.disabled.message}")
        key = (str(device), tag)
        with self._lock:
            c = self._codecs.get(key)
            if c is None:
                c = self.opened.make(CodecSpec(device, window=self.opts.chunk_window, options=REFERENCE, tag=tag))
                self._codecs[key] = c
        return c

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 4 or x.shape[0] != 2 or x.shape[1] != self.L or x.shape[3] != self.H * self.D:
            raise KvtcError(
                f"LMCache chunk of shape {tuple(x.shape)} is not [2, {self.L}, T, {self.H * self.D}] "
                f"(calibration {self.cal.id[:12]}: {self.L} layers x {self.H} KV heads x {self.D})"
            )
        T = x.shape[2]
        k = x[0].reshape(self.L, T, self.H, self.D)
        v = x[1].reshape(self.L, T, self.H, self.D)
        return k, v

    def _encode(self, x: torch.Tensor, positions: torch.Tensor | None, tag: str = "deflate") -> bytes:
        dev = self._device(x)
        self.codec(dev, tag)  # serving without the tier: every chunk's store fails here
        k, v = self._split(x.to(dev))
        T = k.shape[1]
        pos = None if positions is None else positions.to("cpu", torch.int64).reshape(-1)
        if pos is None or pos.numel() != T:
            if self.cal.rope_removed and not self._warned and tag != "store":
                self._warned = True
                log.warning(
                    "kvtc serde: LMCache gave no token positions; chunks are encoded at 0..T-1, which costs accuracy "
                    "for all but a prompt's first chunk with calibration %s (RoPE removed); see docs/ways-in.md",
                    self.cal.id[:12],
                )
            pos = torch.arange(T)
        raw = self.opts.ratio_policy == "raw"
        return self.codec(dev, tag).encode(k, v, pos, window=T if raw else None)

    def bound(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:
        """Upper bound of the serialized size of a chunk of this shape (see the module docstring)."""
        if self.disabled is not None:  # nothing is ever written: the prefix is all a buffer needs
            return PREFIX.size
        key = (tuple(int(s) for s in shape), dtype)
        b = self._bounds.get(key)
        if b is None:
            zeros = torch.zeros(key[0], dtype=dtype)
            stored = len(self._encode(zeros, None, tag="store"))  # sections' sizes are fixed by the plan
            chunks = stored // 65536 + 8 * self.cal.layer_groups + 8
            grow = coder(PORTABLE).max_expansion  # worst case of the entropy codec serialize writes, per chunk
            b = PREFIX.size + stored + chunks * grow + 1024  # + headers
            self._bounds[key] = b
        return b

    def serialize_into(self, src: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor | None = None) -> int:
        blob = self._encode(src, positions)
        n = PREFIX.size + len(blob)
        flat = dst.view(-1).view(torch.uint8) if dst.dtype != torch.uint8 else dst.view(-1)
        if n > flat.numel():
            raise KvtcError(f"kvtc blob of {n} bytes does not fit the {flat.numel()}-byte buffer LMCache allocated")
        data = torch.frombuffer(bytearray(PREFIX.pack(MAGIC, 1, len(blob)) + blob), dtype=torch.uint8)
        flat[:n].copy_(data)
        return n

    def deserialize_into(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        flat = src.view(-1).view(torch.uint8) if src.dtype != torch.uint8 else src.view(-1)
        head = bytes(flat[: PREFIX.size].cpu().numpy())
        magic, version, n = PREFIX.unpack(head)
        if magic != MAGIC or version != 1 or PREFIX.size + n > flat.numel():
            raise DecodeError("not a kvtc serde buffer (bad prefix)")
        blob = bytes(flat[PREFIX.size : PREFIX.size + n].cpu().numpy())
        dev = self._device(dst)
        k, v = self.codec(dev).decode(blob)
        T = k.shape[1]
        out = torch.stack((k.reshape(self.L, T, -1), v.reshape(self.L, T, -1)))
        if tuple(out.shape) != tuple(dst.shape):
            raise DecodeError(f"blob holds a chunk of shape {tuple(out.shape)}, LMCache expects {tuple(dst.shape)}")
        dst.copy_(out.to(dst.dtype))


def build(kwargs: dict[str, Any]):
    """LMCache serde factory: ``AsyncSerdeProcessor`` over :class:`KvtcSerializer` / :class:`KvtcDeserializer`."""
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor

    coder = KvtcChunkCoder(SerdeOptions.from_kwargs(dict(kwargs)))
    return AsyncSerdeProcessor(KvtcSerializer(coder), KvtcDeserializer(coder), max_workers=coder.opts.max_workers)


try:  # the LMCache classes, where LMCache is installed
    from lmcache.v1.distributed.serde.base import Deserializer as _Deserializer
    from lmcache.v1.distributed.serde.base import Serializer as _Serializer

    HAVE_LMCACHE = True
except ImportError:  # pragma: no cover - exercised where LMCache is absent
    _Serializer = _Deserializer = object  # type: ignore[assignment,misc]
    HAVE_LMCACHE = False


class KvtcSerializer(_Serializer):  # type: ignore[misc,valid-type]
    """LMCache ``Serializer``: a KV chunk into a length-prefixed KVTC blob."""

    def __init__(self, coder: KvtcChunkCoder) -> None:
        self.coder = coder

    def serialize(self, src, dst, key) -> int:
        positions = getattr(getattr(src, "metadata", None), "cached_positions", None)
        return self.coder.serialize_into(src.tensor, dst.tensor, positions)

    def estimate_serialized_size(self, layout_desc) -> int:
        if len(layout_desc.shapes) != 1:
            raise KvtcError(f"the kvtc serde takes single-tensor chunks, got {len(layout_desc.shapes)} tensors")
        return self.coder.bound(layout_desc.shapes[0], layout_desc.dtypes[0])


class KvtcDeserializer(_Deserializer):  # type: ignore[misc,valid-type]
    """LMCache ``Deserializer``: a length-prefixed KVTC blob back into the KV chunk."""

    def __init__(self, coder: KvtcChunkCoder) -> None:
        self.coder = coder

    def deserialize(self, src, dst, key) -> None:
        self.coder.deserialize_into(src.tensor, dst.tensor)


def register() -> bool:
    """Register ``kvtc`` with LMCache's serde factory; False where LMCache is not installed. Idempotent."""
    if not HAVE_LMCACHE:
        return False
    from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory

    if SERDE_TYPE not in get_registered_serde_types():
        register_serde_factory(SERDE_TYPE, build)
    return True


register()
