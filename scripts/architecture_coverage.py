"""The architecture coverage table: exporter and Optimum on the same tiny models, side by side.

    python scripts/architecture_coverage.py                    # writes docs/architectures.md
    python scripts/architecture_coverage.py --only t5,whisper --out -
    python scripts/architecture_coverage.py --no-optimum --no-generation

For every architecture of ``src/exporter/testing/architectures.py`` (a tiny model built from a transformers config,
random weights, eager attention, saved as safetensors + config.json):

1. ``exporter convert MODEL --recipe cpu-fp32 -t exported_program -t onnx`` with no inputs declared: the exit
   code, each target's verdict, the attention sites found and rewritten (and the reason of each one left alone);
2. for decoders, ``exporter convert MODEL --recipe cpu-fp32 --task text-generation -t exported_program``, for
   encoder-decoders the same with ``--task text2text-generation`` (Whisper: ``automatic-speech-recognition``)
   (prefill and decode programs, judged step by step);
3. ``optimum-cli export onnx --model MODEL --task TASK`` in Optimum's own environment
   (:mod:`exporter.testing.optimum_peer`): whether it exports, and whether its own validation (run by the command
   after every export; a failure there is only a warning) passes.

Each command runs in a process of its own with a time limit, so one model cannot take the table down. Every
failure is given with its reason in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from exporter.testing.architectures import ARCHITECTURES, Arch  # noqa: E402
from exporter.testing.optimum_peer import export as optimum_export  # noqa: E402
from exporter.testing.optimum_peer import optimum_cli  # noqa: E402

TIMEOUT_S = 900


@dataclass
class Outcome:
    verdict: str  # passed | failed | error | not run
    detail: str = ""
    seconds: float = 0.0
    targets: dict[str, str] = field(default_factory=dict)
    attention: str = ""
    left: list[str] = field(default_factory=list)
    proofs: dict[str, dict[str, str]] = field(default_factory=dict)  # artifact -> proof -> passed | failed | why not


def one_line(text: str, limit: int = 220) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    if lines:
        return lines[-1][len("error:"):].strip()
    tail = [line for line in output.splitlines() if line.strip()]
    return tail[-1] if tail else "no output"


def exporter_run(model: Path, out: Path, extra: list[str]) -> Outcome:
    command = [sys.executable, "-m", "exporter", "convert", str(model), "--recipe", "cpu-fp32", "--out", str(out),
               "--overwrite", "--quiet", *extra]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return Outcome("error", f"did not finish in {TIMEOUT_S} s", TIMEOUT_S)
    seconds = time.perf_counter() - start
    report_path = out / "report.json"
    if done.returncode not in (0, 3) or not report_path.is_file():
        return Outcome("error", f"exit {done.returncode}: {error_line(done.stderr + done.stdout)}", seconds)
    report = json.loads(report_path.read_text())
    outcome = Outcome("passed" if report.get("passed") else "failed", "", seconds)
    for artifact in report.get("artifacts", []):
        outcome.targets[artifact["name"]] = artifact["status"]
        outcome.proofs[artifact["name"]] = {
            name: {True: "passed", False: "failed"}.get(proof.get("passed"), str(proof.get("summary", "not run")))
            for name, proof in (artifact.get("proofs") or {}).items()}
    attention = report.get("attention") or {}
    if attention:
        outcome.attention = f"{attention.get('found', 0)} / {attention.get('rewritten', 0)}"
        if attention.get("already_sdpa"):
            outcome.attention += f" (+{attention['already_sdpa']} SDPA)"
        reasons = sorted({s.get("reason", "") for s in attention.get("sites", []) if s.get("status") == "skipped"})
        outcome.left = [r for r in reasons if r]
    if not report.get("passed"):
        outcome.detail = "; ".join(report.get("problems", []))[:400] or f"exit {done.returncode}"
    return outcome


OPTIMUM_FAILED_VALIDATION = ("The ONNX export succeeded with the warning",)  # its validation failed; still exit 0


def optimum_run(model: Path, out: Path, task: str) -> Outcome:
    start = time.perf_counter()
    try:
        done = optimum_export(model, out, task)
    except subprocess.TimeoutExpired:
        return Outcome("error", "did not finish", time.perf_counter() - start)
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    if done.returncode != 0:
        errors = [line for line in output.splitlines() if re.match(r"^\w*(Error|Exception)\b", line)]
        return Outcome("error", one_line(errors[-1] if errors else error_line(output)), seconds)
    if any(marker in output for marker in OPTIMUM_FAILED_VALIDATION):
        warning = next((line for line in output.splitlines() if OPTIMUM_FAILED_VALIDATION[0] in line), "")
        warning = warning.split("warning:", 1)[-1]
        return Outcome("failed", one_line(warning or "its validation reported a difference"), seconds)
    return Outcome("passed", "", seconds)


def row(arch: Arch, work: Path, args) -> dict:
    model = arch.save(work / "models" / arch.name)
    entry: dict = {"name": arch.name, "kind": arch.kind, "model": type(arch.build()).__name__,
                   "optimum_task": arch.optimum_task}
    if args.forward:
        print(f"[{arch.name}] exporter", file=sys.stderr, flush=True)
        entry["forward"] = exporter_run(model, work / "exporter" / arch.name,
                                        ["-t", "exported_program", "-t", "onnx"])
    if arch.generation and args.generation:
        print(f"[{arch.name}] exporter --task {arch.generation}", file=sys.stderr, flush=True)
        entry["generation"] = exporter_run(model, work / "generation" / arch.name,
                                           ["--task", arch.generation, "-t", "exported_program"])
    if args.optimum:
        print(f"[{arch.name}] optimum-cli", file=sys.stderr, flush=True)
        entry["optimum"] = optimum_run(model, work / "optimum" / arch.name, arch.optimum_task)
    return entry


def proof_counts(rows: list[dict]) -> str:
    """How many artifacts got each proof, and its verdicts (a reason a proof was not run, counted as given)."""
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        for column in ("forward", "generation"):
            outcome = r.get(column)
            for proofs in (outcome.proofs.values() if isinstance(outcome, Outcome) else ()):
                for name, verdict in proofs.items():
                    key = verdict if verdict in ("passed", "failed") else "not run: " + verdict.split(": ", 1)[-1][:90]
                    counts.setdefault(name, {})[key] = counts.setdefault(name, {}).get(key, 0) + 1
    return "proofs over every artifact: " + "; ".join(
        f"{name}: " + ", ".join(f"{n} {verdict}" for verdict, n in sorted(found.items(), key=lambda kv: -kv[1]))
        for name, found in counts.items())


# What a failing row's numbers mean, where a look at them says more than the one-line reason (shown for failing rows)
FINDINGS: dict[str, str] = {}

MARK = {"passed": "✅ passed", "failed": "❌ failed", "error": "❌ error", "not run": "—"}


def verdict_cell(outcome: Outcome | None) -> str:
    if outcome is None:
        return "—"
    targets = ", ".join(f"{k} {'✅' if v == 'ok' else '❌ ' + v}" for k, v in outcome.targets.items())
    return MARK[outcome.verdict] + (f" ({targets})" if targets and outcome.verdict != "passed" else "")


def render(rows: list[dict], seconds: float, versions: str, generation: bool, optimum: bool) -> str:
    def count(key: str) -> int:
        return sum(1 for r in rows if r.get(key) is not None and r[key].verdict == "passed")

    lines = ["# Architecture coverage", "",
             f"Generated by `python scripts/architecture_coverage.py` (do not edit by hand) on {versions}; "
             f"{seconds:.0f} s of commands in all.", "",
             "Each row is a tiny model of one architecture (two layers, hidden size 64 or so, random weights, eager "
             "attention; the configs are in `src/exporter/testing/architectures.py`), saved as safetensors + "
             "`config.json`. Both tools get the same folder and no inputs declared by hand:", "",
             "* **exporter**: `exporter convert MODEL --recipe cpu-fp32 -t exported_program -t onnx` (the inputs "
             "come from the config, the shape grid included); for decoders also `--task text-generation -t "
             "exported_program`, for encoder-decoders `--task text2text-generation` (Whisper: "
             "`automatic-speech-recognition`) (prefill and decode programs judged step by step against a float64 "
             "greedy generation)" + (";" if generation else "; that column was not run for this table "
                                                      "(`--no-generation`);"),
             "* **Optimum**: `optimum-cli export onnx --model MODEL --task TASK` (optimum-onnx in an environment of "
             "its own: it pins transformers < 4.58); ✅ when it exported and its own validation passed.", "",
             "Attention: sites found / rewritten to `scaled_dot_product_attention`; each reason a site was left "
             "as written is listed under the table.", "",
             f"**Passed: exporter {count('forward')} of {len(rows)} (forward)"
             + (f", {count('generation')} of {sum(1 for r in rows if 'generation' in r)} (generation)"
                if generation else "")
             + (f"; Optimum {count('optimum')} of {len(rows)}." if optimum else ".") + "**", "",
             "| architecture | kind | model class | attention found / rewritten | exporter forward | "
             "exporter generation | Optimum task | Optimum |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    reasons: list[str] = []
    for r in rows:
        forward, gen, opt = r["forward"], r.get("generation"), r.get("optimum")
        lines.append(f"| {r['name']} | {r['kind']} | {r['model']} | {forward.attention or '—'} | "
                     f"{verdict_cell(forward)} | {verdict_cell(gen)} | `{r['optimum_task']}` | {verdict_cell(opt)} |")
        for label, outcome in (("exporter forward", forward), ("exporter generation", gen), ("Optimum", opt)):
            if outcome is not None and outcome.verdict != "passed":
                reasons.append(f"* **{r['name']}**, {label}: {one_line(outcome.detail, 400)}")
        if forward.verdict != "passed" and r["name"] in FINDINGS:
            reasons.append(f"* **{r['name']}**, what the numbers say: {FINDINGS[r['name']]}")
        for reason in forward.left:
            reasons.append(f"* **{r['name']}**, attention left as written: {reason}")
    lines += ["", "## Why", ""] + (reasons or ["Every row passed."])
    times = sorted(r["forward"].seconds for r in rows)
    opt_times = sorted(r["optimum"].seconds for r in rows if r.get("optimum"))
    lines += ["", f"Median seconds per model: exporter forward {times[len(times) // 2]:.0f}"
              + (f", Optimum {opt_times[len(opt_times) // 2]:.0f}" if opt_times else "")
              + " (the same machine, one after the other).", ""]
    return "\n".join(lines)


def versions() -> str:
    import onnxruntime
    import torch
    import transformers

    return (f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores, Python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"onnxruntime {onnxruntime.__version__}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "architectures.md"), help="file to write, or -")
    parser.add_argument("--only", default="", help="comma-separated architecture names")
    parser.add_argument("--work", type=Path, default=None, help="folder for the models and outputs (default: temp)")
    parser.add_argument("--no-optimum", dest="optimum", action="store_false")
    parser.add_argument("--no-generation", dest="generation", action="store_false")
    parser.add_argument("--no-forward", dest="forward", action="store_false",
                        help="run only the other columns (with --rows: the forward verdicts are kept from there)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--rows", type=Path, default=None,
                        help="rows of an earlier run (its --json): rows not run now are taken from it")
    args = parser.parse_args()
    wanted = [a for a in ARCHITECTURES if not args.only or a.name in args.only.split(",")]
    if args.optimum:
        cli, why = optimum_cli()
        if cli is None:
            print(f"Optimum's column left out: {why}", file=sys.stderr)
            args.optimum = False
    with tempfile.TemporaryDirectory(prefix="coverage-") as temp:
        work = args.work or Path(temp)
        rows = [row(arch, work, args) for arch in wanted]
    if args.rows:
        fresh = {r["name"]: r for r in rows}
        earlier = json.loads(args.rows.read_text())
        rows = [{**{k: (Outcome(**v) if isinstance(v, dict) else v) for k, v in r.items()}, **fresh.get(r["name"], {})}
                for r in earlier] + [r for r in rows if r["name"] not in {e["name"] for e in earlier}]
    seconds = sum(v.seconds for r in rows for v in r.values() if isinstance(v, Outcome))
    print(proof_counts(rows), file=sys.stderr)
    text = render(rows, seconds, versions(), any("generation" in r for r in rows), any("optimum" in r for r in rows))
    if args.json:
        args.json.write_text(json.dumps([{k: (v.__dict__ if isinstance(v, Outcome) else v) for k, v in r.items()}
                                         for r in rows], indent=1))
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
