"""``nixl_progress_us``: NIXL's Python wrapper builds every agent with a progress thread that never sleeps (one busy
core per UCX agent, for the agent's lifetime); with the setting the thread waits between polls. Real agents in a clean
subprocess (tests/nixl_idle.py): a READ between two of them is exact, and idle they cost almost no CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_kvtc.connector.config import ConnectorConfig
from dynamo_kvtc.errors import ConfigError

from .conftest import ENGINE_ENV

SCRIPT = Path(__file__).with_name("nixl_idle.py")


def _idle(progress_us: int) -> dict:
    p = subprocess.run([sys.executable, str(SCRIPT), str(progress_us)], env=ENGINE_ENV, capture_output=True, text=True,
                       timeout=180)  # fmt: skip
    if p.returncode != 0 and "backend unavailable" in p.stderr:
        pytest.skip(f"NIXL UCX unavailable: {p.stderr[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_agents_with_a_progress_delay_transfer_exactly_and_idle_without_a_busy_core():
    slow = _idle(100)
    assert slow["exact"]
    # two agents with NIXL's default spin ~2 cores (4 CPU-s in 2 s here; >= 1 s even on a machine at load 8)
    assert slow["idle_cpu_s"] < 0.5, slow
    spin = _idle(0)
    assert spin["exact"] and spin["idle_cpu_s"] > 2 * slow["idle_cpu_s"], (spin, slow)


def test_the_setting_reaches_the_connector_from_the_environment_only():
    assert ConnectorConfig.from_sources(None, {}).nixl_progress_us == 0  # NIXL's own default
    assert ConnectorConfig.from_sources(None, {"DYN_KVTC_NIXL_PROGRESS_US": "100"}).nixl_progress_us == 100
    with pytest.raises(ConfigError, match="NIXL_PROGRESS_US"):
        ConnectorConfig.from_sources(None, {"DYN_KVTC_NIXL_PROGRESS_US": "-1"})
    with pytest.raises(ConfigError, match="nixl_progress_us"):
        ConnectorConfig.from_sources({"nixl_progress_us": 100}, {})  # process-wide: not in the extra config
