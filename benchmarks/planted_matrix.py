"""The planted-defect matrix: does ``exporter check`` catch a real defect in a user's artifact of a trained model?

    python benchmarks/planted_matrix.py OUT_DIR [--recipe cpu-fp32|h100-bf16] [--seeds N] [--defect NAME ...]

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

Writes OUT_DIR/matrix.json and OUT_DIR/matrix.md (one row per defect: exit code, the proof that caught it, what it
named, the outputs' own verdict) and the check folders under OUT_DIR/checks/. On the GPU machine:
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


def check(program: Path, checkpoint: Path, recipe: str, out: Path, seed: int) -> dict:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "exporter", "check", str(program), "--against", str(checkpoint),
                           "--recipe", recipe, "--out", str(out), "--overwrite", "--set", f"inputs.seed={seed}",
                           "--dim", "sequence=64"], capture_output=True, text=True)
    row: dict = {"exit": done.returncode, "check_s": round(time.perf_counter() - t0, 1)}
    report = out / "report.json"
    if not report.is_file():
        row["error"] = (done.stderr.strip().splitlines() or ["?"])[-1]
        return row
    entry = json.loads(report.read_text())["artifacts"][0]
    proofs = entry.get("proofs") or {}
    row["outputs_passed"] = (entry.get("numerics") or {}).get("passed")
    row["proofs"] = {name: found.get("passed") for name, found in proofs.items()}
    row["caught_by"] = [name for name, found in proofs.items() if found.get("passed") is False]
    row["error"] = entry.get("error") or ""
    row["program_worst"] = (proofs.get("program") or {}).get("worst")
    row["program"] = (proofs.get("program") or {}).get("summary")
    row["rounding"] = (proofs.get("rounding") or {}).get("summary")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--recipe", default="cpu-fp32")
    parser.add_argument("--seeds", type=int, default=0, help="clean programs of other seeds to check")
    parser.add_argument("--defect", action="append", default=[], help="one of exporter.testing.defects.EXPECT")
    args = parser.parse_args()

    from exporter.recipe import resolve_recipe  # noqa: PLC0415
    from exporter.testing.defects import EXPECT, NOT_APPLICABLE, export  # noqa: PLC0415
    from exporter.testing.trained import trained_lm  # noqa: PLC0415

    recipe = resolve_recipe(args.recipe)
    device, dtype = recipe.runtime.device, getattr(torch, recipe.runtime.dtype)
    checkpoint = trained_lm()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for defect in ["clean", *(args.defect or list(EXPECT))]:
        program = export(checkpoint, args.out / f"{defect}.pt2", defect, device, dtype)
        row = {"defect": defect, **check(program, checkpoint, args.recipe, args.out / "checks" / defect, 0)}
        expected = EXPECT.get(defect)
        row["caught"] = row["exit"] == 3 and bool(expected) and expected in row.get("error", "")
        row["ok"] = row["exit"] == 0 if defect == "clean" else row["caught"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    for seed in range(1, args.seeds + 1):
        program = export(checkpoint, args.out / f"clean-{seed}.pt2", "clean", device, dtype, seed)
        row = {"defect": f"clean (seed {seed})",
               **check(program, checkpoint, args.recipe, args.out / "checks" / f"clean-{seed}", seed)}
        row["ok"] = row["exit"] == 0
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows += [{"defect": name, "ok": None, "not_applicable": why} for name, why in NOT_APPLICABLE.items()]
    meta = {"recipe": args.recipe, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "training": json.loads((checkpoint / "training.json").read_text())}
    (args.out / "matrix.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"recipe `{args.recipe}`, {meta['device']}, torch {meta['torch']}, {meta['date']}", "",
             "| defect | check exit | caught by | named | outputs alone | program proof (rel. RMSE) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if row.get("not_applicable"):
            lines.append(f"| {row['defect']} | — | cannot apply: {row['not_applicable']} | | | |")
            continue
        named = EXPECT.get(row["defect"], "")
        worst = row.get("program_worst")
        lines.append(f"| {row['defect']} | {row['exit']} | {', '.join(row.get('caught_by') or []) or '—'} | "
                     f"{named if row.get('caught') else ('—' if row['defect'].startswith('clean') else 'NOT NAMED')} "
                     f"| {'pass' if row.get('outputs_passed') else 'fail'} | "
                     f"{'—' if worst is None else f'{worst:.2g}'} |")
    (args.out / "matrix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
