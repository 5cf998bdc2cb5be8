"""The KVTC codec: pure tensor math and the blob format (no CUDA, NIXL or Dynamo imports at module level).

Exports load lazily (PEP 562): ``from dynamo_kvtc.codec import parse_blob`` imports the container alone, without torch;
the tensor side (``KvtcCodec``, plans, quantizers, RoPE) imports torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports

_EXPORTS = {
    "FORMAT_VERSION": "container",
    "MAGIC": "container",
    "BlobHeader": "container",
    "parse_blob": "container",
    "write_blob": "container",
    "CHUNK_BYTES": "entropy.base",
    "GPU_ONLY_TAGS": "entropy.registry",
    "TAGS": "entropy.registry",
    "EntropyCoder": "entropy.sections",
    "BlobView": "blob",
    "Codec": "base",
    "EncodeSpan": "base",
    "PagedView": "base",
    "RestoreRun": "base",
    "CodecConfig": "reference",
    "ReferenceCodec": "reference",
    "KvtcCodec": "kvtc",
    "CodecOptions": "options",
    "make_codec": "factory",
    "BasisGroup": "model",
    "CalibrationLike": "model",
    "ModelFingerprint": "model",
    "GROUP_SIZES": "plan",
    "Plan": "plan",
    "decode_coefficients": "plan",
    "encode_coefficients": "plan",
    "BITS": "quant",
    "KINDS": "quant",
    "META_BITS": "quant",
    "dequantize": "quant",
    "group_cost_bits": "quant",
    "quantize": "quant",
    "RotaryConfig": "rope",
    "apply_rope": "rope",
    "remove_rope": "rope",
}

__all__ = [
    "BITS",
    "BasisGroup",
    "BlobHeader",
    "BlobView",
    "CHUNK_BYTES",
    "CalibrationLike",
    "Codec",
    "CodecConfig",
    "CodecOptions",
    "EncodeSpan",
    "EntropyCoder",
    "FORMAT_VERSION",
    "GPU_ONLY_TAGS",
    "GROUP_SIZES",
    "KINDS",
    "KvtcCodec",
    "MAGIC",
    "META_BITS",
    "ModelFingerprint",
    "PagedView",
    "Plan",
    "ReferenceCodec",
    "RestoreRun",
    "RotaryConfig",
    "TAGS",
    "apply_rope",
    "decode_coefficients",
    "dequantize",
    "encode_coefficients",
    "group_cost_bits",
    "make_codec",
    "parse_blob",
    "quantize",
    "remove_rope",
    "write_blob",
]


if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from .base import Codec, EncodeSpan, PagedView, RestoreRun
    from .blob import BlobView
    from .container import FORMAT_VERSION, MAGIC, BlobHeader, parse_blob, write_blob
    from .entropy.base import CHUNK_BYTES
    from .entropy.registry import GPU_ONLY_TAGS, TAGS
    from .entropy.sections import EntropyCoder
    from .factory import make_codec
    from .kvtc import KvtcCodec
    from .model import BasisGroup, CalibrationLike, ModelFingerprint
    from .options import CodecOptions
    from .plan import GROUP_SIZES, Plan, decode_coefficients, encode_coefficients
    from .quant import BITS, KINDS, META_BITS, dequantize, group_cost_bits, quantize
    from .reference import CodecConfig, ReferenceCodec
    from .rope import RotaryConfig, apply_rope, remove_rope

__getattr__, __dir__ = exports(__name__, _EXPORTS)
