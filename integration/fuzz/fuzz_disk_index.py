"""atheris: the disk tier's index records, the way recovery and reads see them.

Each input is written as a committed-looking file (``<id>.kvtc``) into a fresh directory next to one intact blob;
then a DiskTier starts over the directory (recovery) and reads every adopted id. Invariants: recovery never raises;
the intact blob is always adopted and read back exactly; a damaged file is either not adopted or its read raises
``TierError``; anything read back for the fuzzed id is exactly a blob whose CRC matches its own record. Each input
also runs re-signed (common.resign_disk_file) to get past the checksums.
"""

import os
import shutil
import sys
import tempfile
import zlib

import atheris

with atheris.instrument_imports(include=["dynamo_kvtc"]):
    from dynamo_kvtc.errors import TierError
    from dynamo_kvtc.tiers import DiskTier, disk_format
    from dynamo_kvtc.transport.nixl_io import NixlFiles

from common import resign_disk_file  # noqa: E402

IO = None
ROOT = None
GOOD = b"intact blob " * 50
FUZZ_ID = "f" * 32
GOOD_ID = "a" * 32


def TestOneInput(data: bytes) -> None:
    for raw in (data, resign_disk_file(data)):
        d = os.path.join(ROOT, "g3")
        shutil.rmtree(d, ignore_errors=True)
        t = DiskTier(d, 1 << 26, io=IO, fsync=False)
        t.put(GOOD_ID, GOOD, {"hashes": [1]})
        t.close()
        with open(os.path.join(d, FUZZ_ID + ".kvtc"), "wb") as f:
            f.write(raw)
        t = DiskTier(d, 1 << 26, io=IO, fsync=False)
        try:
            assert t.get(GOOD_ID)[0] == GOOD
            if FUZZ_ID in t:
                try:
                    blob, _ = t.get(FUZZ_ID)
                except TierError:
                    continue
                m = disk_format.parse_record(raw[16 : 16 + int.from_bytes(raw[8:12], "little")])
                assert zlib.crc32(blob) == m["crc"] and len(blob) == m["len"]
        finally:
            t.close()
        try:
            disk_format.parse_record(raw)
        except TierError:
            pass


def main() -> None:
    global IO, ROOT
    IO = NixlFiles()
    ROOT = tempfile.mkdtemp(prefix="kvtc-fuzz-disk-")
    if "--write-seeds" in sys.argv:
        out = sys.argv[sys.argv.index("--write-seeds") + 1]
        os.makedirs(out, exist_ok=True)
        d = os.path.join(ROOT, "seed")
        t = DiskTier(d, 1 << 26, io=IO, fsync=False)
        t.put(FUZZ_ID, b"some blob bytes" * 20, {"hashes": [1, 2, 3], "cal": "x" * 32})
        t.close()
        shutil.copy(os.path.join(d, FUZZ_ID + ".kvtc"), os.path.join(out, "seed-0.kvtc"))
        return
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
