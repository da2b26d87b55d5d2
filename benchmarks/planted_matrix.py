"""The planted-defect matrix: does ``exporter check`` catch a real defect in a user's artifact of a trained model?

    python benchmarks/planted_matrix.py OUT_DIR [--recipe cpu-fp32|h100-bf16] [--seeds N] [--defect NAME ...]
                                                [--column pt2|onnx-dynamo|onnx-torchscript|convert ...]

The model is the trained byte-level GPT-NeoX of :mod:`exporter.testing.trained` (weights that mean something:
random weights hide these defects). For each defect a user's program is made as a user would make it (the
checkpoint loaded with transformers, the defect planted, ``torch.export`` in the recipe's dtype on its device)
and judged by ``exporter check PROGRAM --against CHECKPOINT --recipe R``. A cell is caught when check exits 3 and
names the defect's weight or module. ``--seeds N`` also checks N clean programs exported from inputs of other
seeds: none may fail.

Defects (all in layer 1): ``scale`` attention scale x1.05; ``layernorm`` the input LayerNorm's weight x1.01;
``noise`` 0.5% relative noise on the MLP's first Linear; ``stale`` the attention's output projection from halfway
through training; ``gelu-tanh`` tanh-approximated GELU for the exact one; ``rope-base`` the rotary base x1.01;
``mask-shift`` the causal mask shifted by one (each position also sees the next).

Columns (``--column``, all by default): ``pt2`` a user's program (``torch.export``), ``onnx-dynamo`` and
``onnx-torchscript`` a user's float32 ONNX (``torch.onnx.export``, either exporter), each judged by ``exporter
check``; ``convert`` exporter's own artifacts (exported program, AOTInductor, ONNX) with the defect planted inside
``exporter convert`` after its reference was taken (:func:`exporter.testing.defects.planted_in_convert`).

Writes OUT_DIR/matrix.json and OUT_DIR/matrix.md (one row per defect, one cell per artifact: its verdict, the
proofs that failed, the outputs' own verdict) and the output folders under OUT_DIR/runs/. On the GPU machine:
``PYTHONPATH=src python3 benchmarks/planted_matrix.py /tmp/matrix --recipe h100-bf16``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def check(artifact: Path, checkpoint: Path, recipe: str, out: Path, seed: int) -> dict:
    """``exporter check`` of one artifact: its exit code and what its report says."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "exporter", "check", str(artifact), "--against", str(checkpoint),
                           "--recipe", recipe, "--out", str(out), "--overwrite", "--set", f"inputs.seed={seed}",
                           "--dim", "sequence=64"], capture_output=True, text=True)
    report = out / "report.json"
    if not report.is_file():
        return {"exit": done.returncode, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    cell = entry_cell(json.loads(report.read_text())["artifacts"][0])
    cell.update({"exit": done.returncode, "seconds": round(time.perf_counter() - t0, 1)})
    return cell


def entry_cell(entry: dict) -> dict:
    proofs = entry.get("proofs") or {}
    return {"status": entry["status"], "outputs_passed": (entry.get("numerics") or {}).get("passed"),
            "proofs": {name: found.get("passed") for name, found in proofs.items()},
            "caught_by": [name for name, found in proofs.items() if found.get("passed") is False],
            "error": entry.get("error") or "", "program_worst": (proofs.get("program") or {}).get("worst"),
            "program": (proofs.get("program") or {}).get("summary"),
            "rounding": (proofs.get("rounding") or {}).get("summary")}


def convert_cells(checkpoint: Path, defect: str, recipe: str, out: Path) -> dict[str, dict]:
    """``exporter convert`` with ``defect`` planted after its reference: one cell per artifact."""
    import exporter  # noqa: PLC0415
    from exporter.testing.defects import planted_in_convert  # noqa: PLC0415

    t0 = time.perf_counter()
    with planted_in_convert(checkpoint, defect):
        result = exporter.convert(checkpoint, recipe, out, overwrite=True, dims=("sequence=64",),
                                  targets=("exported_program", "aoti", "onnx"))
    cells = {}
    for entry in result.report["artifacts"]:
        cell = entry_cell(entry)
        cell.update({"exit": result.exit_code, "seconds": round(time.perf_counter() - t0, 1)})
        cells[f"convert {entry['name']}"] = cell
    return cells


COLUMNS = ("pt2", "onnx-dynamo", "onnx-torchscript", "convert")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--recipe", default="cpu-fp32")
    parser.add_argument("--seeds", type=int, default=0, help="clean programs of other seeds to check")
    parser.add_argument("--defect", action="append", default=[], help="one of exporter.testing.defects.EXPECT")
    parser.add_argument("--column", action="append", default=[], choices=COLUMNS)
    args = parser.parse_args()

    from exporter.recipe import resolve_recipe  # noqa: PLC0415
    from exporter.testing.defects import EXPECT, NOT_APPLICABLE, export, export_onnx, named  # noqa: PLC0415
    from exporter.testing.trained import trained_lm  # noqa: PLC0415

    recipe = resolve_recipe(args.recipe)
    device, dtype = recipe.runtime.device, getattr(torch, recipe.runtime.dtype)
    checkpoint = trained_lm()
    args.out.mkdir(parents=True, exist_ok=True)
    columns = args.column or list(COLUMNS)
    rows: list[dict] = []
    defects = ["clean", *(args.defect or list(EXPECT))] + [f"clean:{seed}" for seed in range(1, args.seeds + 1)]
    for defect in defects:
        planted, seed = (defect.split(":")[0], int(defect.split(":")[1])) if ":" in defect else (defect, 0)
        row: dict = {"defect": defect, "cells": {}}
        for column in columns:
            where = args.out / "runs" / f"{defect.replace(':', '-')}-{column}"
            if column == "pt2":
                artifact = export(checkpoint, args.out / f"{defect}.pt2", planted, device, dtype, seed)
                row["cells"][column] = check(artifact, checkpoint, args.recipe, where, seed)
            elif column.startswith("onnx"):
                artifact = export_onnx(checkpoint, args.out / f"{defect}-{column}.onnx", planted,
                                       dynamo=column == "onnx-dynamo")
                row["cells"][column] = check(artifact, checkpoint, args.recipe, where, seed)
            elif seed == 0:
                row["cells"].update(convert_cells(checkpoint, planted, args.recipe, where))
        for cell in row["cells"].values():
            cell["ok"] = cell["exit"] == 0 and cell.get("status") == "ok" if planted == "clean" else (
                cell.get("status") == "numerics_failed" and named(planted, cell.get("error", "")))
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"recipe": args.recipe, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "training": json.loads((checkpoint / "training.json").read_text()), "not_applicable": NOT_APPLICABLE}
    (args.out / "matrix.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    names = list(dict.fromkeys(name for row in rows for name in row["cells"]))
    lines = [f"recipe `{args.recipe}`, {meta['device']}, torch {meta['torch']}, {meta['date']}; each cell: the "
             "verdict, the proofs that failed, and whether the defect's weight or module was named "
             "(outputs alone: what the outputs' rule said)", "",
             "| defect | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for row in rows:
        cells = []
        for name in names:
            cell = row["cells"].get(name)
            if cell is None:
                cells.append("—")
                continue
            mark = "✅" if cell["ok"] else "❌"
            caught = ", ".join(cell.get("caught_by") or []) or "none"
            worst = cell.get("program_worst")
            outputs = "pass" if cell.get("outputs_passed") else "fail"
            cells.append(f"{mark} {cell.get('status', cell['exit'])}; proofs failed: {caught}; outputs alone: "
                         f"{outputs}" + (f"; twin {worst:.1e}" if isinstance(worst, float) else ""))
        lines.append(f"| {row['defect']} | " + " | ".join(cells) + " |")
    for name, why in NOT_APPLICABLE.items():
        lines.append(f"| {name} | cannot apply: {why} |" + " |" * (len(names) - 1))
    (args.out / "matrix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(c["ok"] for r in rows for c in r["cells"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
