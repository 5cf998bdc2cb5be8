"""One strict round trip through the fused GPU path against the reference path (``run.sh gpu`` runs it first).

Stops with an assertion, before the benchmark spends its minutes, if the Triton kernels did not load or disagree with
the reference decode by more than 5%. The fused codec runs strict (a kernel failure raises instead of falling back to
the torch twin or the reference path).

    python integration/gpu/fused_smoke.py [--device cuda]
"""

from __future__ import annotations

import argparse
import time

from dynamo_kvtc import KvtcCodec
from dynamo_kvtc.calibration.synthetic import synthetic_calibration, synthetic_kv
from dynamo_kvtc.codec.options import CodecOptions


def _rel(a, x) -> float:
    """Relative error over the coded tokens (sinks and the raw window excluded)."""
    return float((a.float() - x.float())[:, 4:-128].norm() / x.float()[:, 4:-128].norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    dev = ap.parse_args().device
    t0 = time.time()
    cal = synthetic_calibration(8, 4, 64, theta=1e4, ratios=(16,), rank=512, dp_rows=1024, device=dev)
    k, v, pos = synthetic_kv(cal, 1000, device=dev)
    ref = KvtcCodec(cal, ratio=16, device=dev, tag="deflate", fused=False)
    tag = "ans" if dev != "cpu" else "deflate"
    fus = KvtcCodec(cal, ratio=16, device=dev, tag=tag, fused=True, options=CodecOptions(fused_strict=True))
    kf, vf = fus.decode(fus.encode(k, v, pos))
    kr, vr = ref.decode(ref.encode(k, v, pos))
    print(
        f"fused smoke ok in {time.time() - t0:.1f} s: ops={fus.fused.ops.name}, rel err K fused {_rel(kf, k):.4f} vs "
        f"reference {_rel(kr, k):.4f}, V {_rel(vf, v):.4f} vs {_rel(vr, v):.4f}, "
        f"nvCOMP decode {fus.fused.entropy.decode_mode!r}"
    )
    assert dev == "cpu" or (fus.fused.ops.name == "triton" and not fus.fused.kernel_errors), fus.fused.kernel_errors
    assert abs(_rel(kf, k) - _rel(kr, k)) < 0.05 * _rel(kr, k) + 1e-3


if __name__ == "__main__":
    main()
