"""``ans``: nvCOMP ANS (asymmetric numeral systems on bytes), the fastest GPU decode; GPU-only (a CPU reader refuses
it with :class:`~dynamo_kvtc.errors.UnsupportedCodecError`). No ratio bound beyond the 64 KiB chunk."""

from __future__ import annotations

from .base import Coder


class Ans(Coder):
    tag = "ans"
    cpu = False
    nvcomp = "ANS"
    nvcomp_options = {"data_type": "|u1"}
