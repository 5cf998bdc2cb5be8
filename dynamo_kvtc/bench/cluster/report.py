"""Plots of ``bench cluster``: hit rate by source and TTFT per system, one panel per (workload, router)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot", "table"]

SOURCES = (("hbm", "HBM"), ("local", "own tier"), ("pool", "pool"))
COLORS = {"hbm": "#4c72b0", "local": "#55a868", "pool": "#c44e52"}


def table(runs: list[dict[str, Any]]) -> str:
    """A markdown table of every run: hit rate by source, TTFT, network."""
    head = ("| workload | N | router | system | hit | HBM | own tier | pool | TTFT mean s | TTFT p99 s | "
            "net GB/s/worker | net B/restored token |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        h = r["hit_by_source"]
        net = r.get("network", {})
        bpt = net.get("bytes_per_restored_token")
        lines.append(
            f"| {r['workload']} | {r['workers']} | {r['router']} | {r['system']} | {r['hit_rate']:.3f} | "
            f"{h['hbm']:.3f} | {h['local']:.3f} | {h['pool']:.3f} | {r['ttft_s']['mean']:.3f} | "
            f"{r['ttft_s']['p99']:.3f} | {net.get('gbps_per_worker', 0):.3f} | "
            f"{'-' if bpt is None else f'{bpt:,.0f}'} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: str) -> str | None:
    """Write ``path`` (hit rate by source, stacked) and ``<path stem>-ttft.png`` (TTFT mean and p99); a message
    instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    panels = sorted({(r["workload"], r["router"]) for r in runs})
    systems = list(dict.fromkeys(r["system"] for r in runs))
    workers = sorted({r["workers"] for r in runs})
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)

    def grid():
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
        return fig, axes[0]

    fig, axes = grid()
    width = 0.8 / max(1, len(systems))
    for ax, (wl, router) in zip(axes, panels):
        for j, s in enumerate(systems):
            for k, n in enumerate(workers):
                r = next((x for x in runs if (x["workload"], x["router"], x["system"], x["workers"]) ==
                          (wl, router, s, n)), None)  # fmt: skip
                if r is None:
                    continue
                x, bottom = k + (j - (len(systems) - 1) / 2) * width, 0.0
                for src, label in SOURCES:
                    v = r["hit_by_source"][src]
                    ax.bar(x, v, width * 0.9, bottom=bottom, color=COLORS[src],
                           label=label if (j, k) == (0, 0) else None)  # fmt: skip
                    bottom += v
                ax.text(x, bottom + 0.01, s, rotation=90, ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(workers)), [f"N={n}" for n in workers])
        ax.set_ylim(0, 1.35)
        ax.set_ylabel("prompt tokens served from cache")
        ax.set_title(f"{wl}, {router}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("bench cluster: hit rate by source (equal memory per worker)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)

    fig, axes = grid()
    for ax, (wl, router) in zip(axes, panels):
        for s in systems:
            rs = sorted((x for x in runs if (x["workload"], x["router"], x["system"]) == (wl, router, s)),
                        key=lambda x: x["workers"])  # fmt: skip
            if not rs:
                continue
            line = ax.plot([x["workers"] for x in rs], [x["ttft_s"]["mean"] for x in rs], "o-", label=f"{s} mean")
            ax.plot([x["workers"] for x in rs], [x["ttft_s"]["p99"] for x in rs], "x--", color=line[0].get_color(),
                    label=f"{s} p99")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_ylabel("TTFT, s")
        ax.set_title(f"{wl}, {router}", fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle("bench cluster: time to first token")
    fig.tight_layout()
    fig.savefig(out.with_name(out.stem + "-ttft.png"), dpi=110)
    plt.close(fig)
    return None
