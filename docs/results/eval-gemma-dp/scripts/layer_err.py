import sys
import time

from dynamo_kvtc.calibration.artifact import Calibration
from dynamo_kvtc.calibration.data import heldout_texts
from dynamo_kvtc.calibration.models import capture_kv, load_model
from dynamo_kvtc.codec.kvtc import KvtcCodec

t = time.time()
m, tok = load_model("gemma3-270m")

cal = Calibration.load(sys.argv[1])
ids = tok(heldout_texts()[1], return_tensors="pt", add_special_tokens=False)["input_ids"][0][:2048]
k, v, pos = capture_kv(m, ids)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


for r in (8, 16, 32):
    c = KvtcCodec(cal, ratio=r)
    blob = c.encode(k, v, pos)
    out = c.decode_ragged(blob)
    T = k.shape[1]
    rows = []
    for l, (kk, vv) in enumerate(out):
        a = T - kk.shape[0]
        rows.append(
            (
                l,
                round(rel(kk[4:-128] if a == 0 else kk[:-128], k[l, a:][4:-128] if a == 0 else k[l, a:][:-128]), 3),
                round(rel(vv[4:-128] if a == 0 else vv[:-128], v[l, a:][4:-128] if a == 0 else v[l, a:][:-128]), 3),
            )
        )
    full = [x for x in rows if x[0] % 6 == 5]
    slide = [x for x in rows if x[0] % 6 != 5]
    print(
        r,
        "ratio",
        round(c.stats(blob)["ratio"], 2),
        "full K/V",
        full,
        "sliding mean K/V",
        round(sum(x[1] for x in slide) / 15, 3),
        round(sum(x[2] for x in slide) / 15, 3),
        flush=True,
    )
print(time.time() - t)
