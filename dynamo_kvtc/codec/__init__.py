"""The KVTC codec: pure tensor math and the blob format (no CUDA, NIXL or Dynamo imports at module level)."""

from .container import FORMAT_VERSION, MAGIC, parse_blob
from .entropy import CHUNK_BYTES, GPU_ONLY_TAGS, TAGS, EntropyCoder
from .kvtc import CodecConfig, KvtcCodec
from .model import BasisGroup, CalibrationLike, ModelFingerprint
from .plan import GROUP_SIZES, Plan, decode_coefficients, encode_coefficients
from .quant import BITS, KINDS, META_BITS, dequantize, group_cost_bits, quantize
from .rope import RotaryConfig, apply_rope, remove_rope

__all__ = [
    "BITS",
    "CHUNK_BYTES",
    "FORMAT_VERSION",
    "GPU_ONLY_TAGS",
    "GROUP_SIZES",
    "KINDS",
    "MAGIC",
    "META_BITS",
    "TAGS",
    "BasisGroup",
    "CalibrationLike",
    "CodecConfig",
    "EntropyCoder",
    "KvtcCodec",
    "ModelFingerprint",
    "Plan",
    "RotaryConfig",
    "apply_rope",
    "decode_coefficients",
    "dequantize",
    "encode_coefficients",
    "group_cost_bits",
    "parse_blob",
    "quantize",
    "remove_rope",
]
