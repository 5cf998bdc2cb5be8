"""One process holding NIXL's UCX agents (a READ between two of them) and Mooncake Store's client (put/get against
a real master), the way an engine with the pool tier does. Prints one JSON line; the test checks it and the exit
status (two copies of libnl in one process died with SIGSEGV at exit). argv: master, metadata server, order
("nixl-first" or "pool-first")."""

import json
import os
import sys

import torch

from dynamo_kvtc.tiers import mooncake_lib
from dynamo_kvtc.transport.nixl_io import PeerAgent, Quarantine, read_descs


def nixl() -> tuple[bool, object]:
    src, dst = PeerAgent("UCX", "native-src"), PeerAgent("UCX", "native-dst")
    data = torch.arange(1 << 20, dtype=torch.int32)
    got = torch.zeros_like(data)
    regs = [src.agent.register_memory(data), dst.agent.register_memory(got)]
    n = data.numel() * data.element_size()
    with dst.lock:
        dst.add_remote(src.name, src.metadata())
        read_descs(dst, [(got.data_ptr(), n, 0)], "DRAM", [(data.data_ptr(), n, 0)], "DRAM", src.name, 30.0,
                   buf=got, quarantine=Quarantine())  # fmt: skip
    return bool(torch.equal(got, data)), (src, dst, regs)


def pool(master: str, metadata: str) -> tuple[bool, object]:
    store = mooncake_lib.load().MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, 64 << 20, 16 << 20, "tcp", "", master)
    value = os.urandom(4 << 20)
    ok = rc == 0 and store.put("native/k", value) == 0 and store.get("native/k") == value
    return ok, store


def main() -> None:
    master, metadata, order = sys.argv[1:4]
    if order == "nixl-first":  # both kept alive until exit: the libraries' destructors run with both in use
        (nixl_ok, held_nixl), (pool_ok, held_pool) = nixl(), pool(master, metadata)
    else:
        (pool_ok, held_pool), (nixl_ok, held_nixl) = pool(master, metadata), nixl()
    libs = [line.split()[-1] for line in open("/proc/self/maps") if "libnl" in line or "libibverbs" in line]
    print(json.dumps({"nixl": nixl_ok, "pool": pool_ok, "libs": sorted({os.path.basename(p) for p in libs})}))
    sys.stdout.flush()
    del held_nixl, held_pool


if __name__ == "__main__":
    main()
