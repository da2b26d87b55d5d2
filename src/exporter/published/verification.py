"""``exporter verify OUT_DIR``: the release gate a pipeline runs before publishing an output folder.

Without the checkpoint, in a fresh process:

1. ``manifest.json`` must exist (written last: without it the run never finished) and every file it lists
   must be present with its SHA-256; a file it does not list is a problem too.
2. The run recorded in ``report.json`` must have passed.
3. Every artifact whose files are intact is loaded in its own process, as convert loaded it, and run on
   the stored reference inputs (``reference/inputs.safetensors``). Each output of each sample is compared
   with the stored float64 reference output (``reference/outputs.safetensors``) against the bar convert
   stored for that very (sample, output) (``numerics.checks[].allowed_rmse`` in report.json:
   ``k * s(n) * rmse(eager in the artifact's dtype, ref64) + floor + atol``). NaN or Inf where the reference is finite
   fails, integer outputs must match exactly.

An artifact whose files do not match the manifest is not loaded: running a file that is not the one
that was validated proves nothing, and for a compiled package it means running unknown native code.

Exit codes: ``errors.EXIT_CODES`` (their ``verify`` meanings; docs/exit-codes.md); when several apply, the
first in ``errors.VERIFY_PRECEDENCE`` wins.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import junit as junit_mod
from ..errors import (
    EXIT_ENVIRONMENT,
    EXIT_INTEGRITY,
    EXIT_NUMERICS,
    EXIT_OK,
    EXIT_TARGET,
    VERIFY_PRECEDENCE,
)
from ..junit import Case
from ..numerics.compare import Accumulator, Source, read_stream
from ..outdir import sha256_file
from ..quantize.cost import cost_problems
from ..recipe import GENERATION_TASKS
from ..report import REPORT_SCHEMA_VERSION
from ..results import OutputCheck
from ..runners import RemoteRunner, RunnerFailed, run_session
from .reading import (
    Check,
    artifact_spec,
    device_problem,
    load_reference,
    out_folder,
    read_json,
    reference_sources,
    untrusted_entry,
)


@dataclass
class VerifyResult:
    out: Path
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        codes = {c.code for c in self.checks if c.passed is False}
        return next((code for code in VERIFY_PRECEDENCE if code in codes), EXIT_OK)

    @property
    def passed(self) -> bool:
        return self.exit_code == EXIT_OK

    @property
    def problems(self) -> list[str]:
        return [c.line() for c in self.checks if c.passed is False]

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": 1, "command": "verify", "folder": str(self.out), "passed": self.passed,
                "exit_code": self.exit_code, "problems": self.problems,
                "checks": [{"subject": c.subject, "check": c.name,
                            "status": {True: "passed", False: "failed", None: "skipped"}[c.passed],
                            "message": c.message, "seconds": round(c.seconds, 3)} for c in self.checks]}

    def junit_cases(self) -> list[Case]:
        return [Case(f"exporter.verify.{c.subject}", c.name, c.passed, c.message, c.seconds) for c in self.checks]


# --------------------------------------------------------------------------- checks


def _check_files(out: Path, manifest: dict[str, Any], result: VerifyResult,
                 artifacts: list[dict[str, Any]]) -> set[str]:
    """Hash every listed file; return the paths that are missing or changed."""
    bad: dict[str, str] = {}
    listed = {}
    root = out.resolve()
    for entry in manifest.get("files", []):
        rel = str(entry.get("path", ""))
        path = (out / rel).resolve()
        listed[rel] = entry
        if not rel or path == root or root not in path.parents:
            bad[rel] = f"manifest.json lists {rel!r}, a path outside the output folder"
        elif not path.is_file():
            bad[rel] = f"{rel} is missing"
        elif path.stat().st_size != entry.get("bytes"):
            bad[rel] = f"{rel} has {path.stat().st_size} bytes; manifest.json records {entry.get('bytes')}"
        elif sha256_file(path) != entry.get("sha256"):
            bad[rel] = f"{rel} does not match its SHA-256 in manifest.json (changed after convert)"
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() or p.is_symlink()}  # dotfiles too
    unlisted = sorted(on_disk - set(listed) - {"manifest.json"})
    owned = {f["path"] for a in artifacts for f in (a.get("files") or [])}
    for artifact in artifacts:
        files = [f["path"] for f in artifact.get("files") or []]
        if not files:
            continue
        problems = [bad[f] for f in files if f in bad] + [f"{f} is not listed in manifest.json" for f in files
                                                           if f not in listed]
        result.checks.append(Check(artifact["name"], "sha256", not problems,
                                   "; ".join(problems) if problems else f"{len(files)} file(s) match manifest.json",
                                   EXIT_INTEGRITY))
    others = [bad[p] for p in sorted(bad) if p not in owned] + [f"{p} is in the folder but not in manifest.json"
                                                                for p in unlisted]
    besides = len(set(listed) - owned)
    result.checks.append(Check("folder", "files", not others, "; ".join(others) if others else
                               f"{besides} file(s) besides the artifacts' match manifest.json, and no file is "
                               "unlisted", EXIT_INTEGRITY))
    return set(bad)


def _recorded_verdict(report: dict[str, Any], result: VerifyResult) -> None:
    if report.get("passed"):
        result.checks.append(Check("folder", "recorded verdict", True, "the convert run passed"))
        return
    code = report.get("exit_code") or EXIT_NUMERICS  # exit 0 without passing: --allow-drift
    first = (report.get("problems") or ["see report.json"])[0]
    drift = " (numerics failures allowed by --allow-drift)" if report.get("allow_drift") else ""
    result.checks.append(Check("folder", "recorded verdict", False,
                               f"the convert run did not pass{drift}: {first}",
                               code if code in VERIFY_PRECEDENCE else EXIT_NUMERICS))


def _tee(stream, references: list[Source], into: list[Accumulator]):
    """Pass a runner's output stream on unchanged, feeding each chunk also to an accumulator against
    ``references`` (the original model's outputs of a quantized run)."""
    for event in stream:
        if event[0] == "outputs":
            into[:] = [Accumulator(ref) for ref in references] if len(event[1]) == len(references) and all(
                tuple(shape) == tuple(ref.shape) for (shape, _), ref in zip(event[1], references)) else []
        elif into:
            into[event[1]].add(event[2])
        yield event


def compare_rerun(entry: dict[str, Any], runner, samples, references: list[list[Source]],
                  names: list[str], original: list[list[Source]] | None = None,
                  quantization: dict[str, Any] | None = None) -> tuple[list[str], int]:
    """Run every sample through ``runner`` and compare each output, chunk by chunk as it arrives, with the
    stored reference (read slice by slice) against the bar convert stored. Problems, and how many checks ran.
    A quantized run's artifact is also judged against the original model's reference (``original``) and the
    stored quantization budget: the second question, asked of the artifact itself."""
    bars = {(c["sample"], c["output"]): c for c in (entry.get("numerics") or {}).get("checks") or []}
    problems, count = [], 0
    for index, (sample, refs) in enumerate(zip(samples, references)):
        costs: list[Accumulator] = []
        stream = runner.begin_stream(sample)
        if original is not None:
            stream = _tee(stream, original[index], costs)
        for name, ref, item in zip(names, refs, read_stream(stream, names, refs, index)):
            if isinstance(item, OutputCheck):  # another number of outputs ("*"), or a shape that differs
                where = f"sample {index}" if item.output == "*" else f"output {name} (sample {index})"
                problems.append(f"{where}: {item.reason}")
                continue
            count += 1
            bar = bars.get((index, name))
            if bar is None and ref.dtype.is_floating_point:
                problems.append(f"output {name} (sample {index}): report.json holds no stored bar for it")
                continue
            check = item.check(name, index, bar["allowed_rmse"] if bar else 0.0,
                               explain=f"at convert: rmse {bar['rmse']:.3g}" if bar else "")
            if not check.passed:
                problems.append(f"output {name} (sample {index}): {check.reason}")
        if quantization is not None:
            measured = {name: acc.metrics()["rel_l2"] for name, acc in zip(names, costs) if acc.floating}
            problems += [f"{p} (this artifact)" for p in cost_problems(quantization, index, measured)]
            count += len(measured)
    return problems, count


def _cannot_load_here(entry: dict[str, Any], result: VerifyResult) -> bool:
    """Whether the artifact needs a device this machine lacks (recorded as a failed load)."""
    problem = device_problem(entry["device"])
    if problem:
        result.checks.append(Check(entry["name"], "loads", False, problem, EXIT_ENVIRONMENT))
        result.checks.append(Check(entry["name"], "numerics", None, "not run: the artifact could not be loaded here"))
    return problem is not None


def _rerun(out: Path, report: dict[str, Any], entry: dict[str, Any], samples, reference, result: VerifyResult,
           timeout_s: float, allow_pickle: bool = False) -> None:
    name = entry["name"]
    if _cannot_load_here(entry, result):
        return
    if not (entry.get("numerics") or {}).get("checks"):
        result.checks.append(Check(name, "numerics", False, "report.json holds no per-sample bars for this artifact "
                                   "(written by an older exporter)", EXIT_INTEGRITY))
        return
    t0 = time.perf_counter()
    try:
        runner = RemoteRunner(artifact_spec(entry, out, report, allow_pickle), timeout_s=timeout_s)
    except RunnerFailed as exc:
        result.checks.append(Check(name, "loads", False, f"no longer loads: {exc.reason}", EXIT_TARGET,
                                   time.perf_counter() - t0))
        result.checks.append(Check(name, "numerics", None, "not run: the artifact did not load"))
        return
    result.checks.append(Check(name, "loads", True, f"loaded in {runner.load_s:.1f} s",
                               seconds=time.perf_counter() - t0))
    t0 = time.perf_counter()
    try:
        quantization = report.get("quantization")
        original = reference_sources(out, report, "original_outputs.safetensors")[1] if quantization else None
        problems, count = compare_rerun(entry, runner, samples, reference, report["outputs"], original, quantization)
    except RunnerFailed as exc:
        result.checks.append(Check(name, "numerics", False, f"no longer runs: {exc.reason}", EXIT_TARGET,
                                   time.perf_counter() - t0))
        return
    finally:
        runner.close()
    message = "; ".join(problems) if problems else f"{count} output checks within their stored bars"
    result.checks.append(Check(name, "numerics", not problems, message, EXIT_NUMERICS, time.perf_counter() - t0))


def verify(out_dir: str | Path, *, junit: str | Path | None = None, timeout_s: float = 3600.0,
           allow_native_code: bool = False, allow_artifact_pickle: bool = False,
           checkpoint: str | Path | None = None) -> VerifyResult:
    """Check an output folder against its manifest and re-run every artifact on the stored reference inputs.
    Nothing runs that the folder alone says may: a program that needs a pickle is loaded only with
    ``allow_artifact_pickle``, an AOTInductor package of an ``exporter check`` folder (another tool compiled it)
    only with ``allow_native_code``; every file loaded lies in the folder and is hashed by its manifest. With
    ``checkpoint`` (the one the folder was made from, checked by hash) the weights and program proofs are asked
    again (``numerics/reproof.py``)."""
    out = out_folder(out_dir)
    if junit is not None:
        junit_mod.check_writable(junit)
    t_start = time.perf_counter()
    result = VerifyResult(out)
    try:
        _verify(out, result, timeout_s, {"native_code": allow_native_code, "artifact_pickle": allow_artifact_pickle},
                Path(checkpoint) if checkpoint is not None else None)
    finally:
        result.seconds = time.perf_counter() - t_start
        if junit is not None:
            junit_mod.write(junit, "exporter verify", result.junit_cases(), result.seconds)
    return result


def _verify(out: Path, result: VerifyResult, timeout_s: float, allow: dict[str, bool],
            checkpoint: Path | None = None) -> None:
    manifest_path = out / "manifest.json"
    if not manifest_path.is_file():
        result.checks.append(Check("folder", "manifest", False,
                                   f"{out} has no manifest.json: the convert run never finished (interrupted, "
                                   "crashed or still running), or this is not an exporter output folder",
                                   EXIT_INTEGRITY))
        return
    try:
        manifest = read_json(manifest_path)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
            raise ValueError("no files list")
    except (ValueError, UnicodeDecodeError) as exc:
        result.checks.append(Check("folder", "manifest", False, f"manifest.json is not readable ({exc})",
                                   EXIT_INTEGRITY))
        return
    result.checks.append(Check("folder", "manifest", True, f"{len(manifest['files'])} files listed"))
    report = None
    try:
        report = read_json(out / "report.json")
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    artifacts = [a for a in (report or {}).get("artifacts", []) if isinstance(a, dict)]
    bad = _check_files(out, manifest, result, artifacts)
    generation = (report or {}).get("task") in GENERATION_TASKS
    trusted = {"report.json", "generation.json", "reference/generation.safetensors"} if generation else \
        {"report.json", "reference/inputs.safetensors", "reference/outputs.safetensors"}
    if (report or {}).get("quantization") and not generation:  # the second question's reference
        trusted = trusted | {"reference/original_outputs.safetensors"}
    if report is None or trusted & bad or any(p not in {f.get("path") for f in manifest["files"]} for p in trusted):
        result.checks.append(Check("folder", "reference", False, "report.json or the stored reference is missing or "
                                   "changed, so no artifact can be re-run against it", EXIT_INTEGRITY))
        return
    if report.get("schema_version") != REPORT_SCHEMA_VERSION:
        result.checks.append(Check("folder", "reference", False, f"report.json has schema version "
                                   f"{report.get('schema_version')}; this exporter reads {REPORT_SCHEMA_VERSION}",
                                   EXIT_INTEGRITY))
        return
    _recorded_verdict(report, result)
    if generation:
        samples: Any = None
        reference: Any = None
    else:
        samples, reference = reference_sources(out, report)
    rerun: list[dict[str, Any]] = []
    for entry in artifacts:
        name = entry["name"]
        if not entry.get("path"):
            why = entry.get("error") or "no file (a benchmark variant)"
            result.checks.append(Check(name, "loads", None, f"not verified: {why}"))
            continue
        if entry.get("status") != "ok":
            result.checks.append(Check(name, "loads", None,
                                       f"not re-run: convert recorded it as {entry.get('status')}"))
            continue
        if any(f["path"] in bad for f in entry.get("files") or []):
            result.checks.append(Check(name, "loads", None, "not run: its files do not match manifest.json"))
            continue
        refused = untrusted_entry(out, report, entry, {str(f.get("path")) for f in manifest["files"]}, allow)
        if refused is not None:
            result.checks.append(refused)
            continue
        if generation:
            _rerun_generation(out, entry, result, timeout_s)
        else:
            _rerun(out, report, entry, samples, reference, result, timeout_s, allow["artifact_pickle"])
            rerun.append(entry)
    if checkpoint is not None and rerun:
        _reask(checkpoint, out, report, manifest, rerun, result, allow["artifact_pickle"])


def _requantize(model: Any, section: dict[str, Any]) -> None:
    """A quantized run's fp8 linears made again from the checkpoint's weights, as the recipe declared them
    (``section``: the manifest's recipe's ``[quantize]``)."""
    from ..quantize.transform import quantize_model  # noqa: PLC0415

    quantize_model(model, str(section.get("scheme")), tuple(section.get("exclude") or ()),
                   bool(section.get("include_head")), keep_originals=False)


def _reask(checkpoint: Path, out: Path, report: dict[str, Any], manifest: dict[str, Any], entries: list[dict],
           result: VerifyResult, allow_pickle: bool) -> None:
    from ..numerics.reproof import reask  # noqa: PLC0415

    t0 = time.perf_counter()
    samples, reference = load_reference(out, report)
    for asked in reask(checkpoint, out, report, manifest, entries, samples, reference, _requantize, allow_pickle):
        code = EXIT_INTEGRITY if asked.name == "checkpoint" else EXIT_NUMERICS
        fix = "pass the checkpoint the folder was made from (manifest.json lists its files' hashes)" \
            if asked.name == "checkpoint" else ""
        result.checks.append(Check(asked.subject, asked.name, asked.passed, asked.message, code,
                                   time.perf_counter() - t0, fix))


VERIFY_STEPS = 4  # decode steps a verify re-runs (teacher-forced and free), against the stored bars


def _rerun_generation(out: Path, entry: dict[str, Any], result: VerifyResult, timeout_s: float) -> None:
    """A short generation from the target's prefill and decode programs, in a fresh process: each step's logits
    against the stored float64 reference and the bar convert stored, and the tokens it picks."""
    name = entry["name"]
    if _cannot_load_here(entry, result):
        return
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        answer = run_session(out, name, Path(scratch) / "session.log", time_it=False, steps=VERIFY_STEPS,
                             timeout_s=timeout_s, scratch=Path(scratch))
        log = (Path(scratch) / "session.log").read_text(errors="replace")[-400:] if "error" in answer else ""
    if "error" in answer:
        result.checks.append(Check(name, "loads", False, f"no longer loads or runs: {answer['error']}"
                                   + (f" ({log.strip().splitlines()[-1]})" if log.strip() else ""), EXIT_TARGET,
                                   time.perf_counter() - t0))
        result.checks.append(Check(name, "numerics", None, "not run: the artifact did not load"))
        return
    result.checks.append(Check(name, "loads", True, f"loaded in {answer['load_s']:.1f} s"))
    numerics = answer["numerics"]
    steps = len(numerics["steps"])
    if numerics["passed"]:
        tokens = "tokens identical to the reference" if numerics["tokens_identical"] else \
            "tokens differ only at near-ties" if all(d["near_tie"] for d in numerics["token_differences"]) else \
            "tokens differ"
        message = f"{steps} generation steps within their stored bars; {tokens}"
    else:
        message = "; ".join(numerics["failures"][:3]) or "NaN/Inf in the logits"
    result.checks.append(Check(name, "numerics", numerics["passed"], message, EXIT_NUMERICS,
                               time.perf_counter() - t0))


def summary(result: VerifyResult) -> str:
    artifacts = sorted({c.subject for c in result.checks if c.name == "numerics" and c.passed})
    if result.passed:
        return (f"verified {result.out}: every file matches manifest.json; "
                f"{len(artifacts)} artifact(s) re-run within their bars ({', '.join(artifacts) or 'none'})")
    return f"verification of {result.out} failed (exit {result.exit_code}): {len(result.problems)} problem(s)"


__all__ = ["verify", "VerifyResult", "Check", "EXIT_INTEGRITY", "artifact_spec", "load_reference", "compare_rerun",
           "summary", "untrusted_entry"]
