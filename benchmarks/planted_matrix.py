"""The planted-defect matrix: does ``exporter check`` catch a real defect in a user's artifact of a trained model?

    python benchmarks/planted_matrix.py OUT_DIR [--recipe cpu-fp32|h100-bf16] [--seeds N] [--defect NAME ...]
                                                [--column pt2|onnx-dynamo|onnx-torchscript|convert|generation ...]

The model is the trained byte-level GPT-NeoX of :mod:`exporter.testing.trained` (weights that mean something:
random weights hide these defects). For each defect a user's program is made as a user would make it (the
checkpoint loaded with transformers, the defect planted, ``torch.export`` in the recipe's dtype on its device)
and judged by ``exporter check PROGRAM --against CHECKPOINT --recipe R``. A cell is caught when check exits 3 and
names the defect's weight or module. ``--seeds N`` also checks N clean programs exported from inputs of other
seeds: none may fail.

Defects (all in layer 1): ``scale`` attention scale x1.05; ``layernorm`` the input LayerNorm's weight x1.01;
``noise`` 0.5% relative noise on the MLP's first Linear; ``stale`` the attention's output projection from halfway
through training; ``gelu-tanh`` tanh-approximated GELU for the exact one; ``rope-base`` the rotary base x1.01;
``mask-shift`` the causal mask shifted by one (each position also sees the next); ``fp8-scale`` one fp8 linear's
per-row scales x1.05 (the convert column only, with the fp8 recipe of the recipe's device: ``h100-fp8`` on a GPU,
the CPU recipe with ``fp8-rowwise`` in bfloat16 on the CPU; an ``fp8-clean`` row before it); ``kv-cache-slot`` the
decode program's cache write one slot off (the generation column only). Why a column cannot carry a defect is
:data:`exporter.testing.defects.ONLY`.

Columns (``--column``, all by default): ``pt2`` a user's program (``torch.export``), ``onnx-dynamo`` and
``onnx-torchscript`` a user's float32 ONNX (``torch.onnx.export``, either exporter), ``optimum`` a user's Optimum
export (``optimum-cli export onnx --task text-generation`` of a folder with the defect planted: the defects a folder
can carry, :data:`exporter.testing.defects.NOT_IN_A_FOLDER`), each judged by ``exporter check``; ``convert``
exporter's own artifacts (exported program, AOTInductor, ONNX) with the defect planted inside
``exporter convert`` after its reference was taken (:func:`exporter.testing.defects.planted_in_convert`);
``generation`` ``exporter convert --task text-generation``'s prefill and decode programs, judged step by step
against the float64 greedy generation (its clean row and the cache row), named by the first failing step.

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


# the quantized rows: the GPU's fp8 recipe, or on the CPU the CPU recipe with the same quantization in bfloat16
# (PyTorch's CPU _scaled_mm makes the same fp8 roundings)
FP8_ON_CPU = ("quantize.scheme=fp8-rowwise", "runtime.dtype=bfloat16")


def convert_cells(checkpoint: Path, defect: str, recipe: str, out: Path, fp8: bool = False) -> dict[str, dict]:
    """``exporter convert`` with ``defect`` planted after its reference: one cell per artifact (``fp8``: with the
    fp8 recipe of ``recipe``'s device, whose targets are the exported program and AOTInductor)."""
    import exporter  # noqa: PLC0415
    from exporter.recipe import resolve_recipe  # noqa: PLC0415
    from exporter.testing.defects import planted_in_convert  # noqa: PLC0415
    from exporter.testing.trained import held_out_samples  # noqa: PLC0415

    targets: tuple[str, ...] = ("exported_program", "aoti", "onnx")
    settings: tuple[str, ...] = ()
    inputs, dims = None, ("sequence=64",)
    if fp8:  # fp8's cost (top-1 agreement, KL) asked on held-out text, where it means something
        targets, dims = ("exported_program", "aoti"), ()
        inputs = held_out_samples(out.parent / f"{out.name}-text.safetensors")
        if resolve_recipe(recipe).runtime.device.startswith("cuda"):
            recipe = "h100-fp8"
        else:
            settings = FP8_ON_CPU
    t0 = time.perf_counter()
    with planted_in_convert(checkpoint, defect):
        result = exporter.convert(checkpoint, recipe, out, overwrite=True, dims=dims, targets=targets,
                                  settings=settings, inputs=inputs)
    cost = result.report.get("quantization")
    cells = {}
    for entry in result.report["artifacts"]:
        cell = entry_cell(entry)
        cell.update({"exit": result.exit_code, "seconds": round(time.perf_counter() - t0, 1)})
        if cost:  # what fp8 cost on held-out text: the budget's figures
            cell["quantization"] = {"passed": cost["passed"], "sqnr_db": [o["sqnr_db"] for o in cost["outputs"]],
                                    "error_ratio": [o["error_ratio"] for o in cost["outputs"]],
                                    "top1": [e["top1_agreement"] for e in cost["logits"]],
                                    "kl": [e["kl"] for e in cost["logits"]]}
        cells[f"convert {entry['name']}"] = cell
    return cells


# the generation column's cache: within the trained model's 256 positions on every recipe
GENERATION = ("generation.prompt_length=32", "generation.max_cache_len=96", "generation.new_tokens=8")


def generation_cells(checkpoint: Path, defect: str, recipe: str, out: Path) -> dict[str, dict]:
    """``exporter convert --task text-generation`` with ``defect`` planted while it exports its programs: one cell
    per artifact, named by the first step whose logits failed (step 0 is the prefill)."""
    import exporter  # noqa: PLC0415
    from exporter.testing.defects import planted_in_convert  # noqa: PLC0415

    t0 = time.perf_counter()
    with planted_in_convert(checkpoint, defect):
        result = exporter.convert(checkpoint, recipe, out, overwrite=True, task="text-generation",
                                  targets=("exported_program", "aoti", "onnx"), settings=GENERATION)
    cells = {}
    for entry in result.report["artifacts"]:
        steps = (entry.get("numerics") or {}).get("steps") or []
        failed = [s for s in steps if not s.get("passed")]
        first = failed[0] if failed else None
        where = "" if first is None else ("prefill" if first["step"] == 0 else f"decode step {first['step']}")
        cells[f"generation {entry['name']}"] = {
            "status": entry["status"], "exit": result.exit_code, "outputs_passed": not failed,
            "caught_by": ["steps"] if failed else [], "error": f"{where}: {entry.get('error') or ''}" if where else
            entry.get("error") or "", "steps_failed": len(failed), "steps": len(steps),
            "seconds": round(time.perf_counter() - t0, 1)}
    return cells


def optimum_cell(checkpoint: Path, defect: str, recipe: str, out: Path, seed: int) -> dict:
    """A user's Optimum export of a folder with ``defect`` planted (``optimum-cli export onnx --task
    text-generation``, in Optimum's own environment), judged by ``exporter check`` against the clean checkpoint."""
    from exporter.testing.defects import NOT_IN_A_FOLDER, planted_folder  # noqa: PLC0415
    from exporter.testing.optimum_peer import export as optimum_export  # noqa: PLC0415

    if defect in NOT_IN_A_FOLDER:
        return {"exit": None, "not_applicable": NOT_IN_A_FOLDER[defect]}
    folder = planted_folder(checkpoint, defect, out.parent / f"{out.name}-model")
    exported = out.parent / f"{out.name}-onnx"
    done = optimum_export(folder, exported, "text-generation")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"exit": done.returncode, "error": f"optimum-cli failed: {last}"}
    return check(exported, checkpoint, recipe, out, seed)


