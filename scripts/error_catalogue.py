"""Run every case of the error catalogue through the real command line and write docs/errors.md.

    python scripts/error_catalogue.py [docs/errors.md]

The cases live in src/exporter/testing/error_cases.py (tests/test_errors.py runs the same cases as tests); the
messages in the document are what the command printed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from exporter.testing.error_cases import CASES, error_line, make_assets, run

ROOT = Path(__file__).resolve().parents[1]

HEADER = """# Bad input and faults: the catalogue

Every case below is a test (`tests/test_errors.py` runs `src/exporter/testing/error_cases.py` through the command
line) and this page is generated from those runs by `python scripts/error_catalogue.py`: the messages
are what `exporter` printed. In every failing case the command prints exactly one `error:` line with
a fix, no traceback (set `EXPORTER_DEBUG=1` for one), and leaves no output folder and no staging
folder behind. Exit codes: [exit-codes.md](exit-codes.md).

| area | case | exit | what exporter printed |
| --- | --- | --- | --- |
"""

FOOTER = """
## Faults that are not a bad argument

| fault | exit | what happens | test |
| --- | --- | --- | --- |
| SIGTERM at any stage (load, inputs, reference, rewrite, export, each build, validation, the shape grid, the benchmark, the kernel audit) or during publish | 143 | the run stops within seconds: child processes (and what they started) are killed, the staging folder is removed, no `manifest.json` exists anywhere; `error: interrupted by SIGTERM; no manifest was written, so the output is incomplete. Fix: run the command again.` | `tests/test_signals.py` |
| SIGINT (Ctrl-C) at any of those moments, even where Python discards the exception (inside a `__del__` or a weakref callback) | 130 | the same, `interrupted by SIGINT`: the signal is recorded and checked again at every stage boundary, wait for a child, benchmark round and before publishing | `tests/test_signals.py` |
| NaN weights that reach the outputs, with the default `nonfinite_weights = "warn"` | 3 | a warning names the tensors, the run goes on, and every candidate fails numerics: the float64 reference holds NaN there, and a reference that cannot judge fails closed | `tests/test_errors.py::test_nan_weights_are_a_warning_and_a_reference_they_reach_fails_every_candidate` |
| a target's process crashes (a segfault while loading a compiled artifact, for instance) | 4 | that target is `failed` with the reason (`load: the child process crashed with SIGSEGV`) and its log in `logs/`; every other target is built, validated and timed | `tests/test_runners.py` (a real SIGSEGV in the child) |
| a target cannot be built (`torch.cummax` has no ONNX translation) | 4 | `onnx` is `failed` (`build failed: ...`, traceback in `logs/onnx.log`); `exported_program` and `aoti` are built, validated and timed; the manifest is written | `tests/test_convert.py::test_one_failing_target_loses_none_of_the_others` |
| the disk fills while an artifact or the report is written | 5 | the run stops at once (no other target can be written either) and removes its staging folder | `the disk fills up mid-write` above (a 64 KiB tmpfs) |

## What `exporter verify` and `exporter generate` refuse to load

