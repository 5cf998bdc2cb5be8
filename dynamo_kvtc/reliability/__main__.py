"""``python -m dynamo_kvtc.reliability [-v] ARGS``: ``dynamo-kvtc bench chaos ARGS``; also the entry point of the
scenarios' child processes (``_child ROLE JSON``)."""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        from .chaos import child_main

        child_main(argv[1], argv[2])
        return 0
    verbose = [a for a in argv if a in ("-v", "--verbose")]
    rest = [a for a in argv if a not in ("-v", "--verbose")]
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from ..cli.main import main as cli_main

    return cli_main([*verbose, "bench", "chaos", *rest])


if __name__ == "__main__":
    sys.exit(main())
