"""Compare two convert runs of the same model: e.g. with and without the attention rewrite.

    python scripts/compare_reports.py RUN_A/report.json RUN_B/report.json [--labels rewrite no-rewrite]

Prints a Markdown table: per variant present in both runs, its status, median latency in each run, how
much faster A is than B, and the attention kernels each ran (from the reports' profiler audit).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from exporter.report import kernel_summary as kernels


def variants(report: dict) -> dict[str, dict]:
    eager = {"name": "eager", "status": "baseline", "bench": report["baseline"]["bench"],
             "info": {"kernels": report["baseline"].get("kernels")}}
    return {v["name"]: v for v in [eager, report["rewritten"], *report["artifacts"]]}


def compare(a: dict, b: dict, labels: tuple[str, str]) -> str:
    va, vb = variants(a), variants(b)
    la, lb = labels
    lines = [f"| variant | status {la} / {lb} | median ms {la} | median ms {lb} | speedup of {la} over {lb} "
             f"| kernels {la} | kernels {lb} |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in [n for n in va if n in vb]:
        x, y = va[name], vb[name]
        mx, my = (x.get("bench") or {}).get("median_ms"), (y.get("bench") or {}).get("median_ms")
        ratio = f"{my / mx:.2f}×" if mx and my else "—"
        lines.append(f"| {name} | {x['status']} / {y['status']} | {mx if mx is None else f'{mx:.3f}'} "
                     f"| {my if my is None else f'{my:.3f}'} | {ratio} "
                     f"| {kernels((x.get('info') or {}).get('kernels'))} "
                     f"| {kernels((y.get('info') or {}).get('kernels'))} |")
    shapes = ", ".join(f"`{k}` {v}" for k, v in a["inputs"]["shapes"].items())
    head = [f"Model `{a['model']['name']}` ({a['model']['parameters']:,} parameters), recipe `{a['recipe']['name']}`, "
            f"{a['recipe']['device']} {a['recipe']['dtype']}, inputs {shapes}; "
            f"{a['environment']['device'].get('name')}, torch {a['environment']['versions']['torch']}.", "",
            f"Attention sites: {la}: {a['attention']['rewritten']} rewritten of {a['attention']['found']}; "
            f"{lb}: {b['attention']['rewritten']} rewritten of {b['attention']['found']}.", ""]
    return "\n".join(head + lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--labels", nargs=2, default=("rewrite", "no rewrite"))
    args = parser.parse_args()
    a, b = (json.loads(p.read_text(encoding="utf-8")) for p in (args.a, args.b))
    print(compare(a, b, tuple(args.labels)), end="")


if __name__ == "__main__":
    main()
