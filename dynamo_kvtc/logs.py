"""How the project's log lines reach operators inside an engine (standard library only).

vLLM configures its own ``vllm`` logger and nothing else, so a record on the ``dynamo_kvtc`` logger found no handler:
its INFO lines (``KvtcConnector ready: ...``, ``kvtc secondary tier ready: ...``) were dropped, and WARNINGs reached
stderr through logging's last-resort handler without a time or a source. :func:`operator_logging`, called by every
way in at start-up, gives the ``dynamo_kvtc`` logger the engine's level and, when nobody configured logging for it
(no handler of its own, none on the root logger), one handler in vLLM's line format on the same stream. Where the
operator configured logging (Dynamo, a ``logging`` config, pytest), records propagate as before.
"""

from __future__ import annotations

import logging
import sys

ROOT = "dynamo_kvtc"
FORMAT = "%(levelname)s %(asctime)s [kvtc %(filename)s:%(lineno)d] %(message)s"  # vLLM's, marked as ours
DATEFMT = "%m-%d %H:%M:%S"


def operator_logging(engine_logger: str = "vllm") -> logging.Logger:
    """Make ``dynamo_kvtc``'s records visible at the engine's level (INFO when the engine set none). Idempotent."""
    log = logging.getLogger(ROOT)
    engine = logging.getLogger(engine_logger)
    level = engine.level if engine.level != logging.NOTSET else logging.INFO
    if log.level == logging.NOTSET:
        log.setLevel(level)
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
        handler.set_name("dynamo_kvtc")
        log.addHandler(handler)
        log.propagate = False  # one line per record, even if the root logger gets a handler later
    return log
