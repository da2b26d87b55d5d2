"""Per-step verdicts of a generation: the tolerance rule on each step's logits, then the tokens.

Each step's logits (teacher-forced: the candidate read the reference's tokens) are judged by the same rule
as any output (``numerics.tolerance``): rmse against the float64 reference at most ``k`` times the eager
model's own error in the candidate's dtype, plus the floor. The bar of each step is computed once, in the
convert (``step_bars``), stored, and applied again by ``exporter verify``.

The verdict has two parts, one per program: the prefill's step (step 0) alone, and the decode steps pooled, as a
forward output pools its positions (``decode_bar``: the rmse over every decode step's logits against ``k x s(n)``
times eager's over the same steps, ``n`` all their values). One step's logits are one position: their values
share that position's hidden state, so one step's rmse swings far more than ``s(n)`` of its values allows (on
the trained model in float32, eager's own error ranges 0.67-2.21e-6 over eight steps), and a clean runtime that
rounds one position's sines differently failed its step at 2.55x eager's there while its decode steps together
were 1.14x eager's. Each step is still measured against its own bar and reported: when the pool fails, the steps
over their own bars (or the worst one) are the ones marked failed, so a defect is still named by its first step.

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


def decode_bar(bars: list[dict], k: float, atol: float, values: int) -> dict[str, Any]:
    """The decode steps' pooled bar from their own stored bars (``values`` each): ``k * s(n) * rms(eager's step
    errors) + rms(the steps' floors) + atol``, ``n`` every value of the steps (an rmse over steps of equal size
    is the root mean square of theirs)."""
    n = values * len(bars)
    baseline = math.sqrt(sum(b["baseline_rmse"] ** 2 for b in bars) / len(bars))
    floors = [max(b["allowed_rmse"] - widened(k, values) * b["baseline_rmse"] - atol, 0.0) for b in bars]
    floor = math.sqrt(sum(f * f for f in floors) / len(floors))
    return {"allowed_rmse": widened(k, n) * baseline + floor + atol, "baseline_rmse": baseline,
            "explain": explain_bar(k, baseline, floor, atol, n)}


def decode_name(steps: int) -> str:
    return f"logits, decode steps 1-{steps - 1}" if steps > 2 else "logits, decode step 1"


def judge_steps(candidate: str, reference: torch.Tensor, ref_tokens: torch.Tensor, logits: list[torch.Tensor],
                free_tokens: torch.Tensor | None, bars: list[dict], k: float, atol: float) -> dict[str, Any]:
    """The verdict of one candidate: ``reference`` ``[N, B, V]`` float64, ``logits`` one ``[B, V]`` per step
    from the teacher-forced run, ``free_tokens`` ``[B, N]`` from its own greedy run (None: not run). The prefill's
    step is judged alone, the decode steps pooled (see the module's docstring)."""
    bars = bars[:len(logits)]
    checks = [check_against(step_name(t), 0, reference[t], logits[t], bar["allowed_rmse"], bar["baseline_rmse"],
                            bar["explain"]) for t, bar in enumerate(bars)]
    judged = checks[:1]
    decode = None
    if len(checks) > 1:
        pooled = decode_bar(bars[1:], k, atol, int(reference[1].numel()))
        same = all(t.shape == reference[1].shape for t in logits[1:len(checks)])
        stacked = torch.stack(logits[1:len(checks)]) if same else logits[1]  # a wrong shape fails the pool
        decode = check_against(decode_name(len(checks)), 0, reference[1:len(checks)], stacked, pooled["allowed_rmse"],
                               pooled["baseline_rmse"], pooled["explain"])
        judged.append(decode)
    names = tuple(c.output for c in judged)
    numerics = verdict_of_checks(candidate, names, judged, k, atol, "eager")
    over = [not c.passed for c in checks]  # each step against its own bar
    if decode is not None and not decode.passed and not any(over[1:]):
        worst = max(range(1, len(checks)), key=lambda t: checks[t].rmse / max(checks[t].allowed_rmse, 1e-300))
        over[worst] = True  # the pool failed: its worst step is named
    steps = [{"step": t, "passed": c.passed if t == 0 else (decode is not None and decode.passed) or not over[t],
              "rmse": c.rmse, "allowed_rmse": c.allowed_rmse, "max_abs": c.max_abs, "reason": c.reason,
              "over_step_bar": not c.passed} for t, c in enumerate(checks)]
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
            "max_logit_error": error, "step_passed": steps[t]["passed"],
            "near_tie": steps[t]["passed"] and ref_margin <= 2 * error,
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
                           for c in judged) if judged else None,
        "decode": None if decode is None else {"steps": len(checks) - 1, "passed": decode.passed, "rmse": decode.rmse,
                                               "allowed_rmse": decode.allowed_rmse, "reason": decode.reason},
        "failures": [f"{c.output}: {c.reason}" for c in numerics.failures],
        "token_differences": differences,
        "tokens_identical": not differences,
        "free_running": free,
        "nonfinite_logits": nonfinite,
    }