An output folder is untrusted input too ([check.md](check.md#threat-model)): `verify` re-hashes it, then refuses
to load an artifact for these reasons, reports a failed check for it, goes on with the others and never says
"verified". Each is pinned by a test that plants a harmless payload and asserts it never runs.

| the folder holds | exit | what verify reports (`--json`: the artifact's failed check) | test |
| --- | --- | --- | --- |
| a `.pt2` program that needs a pickle (a pickled weight, constant or object) | 2 | `loads`: `not loaded: it holds pickled data (weight …), and loading it would run code from the file. Fix: … pass --allow-artifact-pickle if you trust whoever made it …` | `tests/check/test_untrusted.py::test_a_check_folder_with_a_pickle_swapped_in_is_not_loaded_by_verify` |
| an AOTInductor package in an `exporter check` folder (another tool compiled it), without `--allow-native-code` | 2 | `loads`: `not loaded: an AOTInductor package another tool compiled; loading it runs its native code. Fix: pass --allow-native-code only if you trust whoever compiled it …` | `tests/check/test_check.py::test_an_aoti_package_made_elsewhere_passes` |
| a `report.json` naming a module to import that is not one of transformers' ModelOutput modules | 2 | `loads`: `not loaded: report.json asks to import 'planted_spec' before loading it …` | `tests/check/test_untrusted.py::test_verify_imports_no_module_a_tampered_report_names` |
| an artifact path or external-data file outside the folder, or not hashed by `manifest.json` | 6 | `files`: `not loaded: report.json names the file '../outside/model.pt2', a path outside its own folder …` | `tests/check/test_untrusted.py::test_verify_loads_no_artifact_outside_its_folder_or_its_manifest` |

`exporter generate` reads a generation folder's programs as data the same way: a program that needs a pickle is
refused with exit 2 (`error: prefill.pt2 holds pickled data (weight …): loading it would run code from the file.
Fix: …`), and the payload never runs (`tests/generation/test_generate_and_verify.py::
test_a_pickle_in_a_generation_program_never_runs`).

Risky native code runs where a crash cannot take the run down: every artifact is loaded and run in its
own process (`python -m exporter.child`). Exporting and compiling run in the convert process; their
failures are Python exceptions, caught per target (the C++ compiler runs as its own process).

## Fuzzing the checkpoint reader

`tests/checkpoint/test_fuzz_checkpoint.py` feeds `open_checkpoint` and the reading of every tensor with raw bytes,
mutations of a valid file (byte flips, truncation, insertion, a rewritten length field) and
well-formed-looking headers with wrong dtypes, shapes, offsets and extra keys. The only exception that
may come out is `CheckpointError` (exit 2, one line); a hang kills the run (60 s watchdog per case).

- Quick slice, in every test run: 60 cases per strategy plus 60 consistent files that must load and
  60 random shard indexes.
- Fuzz run, `EXPORTER_FUZZ_EXAMPLES=3000 python -m pytest tests/checkpoint/test_fuzz_checkpoint.py -m fuzz`
  (2-core x86_64, 2026-11-29): 9,000 cases in 20 s — 8,878 `CheckpointError`, 122 files that loaded,
  0 other exceptions, 0 hangs. CI runs the fuzz run at 1,500 cases per strategy.

## Host memory

The convert process builds the model with its parameters on the meta device and assigns the
memory-mapped weights, checks them for NaN/Inf in 4 M-element chunks, and runs the float64 reference
by upcasting each module only while it runs. Its peak resident memory stays within

    1.3 × checkpoint size + 768 MiB

where 768 MiB bounds the interpreter, torch and exporter themselves (about 0.25 GiB measured) and the
transients (one module's weights in float64 during the reference, one tensor while `model.pt2` is
written). `tests/measure/test_memory.py` converts a 1.07 GB checkpoint (16 × 4096² linear layers, recipe
`exported_program` only) and reads the report's `memory.convert_peak_rss_bytes` (the process's own
`VmHWM`): 1.52 GiB, 1.52 × the checkpoint (2-core x86_64, torch 2.13, 2026-11-29).

Outside that bound, stated rather than hidden:
- one module whose own weights are large (a single 8192 × 8192 layer) adds twice its float32 size
  while the float64 reference runs it;
- each artifact is validated and timed in its own process, which holds that artifact: one more copy of
  the weights per process, reported per target as `bench.peak_memory_bytes`;
- AOTInductor serialises every constant into one buffer while it compiles (torch 2.13): with
  `exported_program`, `aoti` and `onnx`, the same 1.07 GB checkpoint peaked at 3.7 GiB in the convert
  process, all of the excess during `build aoti` (+2.0 GiB). The ONNX build adds nothing measurable: above
  256 MiB of weights they go to `model.onnx.data`, written tensor by tensor (saved inside the `.onnx`
  they cost +2.0 GiB, measured). The variants' own processes peaked at 1.4 GB (exported program),
  2.5 GB (AOTI) and 1.4 GB (ONNX).
"""


def main() -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "errors.md"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        assets = make_assets(Path(tmp) / "assets")
        for index, (category, name, build) in enumerate(CASES):
            work = Path(tmp) / f"case{index}"
            work.mkdir()
            case = build(work, assets)
            try:
                result = run(case, cwd=work)
            finally:
                if case.cleanup:
                    case.cleanup()
            line = error_line(result.stderr) or next(
                (ln.strip() for ln in result.stderr.splitlines() if "warning" in ln), "(no error)")
            line = line.replace(tmp, "…").replace("|", "\\|")
            ok = "" if result.returncode == case.code else f" **(expected {case.code})**"
            rows.append(f"| {category} | {name} | {result.returncode}{ok} | `{line}` |")
            print(f"{result.returncode} {name}", flush=True)
    target.write_text(HEADER + "\n".join(rows) + "\n" + FOOTER)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
