"""atheris: the control messages of the lookup and transfer channels (msgpack, never pickle).

Invariants: ``transfer._unpack`` / ``lookup._unpack`` return a dict or raise ``TransferError``; a fetch reply either
is refused by ``TransferClient._plan`` with ``TransferError`` or yields runs that tile exactly the requested blocks,
name them in the blob metadata, and whose descriptors add up to each blob's size. Nothing else escapes.
"""

import sys

import atheris

with atheris.instrument_imports(include=["dynamo_kvtc"]):
    from dynamo_kvtc.connector import lookup, transfer
    from dynamo_kvtc.errors import TransferError

REQUESTED = [11, 22, 33, 44]


def TestOneInput(data: bytes) -> None:
    for unpack in (transfer._unpack, lookup._unpack):
        try:
            msg = unpack(data)
        except TransferError:
            continue
        assert isinstance(msg, dict)
        try:
            runs, remote, spans = transfer.TransferClient._plan(msg, REQUESTED)
        except TransferError:
            continue
        j = 0
        for (first, count, jj, meta), (_, size) in zip(runs, spans):
            assert jj == j and meta["hashes"][first : first + count] == REQUESTED[j : j + count] and size > 0
            j += count
        assert j == len(REQUESTED) and sum(n for _, n, _ in remote) == sum(n for _, n in spans)


def main() -> None:
    if "--write-seeds" in sys.argv:
        import os

        import msgpack

        out = sys.argv[sys.argv.index("--write-seeds") + 1]
        os.makedirs(out, exist_ok=True)
        blob = {"size": 100, "first": 0, "count": 4, "j": 0, "meta": {"hashes": REQUESTED}, "descs": [[4096, 100]]}
        seeds = [
            {"lease": "p/1", "agent": "kvtc-prefill-1", "agent_md": b"md", "blobs": [blob]},
            {"op": "match", "hashes": REQUESTED},
            {"op": "fetch", "hashes": REQUESTED, "agent": "kvtc-decode-1", "agent_md": b"md"},
        ]
        for i, s in enumerate(seeds):
            with open(os.path.join(out, f"seed-{i}.msgpack"), "wb") as f:
                f.write(msgpack.packb(s, use_bin_type=True))
        return
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
