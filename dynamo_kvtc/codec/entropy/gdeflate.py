"""``gdeflate``: nvCOMP GDeflate, a DEFLATE variant laid out for GPU decode; GPU-only (a CPU reader refuses it with
:class:`~dynamo_kvtc.errors.UnsupportedCodecError`)."""

from __future__ import annotations

from .base import Coder
from .deflate import DEFLATE_MAX_RATIO


class GDeflate(Coder):
    tag = "gdeflate"
    cpu = False
    nvcomp = "GDeflate"
    nvcomp_options = {"algorithm_type": 0}
    max_ratio = DEFLATE_MAX_RATIO  # DEFLATE's symbols: the same ceiling
