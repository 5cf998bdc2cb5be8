"""Fault injection, quick form (the long form is `dynamo-kvtc bench chaos`; docs/reliability.md).

Every test drives the real thing: KvtcStore, the host arena, disk-tier files through real NIXL (POSIX), the compressed
transfer between two real processes over NIXL (UCX), real calibrations on disk, real SIGKILLs, a real tmpfs for ENOSPC
and a real RLIMIT_AS. NIXL failures come from a wrapper around the real agent (FaultyAgent). The invariants, for every
fault kind: no wrong KV served, no committed block lost, no crash, every injected fault detected.
"""

from __future__ import annotations

import pytest

from dynamo_kvtc.reliability.calibration_faults import scenario_calibration
from dynamo_kvtc.reliability.disk_faults import FILE_OPS, scenario_disk_files, scenario_enospc
from dynamo_kvtc.reliability.ledger import Ledger
from dynamo_kvtc.reliability.memory_faults import scenario_host_alloc, scenario_host_flips
from dynamo_kvtc.reliability.nixl_faults import scenario_nixl_disk
from dynamo_kvtc.reliability.process import scenario_kill9
from dynamo_kvtc.reliability.soak import scenario_soak
from dynamo_kvtc.reliability.tenant_faults import scenario_tenant_keys
from dynamo_kvtc.reliability.testbed import World
from dynamo_kvtc.reliability.transfer_faults import scenario_transfer, scenario_transfer_auth


@pytest.fixture(scope="module")
def world(tmp_path_factory, synth_cal):
    return World(tmp_path_factory.mktemp("chaos"), seed=0, cal=synth_cal)


def clean(ledger: Ledger, *kinds: str, all_detected: bool = True) -> None:
    assert not ledger.problems, ledger.problems
    for kind in kinds:
        c = ledger.kinds[kind]
        assert c["wrong_kv_served"] == 0, (kind, c)
        assert c["committed_blocks_lost"] == 0, (kind, c)
        assert c["crashes"] == 0, (kind, c)
        if all_detected:
            assert c["faults_detected"] == c["faults_injected"] > 0, (kind, c)


def test_disk_file_damage_anywhere_is_never_served(world):
    """Bit flips, scribbles, truncation, extension, deleted/swapped/renamed/symlinked files, in the index record, the
    blob header and the sections, at rest (then a restart) and under a running store; lossless and lossy."""
    ledger = Ledger()
    scenario_disk_files(world, ledger, 12)
    clean(ledger, "bitflip_disk", "truncate_disk", "misfile_disk")
    details = {k for kind in FILE_OPS for k in ledger.details[kind]}
    assert {"at_rest", "at_runtime"} <= details


def test_host_arena_bit_flips_are_refused_by_the_decoder(world):
    ledger = Ledger()
    scenario_host_flips(world, ledger, 4)
    clean(ledger, "bitflip_host")


def test_enospc_on_a_small_tmpfs_keeps_committed_blobs(world):
    ledger = Ledger()
    scenario_enospc(world, ledger, 1)
    if "skipped" in ledger.details.get("enospc", {}):
        pytest.skip(ledger.details["enospc"]["skipped"])
    clean(ledger, "enospc")
    d = ledger.details["enospc"]
    assert d["refused_writes"] >= 3 and d["writes_after_space_freed"] >= 1 and d["committed_blobs"] >= 3


def test_kill9_in_the_middle_of_disk_writes_then_restart(world):
    """A writer process is SIGKILLed at random moments while committing blobs (writes slowed so kills land inside
    them); the next process recovers the directory and restores every blob the killed one reported committed, bit for
    bit; torn .tmp files are removed, never served."""
    ledger = Ledger()
    scenario_kill9(world, ledger, 2)
    clean(ledger, "kill9_write")
    assert ledger.details["kill9_write"]["committed_checked"] > 0


