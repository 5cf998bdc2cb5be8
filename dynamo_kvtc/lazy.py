"""Lazy package exports (PEP 562): a package's public names load their module on first use.

So importing a package for something small — ``dynamo-kvtc --help``, ``inspect``, the disk file format, the blob
container — imports no torch. A foundation module like :mod:`.errors`: standard library only.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose ``table`` maps each lazy name to its submodule (``"store"``
    or ``".store"``). A loaded name is kept on the package, so each loads once."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module("." + module.lstrip("."), package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
