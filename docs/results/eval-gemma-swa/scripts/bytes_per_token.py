"""Stored bytes per token of each method in an eval's results.json, next to the raw tiers (Gemma-3-270M: K+V bf16,
1 KV head x 256 dims, 18 layers of which 15 hold only their last 511 tokens).

    python bytes_per_token.py RESULTS.json
"""

import json
import sys
from collections import defaultdict

LAYERS, SLIDING, WINDOW, PER_LAYER_TOKEN = 18, 15, 511, 2 * 256 * 2


def raw_all(t):  # every layer keeps every token
    return LAYERS * PER_LAYER_TOKEN * t


def raw_window(t):  # sliding layers keep only their window (what vLLM's hybrid manager keeps)
    return ((LAYERS - SLIDING) * t + SLIDING * min(t, WINDOW)) * PER_LAYER_TOKEN


d = json.load(open(sys.argv[1]))
rows = defaultdict(lambda: defaultdict(list))
for r in d["records"]:
    t = r["tokens"]
    rows[r["method"]][r.get("length")].append(raw_window(t) / r["ratio_with_window"] / t)
print("| method | " + " | ".join(f"{n} tokens" for n in sorted(next(iter(rows.values())))) + " |")
for m, by in rows.items():
    print(f"| {m} | " + " | ".join(f"{sum(v) / len(v):.0f}" for _, v in sorted(by.items())) + " |")
for n in (2048, 4096, 8000):
    print(
        f"at {n}: raw, every layer every token: {raw_all(n) / n:.0f} B/token; "
        f"raw, window-only: {raw_window(n) / n:.0f} B/token"
    )
