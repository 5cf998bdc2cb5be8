"""atheris: the blob container parser and the decoder (``parse_blob``, ``KvtcCodec.decode``).

Invariant: any input either decodes or raises ``DecodeError``; nothing else escapes, nothing hangs, memory stays
bounded (run with -rss_limit_mb). Each input runs as given and with its CRCs re-signed (common.resign_blob), so the
fuzzer reaches the semantic checks behind the checksums.
"""

import sys

import atheris

with atheris.instrument_imports(include=["dynamo_kvtc"]):
    from dynamo_kvtc.codec.container import parse_blob
    from dynamo_kvtc.errors import CorruptBlobError, DecodeError

from common import codec, resign_blob, seed_blobs  # noqa: E402

CODEC = None


def TestOneInput(data: bytes) -> None:
    for blob in (data, resign_blob(data)):
        try:
            parse_blob(blob)
        except CorruptBlobError:
            pass
        try:
            k, v = CODEC.decode(blob)
        except DecodeError:
            continue
        assert k.shape == v.shape and k.dim() == 4


def main() -> None:
    global CODEC
    CODEC = codec()
    if "--write-seeds" in sys.argv:
        import os

        out = sys.argv[sys.argv.index("--write-seeds") + 1]
        os.makedirs(out, exist_ok=True)
        for i, b in enumerate(seed_blobs()):
            with open(os.path.join(out, f"seed-{i}.kvtc"), "wb") as f:
                f.write(b)
        return
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
