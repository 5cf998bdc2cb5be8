"""What ``run.sh`` writes into env.txt about Python: versions, which optional packages import, the fused path's state.

Prints ``IMPORTS OK`` last when torch and the package import (the runner stops without it).
"""

from __future__ import annotations

import sys

import torch

print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda, "| gpus",
      torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")  # fmt: skip
OPTIONAL = (("triton", "__version__"), ("nvidia.nvcomp", "__version__"), ("nixl_cu13", None), ("zmq", "__version__"),
            ("cryptography", "__version__"))
for mod, attr in OPTIONAL:
    try:
        m = __import__(mod, fromlist=["_"])
        print(f"{mod} {getattr(m, attr, '?') if attr else 'ok'}")
    except Exception as e:  # noqa: BLE001 - a missing optional package is a line, not a failure
        print(f"{mod} absent ({type(e).__name__})")

try:  # the pool tier's client, loaded beside NIXL's libraries as the tier loads it
    from dynamo_kvtc.tiers import mooncake_lib

    mooncake_lib.load()
    print("mooncake.store ok")
except Exception as e:  # noqa: BLE001
    print(f"mooncake.store absent ({type(e).__name__}: {str(e)[:160]})")

from dynamo_kvtc.codec.gpu import fused_status  # noqa: E402 - after the optional packages' lines
from dynamo_kvtc.tiers.config import process_settings  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
print("fused", fused_status(dev), "| GPU entropy default", process_settings()["codec"].gpu_tag)
print("IMPORTS OK")
