"""KV-cache reconstruction methods compared by the harness: one small file per method."""

from .base import Method, Reconstruction
from .deflate import DeflateRaw
from .fp8 import Fp8
from .int8 import Int8PerToken
from .kivi import Kivi
from .kvtc import Kvtc
from .vanilla import Vanilla

__all__ = ["DeflateRaw", "Fp8", "Int8PerToken", "Kivi", "Kvtc", "Method", "Reconstruction", "Vanilla"]
