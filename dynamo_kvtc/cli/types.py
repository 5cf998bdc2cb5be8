"""Argument types: bad command-line input is refused by argparse (one ``dynamo-kvtc: error:`` line, exit 2) before
any command starts. Each type takes the string and returns the parsed value or raises ``ArgumentTypeError``.
Nothing heavy is imported here."""

from __future__ import annotations

import argparse
from pathlib import Path


def _number(s: str, kind: type, what: str):
    try:
        return kind(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} expected, got {s!r}") from None


def positive_float(s: str) -> float:
    x = _number(s, float, "a number")
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {s}")
    return x


def ratio_or_auto(s: str) -> float | str:
    """A compression ratio > 0, or ``auto`` (the calibration's checked ratio, `dynamo-kvtc check --write`)."""
    if s.strip().lower() == "auto":
        return "auto"
    return positive_float(s)


def nonneg_float(s: str) -> float:
    x = _number(s, float, "a number")
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be zero or positive, got {s}")
    return x


def positive_int(s: str) -> int:
    x = _number(s, int, "an integer")
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return x


def nonneg_int(s: str) -> int:
    x = _number(s, int, "an integer")
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be zero or a positive integer, got {s}")
    return x


def positive_floats(s: str, what: str = "values") -> tuple[float, ...]:
    """Comma-separated positive numbers: ``1,2.5``."""
    try:
        out = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated numbers, got {s!r}") from None
    if not out or any(not r > 0 for r in out):
        raise argparse.ArgumentTypeError(f"{what} must be positive, got {s!r}")
    return out


def ratios(s: str) -> tuple[float, ...]:
    """Comma-separated positive compression ratios: ``8,16,32``."""
    return positive_floats(s, "ratios")


def depths(s: str) -> tuple[float, ...]:
    """Comma-separated needle depths in (0, 1]: ``0.2,0.5,0.8``."""
    out = positive_floats(s, "depths")
    if any(d > 1 for d in out):
        raise argparse.ArgumentTypeError(f"depths must be in (0, 1], got {s!r}")
    return out


def positive_ints(s: str) -> list[int]:
    """Comma-separated positive integers: ``1024,2048``."""
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected, got {s!r}") from None
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"comma-separated positive integers expected, got {s!r}")
    return out


def batch_tokens(s: str) -> list[tuple[int, int]]:
    """Comma-separated ``BATCHxTOKENS`` pairs: ``8x8192,2x16384``."""
    out = []
    for c in (c.strip() for c in s.split(",")):
        if not c:
            continue
        b, sep, t = c.lower().partition("x")
        if not sep or not b.isdigit() or not t.isdigit() or int(b) <= 0 or int(t) <= 0:
            raise argparse.ArgumentTypeError(f"batch x tokens expected as BxT (e.g. 8x8192), got {c!r}")
        out.append((int(b), int(t)))
    if not out:
        raise argparse.ArgumentTypeError(f"at least one BxT expected, got {s!r}")
    return out


def shape_names() -> list[str]:
    from ..bench.shapes import SHAPES

    return sorted(SHAPES)


def shape(s: str) -> str:
    """One synthetic KV shape of ``bench.shapes``."""
    if s not in shape_names():
        raise argparse.ArgumentTypeError(f"unknown shape {s!r}; choose from {', '.join(shape_names())}")
    return s


def shapes(s: str) -> list[str]:
    """Comma-separated synthetic KV shapes."""
    out = [x.strip() for x in s.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError("at least one shape expected")
    for x in out:
        shape(x)
    return out


def existing_path(s: str) -> Path:
    p = Path(s)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"{s} does not exist")
    return p


def existing_dir(s: str) -> str:
    if not Path(s).is_dir():
        raise argparse.ArgumentTypeError(f"{s} is not a directory" if Path(s).exists() else f"{s} does not exist")
    return s


def existing_file(s: str) -> str:
    if not Path(s).is_file():
        raise argparse.ArgumentTypeError(f"{s} is not a file" if Path(s).exists() else f"{s} does not exist")
    return s


def name_eq_dir(s: str) -> str:
    """``NAME=DIR`` with an existing directory (returned unchanged)."""
    name, _, d = s.partition("=")
    if not name or not d:
        raise argparse.ArgumentTypeError(f"NAME=DIR expected, got {s!r}")
    existing_dir(d)
    return s


def key_value(s: str) -> tuple[str, object]:
    """``KEY=VALUE`` with VALUE an int, a float or a word."""
    key, sep, val = s.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"KEY=VALUE expected, got {s!r}")
    for kind in (int, float):
        try:
            return key, kind(val)
        except ValueError:
            pass
    return key, val
