"""atheris: the control messages of the lookup and transfer channels (msgpack, never pickle).

Invariants: ``tiers.channel.unpack`` under the hand-off's and the lookup's limits returns a dict or raises
``TransferError``; a fetch request is accepted by ``handoff.messages.check_fetch`` only when well-formed; a fetch
reply either is refused by ``handoff.messages.plan_reply`` with ``TransferError`` or yields runs that tile exactly
the requested blocks, name them in the blob metadata, keep (``meta``) only the requested hashes, and whose
descriptors add up to each blob's size. Nothing else escapes.
"""

import sys

import atheris

with atheris.instrument_imports(include=["dynamo_kvtc"]):
    from dynamo_kvtc.connector.handoff import messages
    from dynamo_kvtc.connector.vllm import lookup
    from dynamo_kvtc.errors import TransferError
    from dynamo_kvtc.transport import channel

REQUESTED = [11, 22, 33, 44]


def TestOneInput(data: bytes) -> None:
    for limits in (messages.LIMITS, lookup.LIMITS):
        try:
            msg = channel.unpack(data, limits)
        except TransferError:
            continue
        assert isinstance(msg, dict)
        try:  # a sealed envelope opens only with the right MAC
            channel.Auth(b"fuzz-secret-0123456789").open_request(msg)
            raise AssertionError("a fuzzed message opened as an authenticated request")
        except TransferError:
            pass
        try:
            hashes, peer, md = messages.check_fetch(msg)
            assert 0 < len(hashes) <= messages.MAX_FETCH_BLOCKS and messages.peer_ok(peer, md)
        except TransferError:
            pass
        try:
            runs, remote = messages.plan_reply(msg, REQUESTED)
        except TransferError:
            continue
        j = offset = 0
        for r, b in zip(runs, msg["blobs"]):
            assert r.at == j and b["meta"]["hashes"][r.first : r.first + r.count] == REQUESTED[j : j + r.count]
            assert r.meta is None or (r.meta["hashes"] == REQUESTED[j : j + r.count] and r.first == 0)  # kept: ours
            assert r.size > 0 and r.offset == offset
            j += r.count
            offset += r.size
        assert j == len(REQUESTED) and sum(n for _, n, _ in remote) == offset


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
