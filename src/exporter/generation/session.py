"""Judge and time one built generation target in a process of its own.

    python -m exporter.generation.session REQUEST.json RESULT.json

The request names the output folder (staged or final), the target, what to time and whether to time at all;
the session loads the target's two programs, runs them teacher-forced on the reference's tokens (each step's
logits judged against the stored bars), runs them on their own (greedy), times them, and writes the result.
Then it is judged a second time at batch 1, each prompt row alone, as the reference generated it
(:func:`judge_rows_alone`): the batch a single prompt runs at, with the decode program of batch 1 where the
target built one. Both verdicts must pass: a program can hold a guard or a specialisation that only a batch
of one row meets (BLOOM's prefill once held a guard that the batch exceeds 1).
``exporter convert`` runs one per target (an AOTInductor package loads with the compiler's libstdc++ preloaded
where that is needed: ``targets.toolchain``); ``exporter verify`` runs one without timing.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..attention_backend import backend_context
from ..errors import UsageError, describe
from ..measure.bench import synchronize
from .decoder import DECODER
from .driver import generate
from .encoder_decoder import ENCODER_DECODER, TASKS
from .family import Family
from .judge import judge_steps

MANIFEST = "generation.json"
REFERENCE = "reference/generation.safetensors"


def finite(value: Any) -> Any:
    """JSON-safe: NaN and Inf as None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def read_setup(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The folder's generation setup and stored reference; a UsageError (one line) where either is unreadable."""
    try:
        setup = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        if not isinstance(setup, dict) or not isinstance(setup.get("layout"), dict):
            raise ValueError("not a generation setup")
        stored = load_file(folder / REFERENCE)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # JSON, UTF-8 and safetensors' errors included
        raise UsageError(f"{folder.name}'s generation setup is damaged ({describe(exc, 120)})",
                         f"run exporter verify {folder} to see what changed, or convert again") from None
    return setup, stored


def check_setup(folder: Path) -> None:
    """What generate reads as data (``generation.json``, the stored reference) against ``manifest.json``'s SHA-256,
    as verify checks them: a changed setup (a cache length the programs do not have) is refused before anything
    loads (exit 6). The programs themselves load as data (``targets/program_file.py``); verify hashes them."""
    from ..errors import IntegrityError  # noqa: PLC0415
    from ..outdir import sha256_file  # noqa: PLC0415

    fix = f"run exporter verify {folder} to see what changed, or convert again"
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        recorded = {str(f["path"]): f["sha256"] for f in manifest["files"]}
    except FileNotFoundError:
        raise IntegrityError(f"{folder.name} holds no manifest.json (its convert never finished)", fix) from None
    except (OSError, ValueError, KeyError, TypeError):
        raise IntegrityError(f"{folder.name}'s manifest.json is damaged", fix) from None
    for rel in (MANIFEST, REFERENCE):
        if rel not in recorded:
            raise IntegrityError(f"{rel} is not listed in {folder.name}'s manifest.json", fix)
        if not (folder / rel).is_file() or sha256_file(folder / rel) != recorded[rel]:
            raise IntegrityError(f"{rel} does not match its SHA-256 in manifest.json (changed after convert)", fix)


def family_for(task: str | None) -> Family:
    """The family that generates for ``task`` (a folder from before the task was recorded is a decoder's)."""
    return ENCODER_DECODER if task in TASKS else DECODER


def stored_prompt(family: Family, stored: dict[str, torch.Tensor]) -> Any:
    """The prompt kept in the stored reference (``run.write_setup`` wrote it)."""
    return family.prompt_class(*(stored[name] for name in family.stored))


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Load the target's programs, judge them step by step against the stored float64 generation (teacher-forced,
    then free-running; a decoder's rows also alone at batch 1), then time them where the request asks."""
    folder = Path(request["folder"])
    setup, stored = read_setup(folder)
    family, device = family_for(setup.get("task")), setup["device"]
    result: dict[str, Any] = {"target": request["target"]}
    with backend_context(setup["attention_backend"], device):
        t0 = time.perf_counter()
        steps = family.load_steps(request["target"], folder, setup)
        synchronize(device)
        result["load_s"] = time.perf_counter() - t0
        prompt = stored_prompt(family, stored)
        ref_tokens, ref_logits = stored["tokens"], stored["logits"]
        count = int(request.get("steps") or ref_tokens.shape[1])
        _, logits = family.generate(steps, prompt, count, forced=ref_tokens[:, :count])
        free, _ = family.generate(steps, prompt, count, keep_logits=False)
        numerics = setup["numerics"]
        result["numerics"] = judge_steps(request["target"], ref_logits[:count], ref_tokens[:, :count], logits, free,
                                         numerics["bars"], numerics["k"], numerics["atol"])
        if family.rows_alone:
            merge_batch_1(result["numerics"],
                          judge_rows_alone(request["target"], steps, prompt, ref_tokens, ref_logits, count, numerics))
        if request.get("time"):
            result["bench"] = family.time(steps, prompt, setup["timing"])
    return finite(result)


def judge_rows_alone(target: str, steps, prompt: Any, ref_tokens: torch.Tensor, ref_logits: torch.Tensor,
                     count: int, numerics: dict[str, Any]) -> dict[str, Any]:
    """Batch 1 judged: each prompt row alone and unpadded (as the reference generated it), teacher-forced then
    free-running (with the decode program of batch 1 where there is one), the rows' logits stacked back into the
    batch and held to the same bars."""
    forced_rows: list[list[torch.Tensor]] = []
    free_rows: list[torch.Tensor] = []
    for row in range(prompt.batch):
        alone = prompt.row(row)
        _, logits = generate(steps, alone, count, forced=ref_tokens[row:row + 1, :count])
        free, _ = generate(steps, alone, count, keep_logits=False)
        forced_rows.append(logits)
        free_rows.append(free)
    stacked = [torch.cat([rows[t] for rows in forced_rows]) for t in range(count)]
    return judge_steps(f"{target} (batch 1)", ref_logits[:count], ref_tokens[:, :count], stacked,
                       torch.cat(free_rows), numerics["bars"], numerics["k"], numerics["atol"])


def merge_batch_1(verdict: dict[str, Any], alone: dict[str, Any]) -> None:
    """``alone`` (batch 1, each row alone) kept in ``verdict["batch_1"]``; the verdict passes if both do."""
    verdict["batch_1"] = alone
    ratios = [r for r in (verdict.get("worst_ratio"), alone.get("worst_ratio")) if isinstance(r, (int, float))]
    verdict["worst_ratio"] = max(ratios) if ratios else None
    verdict["passed"] = bool(verdict["passed"]) and bool(alone["passed"])
    verdict["failures"] = list(verdict["failures"]) + [f"batch 1: {f}" for f in alone["failures"]]
    if not alone["passed"] and not alone["failures"]:
        verdict["failures"].append("batch 1: NaN/Inf in the logits")


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    try:
        result = run(request)
    except Exception as exc:  # reported by the parent as this target's failure
        result = {"target": request.get("target"), "error": describe(exc)}
        import traceback  # noqa: PLC0415

        traceback.print_exc()
    Path(argv[1]).write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    raise SystemExit(main(sys.argv[1:]))
