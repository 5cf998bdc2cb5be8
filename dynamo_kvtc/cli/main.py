"""``dynamo-kvtc``: entry point, argument parsing and dispatch by table.

Each command is a module of this package with ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``; ``run``
imports the package that does the work only when the command runs, so ``dynamo-kvtc --help`` imports no torch.
Arguments are checked by their argparse types (``types``): bad input ends in one ``dynamo-kvtc: error:`` line and
exit status 2 before anything starts; a :class:`~dynamo_kvtc.errors.KvtcError` from a command ends the same way.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ..errors import KvtcError

# command name -> module of dynamo_kvtc.cli (in the order of `dynamo-kvtc --help`)
COMMANDS = {
    "demo": "demo",
    "codec-demo": "codec_demo",
    "calibrate": "calibrate",
    "bench": "bench",
    "eval": "eval",
    "check": "check",
    "inspect": "inspect",
}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``dynamo-kvtc: error: ...`` (exit 2), naming the command."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"dynamo-kvtc: error: {message} (see `{self.prog} --help`)\n")


def add_commands(parser: argparse.ArgumentParser, table: dict[str, str], dest: str) -> None:
    """One subparser per entry of ``table`` (name -> module of this package), its handler the module's ``run``."""
    sub = parser.add_subparsers(dest=dest, required=True)
    for name, module in table.items():
        mod = importlib.import_module(f"{__package__}.{module}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        if hasattr(mod, "run"):
            p.set_defaults(handler=mod.run)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="dynamo-kvtc", description="KV Cache Transform Coding for NVIDIA Dynamo")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_commands(p, COMMANDS, "command")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.handler(args)
    except KvtcError as e:
        print(f"dynamo-kvtc: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
