"""A calibration replaced or mismatched under a running store."""

from __future__ import annotations

import shutil
import struct
import zlib

from ..calibration.artifact import Calibration
from ..errors import CalibrationError, DecodeError
from ..tiers import KvtcStore, disk_format
from ..transport.channel import pack, unpack
from .ledger import Ledger
from .testbed import (
    BS,
    SPAN,
    Expect,
    World,
    check_blobs,
    close_store,
    committed_blobs,
    make_calibration,
    make_store,
    offload,
    restore,
    tier_config,
)


# ====================================================================================================== calibration
def scenario_calibration(world: World, ledger: Ledger) -> None:
    """A calibration replaced or mismatched under a running store: another calibration's blobs on disk (restart with
    a new calibration, and a forged index record claiming ours), calibration files replaced underneath a running
    store, and a peer that sends blobs of another calibration."""
    kind = "calibration"
    other = make_calibration(world.seed + 1)
    d = world.fresh_dir("cal")
    cal_path = world.fresh_dir("cal-files")
    world.cal.save(cal_path)
    store_b = store = None
    try:
        # a store loaded from files that are then replaced under it: it keeps serving what it holds
        store = KvtcStore(
            Calibration.load(cal_path), tier_config(True, 0, 64 << 20, d), block_size=BS, span_tokens=SPAN
        )
        expect = Expect(world, True)
        committed: dict[str, tuple[list[int], int]] = {}
        for s in range(3):
            _, res = offload(world, store, world.tokens(("cal", s), (5 + s) * BS))
            committed.update(committed_blobs(store, res.blobs))
        tmp = world.fresh_dir("cal-other")
        other.save(tmp)
        shutil.copyfile(tmp / "tensors.safetensors", cal_path / "tensors.safetensors")  # tensors of another model
        ledger.add(kind, faults_injected=1)
        ledger.detail(kind, tensors_replaced_under_running_store=1)
        check_blobs(ledger, kind, world, store, expect, committed, set())  # the running store is unaffected
        try:
            Calibration.load(cal_path)
            ledger.problem(kind, "a calibration with replaced tensors loaded without complaint")
        except CalibrationError:
            ledger.add(kind, faults_detected=1)
        close_store(store)
        store = None
        # the whole calibration replaced: the restarted store must not serve the old blobs
        shutil.rmtree(cal_path)
        shutil.copytree(tmp, cal_path)
        store_b = KvtcStore(
            Calibration.load(cal_path), tier_config(True, 0, 64 << 20, d), block_size=BS, span_tokens=SPAN
        )
        ledger.add(kind, faults_injected=1)
        ledger.detail(kind, calibration_replaced_then_restart=1)
        served = sum(store_b.match(h) for h, _ in committed.values())
        if served:
            ledger.problem(kind, f"{served} blocks of another calibration offered after a restart")
        else:
            ledger.add(kind, faults_detected=1, recomputes=len(committed))
        ledger.detail(kind, foreign_blobs_not_adopted=store_b.stats.tier("disk").foreign_blobs)
        close_store(store_b)
        store_b = None
        # a forged index record: a blob of calibration A whose disk metadata claims calibration B
        target = sorted(committed)[0]
        path = d / f"{target}.kvtc"
        data = path.read_bytes()
        mlen = struct.unpack_from("<I", data, 8)[0]
        m = unpack(data[16 : 16 + mlen], disk_format.RECORD_LIMITS, what="index record")
        m["meta"]["cal"] = other.id
        mb = pack(m)
        path.write_bytes(struct.pack("<8sII", disk_format.MAGIC, len(mb), zlib.crc32(mb)) + mb + data[16 + mlen :])
        store_b = KvtcStore(other, tier_config(True, 0, 64 << 20, d), block_size=BS, span_tokens=SPAN)
        ledger.add(kind, faults_injected=1)
        ledger.detail(kind, forged_index_record=1)
        out = restore(world, store_b, committed[target][0])
        if out.ok:
            ledger.add(kind, wrong_kv_served=len(committed[target][0]))
            ledger.problem(kind, "a blob of another calibration was decoded and served")
        elif isinstance(out.error, DecodeError):
            ledger.add(kind, faults_detected=1, recomputes=1)
        else:
            ledger.problem(kind, f"forged record refused, but not by the decoder: {out.error}")
            ledger.add(kind, faults_detected=1, recomputes=1)
        # a peer of another calibration: its blobs arrive through the transfer path and must be refused
        store_a = make_store(world, True, host=16 << 20)
        try:
            toks = world.tokens(("cal", "peer"), 6 * BS)
            hashes, _ = offload(world, store_a, toks)
            ledger.add(kind, faults_injected=1)
            ledger.detail(kind, peer_with_other_calibration=1)
            out = restore(world, store_b, hashes, source=lambda: store_a.export(hashes)[0])
            if out.ok:
                ledger.add(kind, wrong_kv_served=len(hashes))
                ledger.problem(kind, "a peer's blob of another calibration was served")
            else:
                ledger.add(kind, faults_detected=int(isinstance(out.error, DecodeError)), recomputes=1)
        finally:
            close_store(store_a)
    finally:
        for s in (store, store_b):
            if s is not None:
                close_store(s)
        shutil.rmtree(d, ignore_errors=True)