def test_nixl_write_failures_store_nothing(world):
    """raise / ERR state / stall (timeout) / rejected descriptors / DONE without data / corrupted bytes on the disk
    tier's WRITE: the blob is refused (or, for the silent ones, refused when read), nothing torn is left, and every
    committed blob still restores exactly."""
    ledger = Ledger()
    scenario_nixl_disk(world, ledger, 12, ops=("WRITE",))
    clean(ledger, "nixl_disk")


def test_nixl_read_failures_keep_the_committed_blob(world):
    """The same failures on READ: the restore fails (the engine recomputes) and the committed file is kept, so the
    block restores exactly once the fault is gone."""
    ledger = Ledger()
    scenario_nixl_disk(world, ledger, 12, ops=("READ",))
    clean(ledger, "nixl_disk")


def test_two_process_transfer_faults(world):
    """Prefill side in its own process (real KvtcStore behind a TransferServer), decode side here with its real UCX
    agent wrapped: failed transfer, ERR, timeout, corrupted bytes, peer killed mid-fetch. Each fetch fails cleanly and
    the next clean fetch restores bit for bit; lying replies and garbage requests are refused."""
    ledger = Ledger()
    scenario_transfer(world, ledger, 5, timeout=2.5, modes=("raise", "stall", "corrupt", "drop", "kill_peer"))
    clean(ledger, "nixl_transfer", "transfer_malformed")
    assert ledger.details["nixl_transfer"]["clean_fetches_ok"] == 5


def test_authenticated_handoff_refuses_missing_and_wrong_macs_and_replays(world):
    """The prefill peer in its own process holds a shared secret: a decode client without one, one with another
    secret, and a replayed sealed fetch are each refused (the restore fails: the engine would recompute), the peer
    keeps serving, and the client with the right secret restores bit for bit."""
    ledger = Ledger()
    scenario_transfer_auth(world, ledger)
    clean(ledger, "transfer_auth")
    assert ledger.kinds["transfer_auth"]["faults_injected"] == 3
    assert ledger.details["transfer_auth"]["authenticated_fetch_ok"] == 1


def test_calibration_replaced_or_mismatched(world):
    ledger = Ledger()
    scenario_calibration(world, ledger)
    clean(ledger, "calibration")


def test_host_allocation_failure_and_rlimit(world):
    ledger = Ledger()
    scenario_host_alloc(world, ledger, 5)
    clean(ledger, "host_alloc", all_detected=False)
    assert ledger.kinds["host_alloc"]["faults_detected"] == ledger.kinds["host_alloc"]["faults_injected"]


@pytest.mark.parametrize("lossless", [True, False], ids=["lossless", "lossy"])
def test_soak_concurrent_multi_turn(world, lossless):
    """Concurrent clients, multi-turn, host and disk tiers small enough to evict/demote/promote constantly: every
    restored block equals its reference (bit-exact lossless; the codec's own decode of its blob, lossy); tiers stay
    within capacity and memory stops growing."""
    ledger = Ledger()
    scenario_soak(world, ledger, 5.0, 4, lossless)
    kind = "soak_lossless" if lossless else "soak_lossy"
    clean(ledger, kind, all_detected=False)
    d = ledger.details[kind]
    assert d["restores"] >= 20 and d["blocks_restored"] >= 100
    assert d["tiers_within_capacity"] and d["rss_growth_mb_after_quarter"] < 128
    assert d["onboard_disk_hits"] > 0 and d["disk_demotions"] > 0
    if not lossless:
        assert d["blocks_unverified"] <= d["distinct_blocks_served"] // 10


def test_cross_tenant_lookups_always_miss(world):
    """The same tokens stored under one tenant (cache salt, LoRA adapter or multimodal input) and asked for under six
    others (another salt, another adapter id, another image, the plain request): every lookup misses; the owner's
    restore is bit-exact."""
    ledger = Ledger()
    scenario_tenant_keys(world, ledger, rounds=3)
    clean(ledger, "tenant_keys")
    assert ledger.kinds["tenant_keys"]["faults_injected"] == 18
    assert ledger.details["tenant_keys"]["owner_restores_ok"] == 3
