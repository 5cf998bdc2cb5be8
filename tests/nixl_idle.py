"""Two NIXL UCX agents built with ``progress_us``: one READs a tensor from the other, then both idle. Prints JSON:
whether the READ was exact, and the process CPU seconds over 2 s of idle. Run as a subprocess (a clean process: no
agent of another test spinning beside it). argv: progress_us."""

import json
import sys
import time

import torch

from dynamo_kvtc.transport.nixl_io import PeerAgent, Quarantine, read_descs


def main() -> None:
    us = int(sys.argv[1])
    src, dst = PeerAgent("UCX", "idle-src", progress_us=us), PeerAgent("UCX", "idle-dst", progress_us=us)
    data = torch.arange(1 << 20, dtype=torch.int32)
    got = torch.zeros_like(data)
    regs = [src.agent.register_memory(data), dst.agent.register_memory(got)]
    nbytes = data.numel() * data.element_size()
    with dst.lock:
        dst.add_remote(src.name, src.metadata())
        read_descs(dst, [(got.data_ptr(), nbytes, 0)], "DRAM", [(data.data_ptr(), nbytes, 0)], "DRAM", src.name, 30.0,
                   buf=got, quarantine=Quarantine())  # fmt: skip
    exact = bool(torch.equal(got, data))
    time.sleep(0.5)
    t = time.process_time()
    time.sleep(2.0)
    idle = time.process_time() - t
    del regs
    print(json.dumps({"exact": exact, "idle_cpu_s": idle}))


if __name__ == "__main__":
    main()
