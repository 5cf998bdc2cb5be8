"""The table of ``run.sh compare``: medians of the old tree's and the new tree's ``bench gpu`` runs, side by side.

    python integration/gpu/compare_table.py DIR [OLD_TREE]

DIR holds ``old-1.json``, ``new-1.json``, ``old-2.json``, ... (one ``bench gpu --json`` each, run alternately in one
device call). For the first configuration of each run it reads the restore, TTFT, decompress and compress times and
prints, per metric, every run's value, each side's median and spread (min-max), and new/old of the medians; it also
writes ``compare.json`` (the same numbers) into DIR. The last column says whether the two sides' min-max ranges
overlap: "yes" on every row is what "within noise of the one before" means here.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

METRICS = [  # (label, path in the config's result, lower is better)
    ("kvtc TTFT ms", ("kvtc_restore", "ttft_ms")),
    ("kvtc restore first layer ms", ("kvtc_restore", "first_layer_ms")),
    ("kvtc restore all layers ms", ("kvtc_restore", "all_layers_ms")),
    ("decompress GPU ms", ("kvtc_restore", "decompress_gpu_ms")),
    ("compress GPU ms", ("compress", "gpu_ms")),
    ("compress wall ms", ("compress", "wall_ms")),
    ("raw restore all layers ms", ("raw_restore", "all_layers_ms")),
    ("recompute TTFT ms", ("recompute", "ttft_ms")),
]


def _get(cfg: dict, path: tuple[str, ...]):
    for k in path:
        if not isinstance(cfg, dict) or k not in cfg:
            return None
        cfg = cfg[k]
    return cfg if isinstance(cfg, (int, float)) else None


def load(d: Path) -> dict[str, list[tuple[str, dict]]]:
    runs: dict[str, list[tuple[str, dict]]] = {"old": [], "new": []}
    for f in sorted(d.glob("*.json"), key=lambda p: (p.stem.split("-")[0], int(re.sub(r"\D", "", p.stem) or 0))):
        m = re.fullmatch(r"(old|new)-(\d+)", f.stem)
        if not m:
            continue
        try:
            res = json.loads(f.read_text())
        except ValueError:
            continue
        if res.get("configs"):
            runs[m.group(1)].append((f.stem, res["configs"][0]))
    return runs


def main() -> int:
    d = Path(sys.argv[1])
    old_tree = sys.argv[2] if len(sys.argv) > 2 else "old"
    runs = load(d)
    if not runs["old"] or not runs["new"]:
        print(f"compare: no finished run on {'both sides' if not runs['old'] and not runs['new'] else 'one side'} "
              f"(old {len(runs['old'])}, new {len(runs['new'])}); see the logs in {d}")  # fmt: skip
        return 1
    first = runs["new"][0][1]
    print(f"bench gpu, {first.get('shape')} {first.get('batch')}x{first.get('tokens')}, old = {old_tree}, "
          f"new = this tree; {len(runs['old'])} old and {len(runs['new'])} new runs, alternating\n")  # fmt: skip
    names = [n for pair in zip(runs["old"], runs["new"]) for n, _ in pair]
    names += [n for n, _ in runs["old"][len(runs["new"]) :] + runs["new"][len(runs["old"]) :]]
    by_name = dict(runs["old"] + runs["new"])
    print("| metric | " + " | ".join(names) + " | old median (min-max) | new median (min-max) | new/old | overlap |")
    print("|---|" + "---|" * len(names) + "---|---|---|---|")
    out = {"old_tree": old_tree, "runs": names, "metrics": {}}
    for label, path in METRICS:
        vals = {n: _get(by_name[n], path) for n in names}
        o = [vals[n] for n, _ in runs["old"] if vals[n] is not None]
        w = [vals[n] for n, _ in runs["new"] if vals[n] is not None]
        if not o or not w:
            continue
        mo, mn = statistics.median(o), statistics.median(w)
        cells = " | ".join("-" if vals[n] is None else f"{vals[n]:.1f}" for n in names)
        overlap = max(min(o), min(w)) <= min(max(o), max(w))  # the two sides' ranges share a value
        print(f"| {label} | {cells} | {mo:.1f} ({min(o):.1f}-{max(o):.1f}) | {mn:.1f} ({min(w):.1f}-{max(w):.1f}) "
              f"| {mn / mo:.3f} | {'yes' if overlap else 'NO'} |")  # fmt: skip
        out["metrics"][label] = {
            "values": vals, "old_median": mo, "new_median": mn, "ratio": mn / mo,
            "old_range": [min(o), max(o)], "new_range": [min(w), max(w)], "overlap": overlap,
        }  # fmt: skip
    (d / "compare.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
