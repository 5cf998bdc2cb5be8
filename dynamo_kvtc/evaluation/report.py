"""Write an evaluation: ``results.json`` (every record), ``results.md`` (the table) and ``ratio_accuracy.png``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

COLUMNS = [
    ("ppl_dnll_pct", "ΔNLL %"),
    ("ppl", "KL"),
    ("ppl_top1", "top-1 agree"),
    ("passkey", "passkey"),
    ("copy", "copy acc"),
    ("kv", "KV retr."),
    ("vt", "VT"),
    ("mkey", "multi-key"),
    ("mvalue", "multi-value"),
    ("gen", "greedy agree (tokens)"),
    ("gen_exact", "exact first N"),
]


def _fmt(v: Any, se: Any = None, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    s = f"{v:.{digits}f}"
    if se is not None and not (isinstance(se, float) and math.isnan(se)):
        s += f" ± {se:.{digits}f}"
    return s


def markdown(summary: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    present = [(k, t) for k, t in COLUMNS if any(k in r for r in summary)]
    head = ["method", "ratio (paper)", "range", "ratio incl. window"] + [t for _, t in present]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary:
        rng = f"{r['ratio_min']:.1f}–{r['ratio_max']:.1f}" if r.get("ratio_min") else "–"
        cells = [r["method"], _fmt(r.get("ratio"), digits=2), rng, _fmt(r.get("ratio_with_window"), digits=2)]
        for k, _ in present:
            cells.append(_fmt(r.get(k), r.get(f"{k}_se"), digits=2 if k == "ppl_dnll_pct" else 3))
        lines.append("| " + " | ".join(cells) + " |")
    counts = {
        k: next((r.get(f"{k}_n") for r in summary if r.get(f"{k}_n")), 0)
        for k in ("ppl", "passkey", "copy", "kv", "vt", "gen", "mkey", "mvalue")
    }
    notes = [
        "",
        f"Model `{meta.get('model')}`, calibration `{meta.get('calibration_id', '')[:12]}`, "
        f"preset `{meta.get('preset')}`, "
        f"{meta.get('seconds', 0):.0f} s on {meta.get('machine', {}).get('cpus')} CPUs.",
        "Samples per task: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v) + ". Values are mean ± standard "
        "error over samples (ΔNLL, KL and top-1 agreement are per-sample means over 128 scored tokens; copy accuracy "
        "is the share of a repeated passage's tokens predicted exactly; greedy agree is how many of a reply's first "
        "greedy tokens equal vanilla's, exact first N the share of replies identical to vanilla's).",
        "Ratio (paper): compressed tokens only (window excluded, kvtc's sinks included); incl. window: every token.",
    ]
    return "\n".join(lines + notes) + "\n"


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        (k, t)
        for k, t in (
            ("copy", "copy-retrieval accuracy"),
            ("ppl", "next-token KL vs vanilla"),
            ("passkey", "passkey accuracy"),
            ("mkey", "RULER multi-key accuracy"),
            ("gen", "greedy agreement with vanilla (tokens)"),
        )
        if any(k in r for r in summary)
    ]
    if not metrics:
        return
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], metrics):
        kv = [r for r in summary if r["family"] == "kvtc" and r.get("ratio") and key in r]
        kv_main = sorted(
            [r for r in kv if r["method"].endswith("x") and r["method"].startswith("kvtc-")], key=lambda r: r["ratio"]
        )
        if kv_main:
            ax.errorbar(
                [r["ratio"] for r in kv_main],
                [r[key] for r in kv_main],
                yerr=[0 if math.isnan(r.get(f"{key}_se", float("nan"))) else r[f"{key}_se"] for r in kv_main],
                marker="o",
                label="kvtc",
                color="tab:green",
            )
            for r in kv_main:
                ax.annotate(
                    r["method"].replace("kvtc-", ""),
                    (r["ratio"], r[key]),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=8,
                )
        for r in summary:
            if r in kv_main or key not in r:
                continue
            x = r.get("ratio") or 1.0
            ax.scatter([x], [r[key]], marker="s" if r["family"] != "kvtc" else "^")
            ax.annotate(r["method"], (x, r[key]), textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("compression ratio (paper accounting)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out: Path, result: dict[str, Any], meta: dict[str, Any]) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "results.json", "markdown": out / "results.md", "plot": out / "ratio_accuracy.png"}
    files["json"].write_text(json.dumps({"meta": meta, **result}, indent=1, default=float) + "\n")
    files["markdown"].write_text(markdown(result["summary"], meta))
    plot(result["summary"], files["plot"])
    return files
