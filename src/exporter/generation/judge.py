"""Per-step verdicts of a generation: the tolerance rule on each step's logits, then the tokens.

Each step's logits (teacher-forced: the candidate read the reference's tokens) are judged by the same rule
as any output (``numerics.tolerance``): rmse against the float64 reference at most ``k`` times the eager
model's own error in the candidate's dtype, plus the floor. The bar of each step is computed once, in the
convert (``step_bars``), stored, and applied again by ``exporter verify``.

Then the tokens: the candidate's pick at each step against the reference's. Where they differ the report
gives the step and the margins there. A pick that flips while the step's logits pass is a near-tie: the
reference's own margin between the two tokens is within the candidate's allowed error (at most twice the
largest logit error, or the flip could not happen). A defect shows as logits that fail the rule, at that
step or at every step after it (a drift).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..numerics.tolerance import check_against, explain_bar, metrics, verdict_of_checks, widened


def step_name(step: int) -> str:
    return f"logits step {step}"


def step_bars(reference: torch.Tensor, baseline: torch.Tensor, k: float, relative: float, atol: float) -> list[dict]:
    """Each step's bar: ``k * s(n) * rmse(baseline, reference) + relative * rms(reference) + atol``."""
    bars = []
    for ref, base in zip(reference, baseline):
        m = metrics(ref, base)
        floor = relative * m["ref_rms"]
        bars.append({"allowed_rmse": widened(k, ref.numel()) * m["rmse"] + floor + atol, "baseline_rmse": m["rmse"],
                     "explain": explain_bar(k, m["rmse"], floor, atol, ref.numel())})
    return bars


def judge_steps(candidate: str, reference: torch.Tensor, ref_tokens: torch.Tensor, logits: list[torch.Tensor],
                free_tokens: torch.Tensor | None, bars: list[dict], k: float, atol: float) -> dict[str, Any]:
    """The verdict of one candidate: ``reference`` ``[N, B, V]`` float64, ``logits`` one ``[B, V]`` per step
    from the teacher-forced run, ``free_tokens`` ``[B, N]`` from its own greedy run (None: not run)."""
    checks = [check_against(step_name(t), 0, reference[t], logits[t], bar["allowed_rmse"], bar["baseline_rmse"],
                            bar["explain"]) for t, bar in enumerate(bars[:len(logits)])]
    numerics = verdict_of_checks(candidate, tuple(step_name(t) for t in range(len(checks))), checks, k, atol,
                                 "eager")
    steps = [{"step": t, "passed": c.passed, "rmse": c.rmse, "allowed_rmse": c.allowed_rmse, "max_abs": c.max_abs,
              "reason": c.reason} for t, c in enumerate(checks)]
    picks = torch.stack([row.argmax(-1) for row in logits], dim=1)  # [B, N] the candidate's pick at each step
    differences = []
    for row in range(ref_tokens.shape[0]):
        wrong = (picks[row] != ref_tokens[row]).nonzero()
        if not len(wrong):
            continue
        t = int(wrong[0])
        ref_tok, cand_tok = int(ref_tokens[row, t]), int(picks[row, t])
        ref_row, cand_row = reference[t, row].double(), logits[t][row].double()
        ref_margin = float(ref_row[ref_tok] - ref_row[cand_tok])
        error = float((cand_row - ref_row).abs().max())
        differences.append({
            "row": row, "step": t, "reference_token": ref_tok, "candidate_token": cand_tok,
            "reference_margin": ref_margin, "candidate_margin": float(cand_row[cand_tok] - cand_row[ref_tok]),
            "max_logit_error": error, "step_passed": checks[t].passed,
            "near_tie": checks[t].passed and ref_margin <= 2 * error,
        })
    free = None
    if free_tokens is not None:
        same = free_tokens.shape == ref_tokens.shape and bool(torch.equal(free_tokens.cpu(), ref_tokens.cpu()))
        free = {"identical": same, "tokens": free_tokens.tolist()}
    nonfinite = sum(int((~torch.isfinite(x)).sum()) for x in logits)
    return {
        "passed": numerics.passed and nonfinite == 0,
        "steps": steps,
        "worst_ratio": max((c.rmse / c.allowed_rmse if c.allowed_rmse > 0 else (0.0 if c.rmse == 0 else math.inf))
                           for c in checks) if checks else None,
        "failures": [f"{c.output}: {c.reason}" for c in numerics.failures],
        "token_differences": differences,
        "tokens_identical": not differences,
        "free_running": free,
        "nonfinite_logits": nonfinite,
    }
