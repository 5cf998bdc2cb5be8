"""The pytest fixture ``mooncake_master``: a real master (dynamo_kvtc/tiers/mooncake_master.py) on free loopback
ports, one per test, killed at teardown (and bounded by a hard lifetime); ``.stop()``/``.start()`` restart it."""

import pytest

from dynamo_kvtc.tiers.mooncake_master import MooncakeMaster


@pytest.fixture
def mooncake_master():
    m = MooncakeMaster().start()
    try:
        yield m
    finally:
        m.stop()
