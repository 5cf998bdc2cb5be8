"""The project's log lines reach operators inside an engine: ``operator_logging`` (what every way in calls at
start-up) gives the ``dynamo_kvtc`` logger the engine's level and, when nobody configured logging, one handler in
vLLM's line format; run in fresh interpreters, as an engine process starts with no logging configured."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_info_lines_are_dropped_without_it_and_shown_once_with_it():
    out = _run(
        "import logging\n"
        "from dynamo_kvtc.logs import operator_logging\n"
        "logging.getLogger('dynamo_kvtc.connector.vllm.worker').info('before: dropped')\n"
        "operator_logging(); operator_logging()\n"
        "logging.getLogger('dynamo_kvtc.connector.vllm.worker').info('KvtcConnector ready: 30 layers')\n"
        "logging.getLogger('dynamo_kvtc.tiers.store').debug('debug: below the level')\n"
    )
    assert out.returncode == 0, out.stderr
    assert "before: dropped" not in out.stdout + out.stderr  # what an engine showed of our INFO lines until now
    lines = [ln for ln in out.stdout.splitlines() if "KvtcConnector ready" in ln]
    assert len(lines) == 1 and lines[0].startswith("INFO ") and "[kvtc " in lines[0]
    assert "debug: below the level" not in out.stdout


def test_it_follows_the_engines_level_and_leaves_configured_logging_alone():
    quiet = _run(
        "import logging\n"
        "logging.getLogger('vllm').setLevel(logging.WARNING)\n"
        "from dynamo_kvtc.logs import operator_logging\n"
        "operator_logging()\n"
        "logging.getLogger('dynamo_kvtc.x').info('info: hidden at WARNING')\n"
        "logging.getLogger('dynamo_kvtc.x').warning('warning: shown')\n"
    )
    assert "info: hidden" not in quiet.stdout and "warning: shown" in quiet.stdout
    configured = _run(
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, format='ROOT %(message)s', level=logging.INFO)\n"
        "from dynamo_kvtc.logs import operator_logging\n"
        "operator_logging()\n"
        "logging.getLogger('dynamo_kvtc.x').info('through the root handler')\n"
    )
    assert "ROOT through the root handler" in configured.stderr and "through" not in configured.stdout


def test_vllms_own_logger_level_is_followed_when_vllm_configured_it():
    pytest.importorskip("vllm")
    out = _run(
        "import logging\n"
        "import vllm.logger\n"  # vLLM configures its 'vllm' logger at import (VLLM_CONFIGURE_LOGGING)
        "from dynamo_kvtc.logs import operator_logging\n"
        "log = operator_logging()\n"
        "print('LEVEL', logging.getLevelName(log.level), logging.getLevelName(logging.getLogger('vllm').level))\n"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ours, theirs = out.stdout.split("LEVEL ")[1].split()[:2]
    assert ours == (theirs if theirs != "NOTSET" else "INFO")
