"""The FP8-KV full-preset run next to the bf16 full-preset run (docs/results/eval-full), sample by sample.

Both runs build the same samples (same preset, same seed), so records match on (task, length, depth). Prints each
perplexity window's ΔNLL % against the FP8 vanilla, against the bf16 vanilla and the bf16 run's own ΔNLL %, then every
passkey and copy sample of both runs.

    python scripts/compare_bf16.py results.json ../eval-full/results.json
"""

import json
import math
import statistics
import sys


def key(r):
    return (r["task"], r["length"], r.get("depth"))


def index(d):
    return {(key(r), r["method"]): r for r in d["records"]}


def mean_se(xs):
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return statistics.fmean(xs), se


def main(fp8_path, bf16_path):
    F, B = index(json.load(open(fp8_path))), index(json.load(open(bf16_path)))
    methods = sorted({m for _, m in F}, key=lambda m: (m != "vanilla", m))
    print("perplexity windows: ΔNLL % vs FP8 vanilla | vs bf16 vanilla | bf16 run vs bf16 vanilla; KL fp8 | bf16")
    for m in methods:
        cols = ([], [], [])
        for k in sorted(k for k, mm in F if mm == m and k[0] == "ppl"):
            r, fv, bv = F[(k, m)], F[(k, "vanilla")]["nll"], B[(k, "vanilla")]["nll"]
            vals = (100 * (r["nll"] - fv) / fv, 100 * (r["nll"] - bv) / bv, 100 * (B[(k, m)]["nll"] - bv) / bv)
            for c, v in zip(cols, vals):
                c.append(v)
            print(
                f"{m:9s} {k[1]:5d}  {vals[0]:+.3f} | {vals[1]:+.3f} | {vals[2]:+.3f}   "
                f"KL {r['kl']:.4f} | {B[(k, m)]['kl']:.4f}   ratio vs FP8 {r['ratio']:.2f}"
            )
        print(f"{m:9s} mean   " + " | ".join("{:+.3f} ± {:.3f}".format(*mean_se(c)) for c in cols))
    print("\npasskey and copy: accuracy fp8 run | bf16 run, the fp8 run's reply")
    for k in sorted({k for k, _ in F if k[0] != "ppl"}):
        for m in methods:
            r = F[(k, m)]
            acc = f"{r['accuracy']:.3f} | {B[(k, m)]['accuracy']:.3f}"
            print(k, f"{m:9s}", acc, repr(r.get("output", "")))


if __name__ == "__main__":
    main(*sys.argv[1:3])
