"""Per-method means of eval records at some lengths: compare.py 2048,4096 RESULTS.json (one file per vanilla)."""

import json
import statistics as st
import sys

LENS = [int(x) for x in sys.argv[1].split(",")]
files = sys.argv[2:]
rows = []
for f in files:
    tag = f.split("/")[-2]
    for r in json.load(open(f))["records"]:
        if r["length"] in LENS:
            rows.append((tag, r))


van = {}
for _tag, r in rows:
    if r["method"] == "vanilla" and r["task"] == "ppl":
        van[(r["length"])] = r["nll"]
out = {}
for tag, r in rows:
    m = (tag, r["method"])
    o = out.setdefault(m, {"ratio": [], "kl": [], "dnll": [], "top1": [], "passkey": [], "pk": []})
    if r["task"] == "ppl":
        o["ratio"].append(r["ratio"])
        o["kl"].append(r["kl"])
        o["top1"].append(r["top1_agreement"])
        o["dnll"].append(100 * (r["nll"] - van[r["length"]]) / van[r["length"]])
    elif r["task"] == "passkey":
        o["passkey"].append(r.get("accuracy", r.get("correct", 0)))
        o["pk"].append((r["length"], r.get("depth"), r.get("accuracy")))
        o["ratio"].append(r["ratio"])


def f(x):
    return round(st.mean(x), 4) if x else None


for m, o in out.items():
    print(
        m,
        "ratio",
        f(o["ratio"]),
        "dNLL%",
        f(o["dnll"]),
        "KL",
        f(o["kl"]),
        "top1",
        f(o["top1"]),
        "passkey",
        sum(o["passkey"]),
        "/",
        len(o["passkey"]),
        o["pk"],
    )
