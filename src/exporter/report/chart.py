"""``report.png``: per-variant latency (a box from the recorded quartiles) and speedup over eager (with the
range the quartiles allow), drawn with matplotlib and linked from ``report.md``.

Only figures the report holds are drawn; nothing is re-timed. The image is ``WIDTH_PX`` wide and
``HEIGHT_BASE_PX + HEIGHT_PER_ROW_PX`` per timed variant high.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .markdown import headline

FILE = "report.png"
WIDTH_PX = 1200
HEIGHT_BASE_PX = 180
HEIGHT_PER_ROW_PX = 44
DPI = 100


def timed_rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, bench) of every variant with timings, the eager baseline first."""
    rows = []
    base = report["baseline"].get("bench")
    if base and base.get("median_ms"):
        rows.append(("eager (baseline)", base))
    for variant in [*([report["rewritten"]] if report.get("rewritten") else []), *report["artifacts"]]:
        bench = variant.get("bench") or {}
        if bench.get("median_ms"):
            rows.append((variant["name"], bench))
    return rows


def size_px(rows: int) -> tuple[int, int]:
    return WIDTH_PX, HEIGHT_BASE_PX + HEIGHT_PER_ROW_PX * rows


def write_chart(report: dict[str, Any], folder: Path) -> str | None:
    """Draw the chart into ``folder``; its file name, or None when nothing was timed."""
    rows = timed_rows(report)
    if not rows:
        return None
    import matplotlib  # noqa: PLC0415 - a second or so to import: only when a chart is drawn

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    width, height = size_px(len(rows))
    fig, (latency, speedup) = plt.subplots(1, 2, figsize=(width / DPI, height / DPI), dpi=DPI, sharey=True,
                                           gridspec_kw={"width_ratios": [3, 2]})
    labels = [label for label, _ in rows][::-1]  # the baseline on top
    benches = [bench for _, bench in rows][::-1]
    stats = [{"label": label, "med": b["median_ms"], "q1": b.get("p25_ms", b["median_ms"]),
              "q3": b.get("p75_ms", b["median_ms"]), "whislo": b.get("min_ms", b["median_ms"]),
              "whishi": b.get("p90_ms", b["median_ms"]), "fliers": []} for label, b in zip(labels, benches)]
    latency.bxp(stats, orientation="horizontal", showfliers=False, widths=0.5, patch_artist=True,
                boxprops={"facecolor": "#9ecae1"}, medianprops={"color": "#08306b", "linewidth": 2})
    medians = [b["median_ms"] for b in benches]
    if max(medians) / min(medians) > 20:
        latency.set_xscale("log")
    latency.set_xlabel("ms per call (box: p25 to p75, line: median, whiskers: min to p90)")
    latency.grid(axis="x", alpha=0.3)

    positions = range(1, len(rows) + 1)
    values, colours, low_err, high_err = [], [], [], []
    baseline = rows[0][1]
    for b in benches:
        value = 1.0 if b is baseline else b.get("speedup_vs_eager") or 0.0
        low, high = b.get("speedup_range") or (value, value)
        values.append(value)
        low_err.append(max(value - low, 0.0))
        high_err.append(max(high - value, 0.0))
        supported = b.get("speedup_supported", True)
        colours.append("#636363" if b is baseline else "#bdbdbd" if not supported
                       else "#31a354" if value >= 1.0 else "#de2d26")
    speedup.barh(list(positions), values, xerr=[low_err, high_err], color=colours, height=0.5, capsize=3)
    speedup.axvline(1.0, color="black", linewidth=1)
    speedup.set_xlim(0, max(v + e for v, e in zip(values, high_err)) * 1.2)
    for y, value in zip(positions, values):
        speedup.annotate(f"{value:.2f}×", (value, y), xytext=(4, 6), textcoords="offset points", fontsize=9)
    speedup.set_xlabel("speedup over eager (error bar: from the quartiles)")
    speedup.grid(axis="x", alpha=0.3)
    speedup.legend(handles=[Patch(color="#31a354", label="faster"), Patch(color="#de2d26", label="slower"),
                            Patch(color="#bdbdbd", label="too noisy to tell (⚠)")],
                   loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, frameon=False, fontsize=8)
    title = report["model"]["name"]
    fig.suptitle(f"{title} with {report['recipe']['name']} on {report['environment']['device'].get('name')}\n"
                 f"{headline(report)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(folder / FILE, dpi=DPI)  # the size is fixed by figsize and dpi: no bbox_inches="tight"
    plt.close(fig)
    return FILE


def decode_rows(report: dict[str, Any]) -> list[tuple[str, float, float | None]]:
    """(label, batch-1 ms/token, batch-B ms/token) of every timed row of a generation report, eager first."""
    rows = []
    named = [("eager generate()", report["baseline"].get("bench"))]
    candidates = [*([report["rewritten"]] if report.get("rewritten") else []), *report["artifacts"]]
    named += [(row["name"], row.get("bench")) for row in candidates]
    for label, bench in named:
        one = ((bench or {}).get("batch_1") or {}).get("decode_best_ms")
        if isinstance(one, (int, float)) and one > 0:
            rows.append((label, one, ((bench or {}).get("batch") or {}).get("decode_best_ms")))
    return rows


def write_generation_chart(report: dict[str, Any], folder: Path) -> str | None:
    """``report.png`` of a generation run: each variant's decode time per token (its best: from a CUDA graph
    where one replayed it) at batch 1 and at the recipe's batch; None when nothing was timed."""
    rows = decode_rows(report)
    if not rows:
        return None
    import matplotlib  # noqa: PLC0415 - only when a chart is drawn

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # noqa: PLC0415

    width, height = size_px(len(rows))
    fig, axis = plt.subplots(figsize=(width / DPI, height / DPI), dpi=DPI)
    labels = [label for label, _, _ in rows][::-1]
    ones = [one for _, one, _ in rows][::-1]
    many = [b if isinstance(b, (int, float)) else 0.0 for _, _, b in rows][::-1]
    positions = range(len(rows))
    batch = report["generation"]["batch"]
    axis.barh([p + 0.2 for p in positions], ones, height=0.4, color="#3182bd", label="batch 1")
    axis.barh([p - 0.2 for p in positions], many, height=0.4, color="#9ecae1", label=f"batch {batch}")
    for y, value in zip(positions, ones):
        axis.annotate(f"{value:.3g}", (value, y + 0.2), xytext=(4, -3), textcoords="offset points", fontsize=8)
    axis.set_yticks(list(positions), labels)
    if max(ones) / min(ones) > 20:
        axis.set_xscale("log")
    axis.set_xlabel("decode ms per token (each variant's best: replayed from a CUDA graph where it was)")
    axis.grid(axis="x", alpha=0.3)
    axis.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{report['model']['name']}: text generation with {report['recipe']['name']} on "
                 f"{report['environment']['device'].get('name')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(folder / FILE, dpi=DPI)
    plt.close(fig)
    return FILE


__all__ = ["write_chart", "write_generation_chart", "size_px", "timed_rows", "decode_rows", "FILE"]