COLUMNS = ("pt2", "onnx-dynamo", "onnx-torchscript", "optimum", "convert", "generation")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--recipe", default="cpu-fp32")
    parser.add_argument("--seeds", type=int, default=0, help="clean programs of other seeds to check")
    parser.add_argument("--defect", action="append", default=[], help="one of exporter.testing.defects.EXPECT")
    parser.add_argument("--column", action="append", default=[], choices=COLUMNS)
    args = parser.parse_args()

    from exporter.recipe import resolve_recipe  # noqa: PLC0415
    from exporter.testing.defects import EXPECT, ONLY, export, export_onnx, named  # noqa: PLC0415
    from exporter.testing.trained import trained_lm  # noqa: PLC0415

    recipe = resolve_recipe(args.recipe)
    device, dtype = recipe.runtime.device, getattr(torch, recipe.runtime.dtype)
    checkpoint = trained_lm()
    args.out.mkdir(parents=True, exist_ok=True)
    columns = args.column or list(COLUMNS)
    rows: list[dict] = []
    chosen = [d for d in args.defect or list(EXPECT) if d not in ONLY or ONLY[d][0] in columns]
    defects = list(dict.fromkeys(["clean", *chosen]))  # --defect clean: the clean rows alone
    defects += [f"clean:{seed}" for seed in range(1, args.seeds + 1)]
    if "fp8-scale" in chosen:  # the quantized convert's own clean row first
        defects.insert(defects.index("fp8-scale"), "fp8-clean")
    for defect in defects:
        planted, seed = (defect.split(":")[0], int(defect.split(":")[1])) if ":" in defect else (defect, 0)
        fp8 = planted.startswith("fp8-")
        planted = "clean" if planted == "fp8-clean" else planted
        only = "convert" if fp8 else ONLY[planted][0] if planted in ONLY else None
        row: dict = {"defect": defect, "cells": {}}
        for column in columns:
            where = args.out / "runs" / f"{defect.replace(':', '-')}-{column}"
            if not (column == only if only else column != "generation" or defect == "clean"):
                continue  # a defect of one column (ONLY: why the others cannot carry it is listed below the
                # table); the generation column judges its clean programs and the cache row
            if column == "generation":
                row["cells"].update(generation_cells(checkpoint, planted, args.recipe, where))
            elif column == "optimum":
                row["cells"][column] = optimum_cell(checkpoint, planted, args.recipe, where, seed)
            elif column == "pt2":
                artifact = export(checkpoint, args.out / f"{defect}.pt2", planted, device, dtype, seed)
                row["cells"][column] = check(artifact, checkpoint, args.recipe, where, seed)
            elif column.startswith("onnx"):
                artifact = export_onnx(checkpoint, args.out / f"{defect}-{column}.onnx", planted,
                                       dynamo=column == "onnx-dynamo")
                row["cells"][column] = check(artifact, checkpoint, args.recipe, where, seed)
            elif seed == 0:
                row["cells"].update(convert_cells(checkpoint, planted, args.recipe, where, fp8))
        for cell in row["cells"].values():
            if cell.get("status") == "skipped":  # not built on this machine (its reason is the cell's error)
                cell["not_applicable"] = f"not built here: {cell.get('error', '')[:140]}"
            if "not_applicable" in cell:
                cell["ok"] = None
                continue
            cell["ok"] = cell["exit"] == 0 and cell.get("status") == "ok" if planted == "clean" else (
                cell.get("status") == "numerics_failed" and named(planted, cell.get("error", "")))
        rows.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "matrix.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")  # so far
    meta = {"recipe": args.recipe, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "training": json.loads((checkpoint / "training.json").read_text()), "only": ONLY}
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
            if cell.get("not_applicable"):
                cells.append(f"cannot apply: {cell['not_applicable']}")
                continue
            mark = "✅" if cell["ok"] else "❌"
            caught = ", ".join(cell.get("caught_by") or []) or "none"
            worst = cell.get("program_worst")
            outputs = "pass" if cell.get("outputs_passed") else "fail"
            cells.append(f"{mark} {cell.get('status', cell['exit'])}; proofs failed: {caught}; outputs alone: "
                         f"{outputs}" + (f"; twin {worst:.1e}" if isinstance(worst, float) else ""))
        lines.append(f"| {row['defect']} | " + " | ".join(cells) + " |")
    for name, (column, why) in ONLY.items():
        lines.append(f"| {name}, columns but {column} | cannot apply: {why} |" + " |" * (len(names) - 1))
    (args.out / "matrix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(c["ok"] is not False for r in rows for c in r["cells"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
