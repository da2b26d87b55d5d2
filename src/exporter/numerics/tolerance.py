"""The tolerance policy and its metrics: one rule for convert, validate and verify.

The reference is the original model (eager attention, not rewritten) run in
float64 on the CPU. Each candidate is compared with it per sample and per
output. The gate is the rule PyTorch's own benchmark harness uses
(``torch._dynamo.utils.same`` with an fp64 reference): a candidate passes when

    rmse(candidate, ref64) <= k * rmse(eager_in_same_dtype, ref64) + floor * u(dtype) * rms(ref64) + atol

so a candidate may be at most ``k`` times as wrong as the original model
already is at that precision (``k``'s defaults: ``dtypes.K_DEFAULTS``), plus a
floor in the output's own units: ``floor`` roundings to the candidate's dtype
(unit roundoff ``u``: 2^-24 for float32, 2^-8 for bfloat16) at the reference
output's RMS, which only matters where the eager model happens to be exact, plus
an absolute ``atol`` (0 unless a recipe sets it). A fixed absolute floor would
dwarf the eager error of a float32 model whose outputs are small and let a
defect many times that error pass. NaN or Inf where the reference is finite always fails;
integer and boolean outputs must match exactly. ``exporter verify`` applies the
same check with the bar convert stored (:func:`check_against`).
"""

from __future__ import annotations

import functools
import math

import torch

from ..dtypes import UNIT_ROUNDOFF
from ..results import CandidateNumerics, OutputCheck, ratio

Outputs = list[torch.Tensor]  # one model run: outputs in signature order

RULE = ("rmse(candidate, ref) <= k * s(n) * rmse(eager in the candidate's dtype, ref) + floor * u(dtype) * rms(ref) "
        "+ atol")

# s(n): one check's chance of failing a candidate exactly as accurate as eager, on the sampling of its n errors alone
FALSE_FAILURE = 1e-4
_Z = 3.719016485455709  # the standard normal's (1 - FALSE_FAILURE) quantile
_EXACT_UP_TO = 4000  # above: log F(n, n) is normal with variance 4/n to within 0.1% of s(n)


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 20000):
        for numerator in (m * (b - m) * x / ((a - 1.0 + 2 * m) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 1.0 + 2 * m))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def _ratio_quantile(n: int, tail: float) -> float:
    """The ``1 - tail`` quantile of ``rmse(X) / rmse(Y)``, X and Y two independent draws of ``n`` zero-mean normal
    errors of one variance: the square root of F(n, n)'s quantile."""
    if n <= 0:
        return 1.0
    if n > _EXACT_UP_TO:
        return math.exp(_normal_quantile(tail) / math.sqrt(n))
    a = n / 2.0
    # P(F > f) = I_{1/(1+f)}(a, a): bisect on log x for I_x(a, a) = tail, then f = 1/x - 1
    low, high = math.log(1e-300), math.log(0.5)
    for _ in range(200):
        mid = (low + high) / 2.0
        if regularized_beta(math.exp(mid), a, a) > tail:
            high = mid
        else:
            low = mid
    return math.sqrt(1.0 / math.exp((low + high) / 2.0) - 1.0)


def _normal_quantile(tail: float) -> float:
    """z with P(Z > z) = tail (bisection on erfc)."""
    low, high = 0.0, 40.0
    for _ in range(200):
        mid = (low + high) / 2.0
        if 0.5 * math.erfc(mid / math.sqrt(2.0)) > tail:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


@functools.lru_cache(maxsize=4096)
def sampling_factor(n: int) -> float:
    """How far one check's RMSE ratio can exceed the true ratio by chance: the (1 - FALSE_FAILURE) quantile of
    ``rmse(X) / rmse(Y)`` for X and Y two independent draws of ``n`` zero-mean normal errors of one variance,
    the square root of the F(n, n) distribution's quantile.

    The rule compares two random quantities, the candidate's error and eager's, each measured on the output's
    ``n`` values. On a large output both are sharp (s(10^6) = 1.004) and ``k`` alone says how much worse the
    candidate may be. On a small one they are not: with ``n`` = 1 (a CLIP ``logits_per_image`` for one text and
    one image) a candidate exactly as accurate as eager lands above ``2 x`` eager's error 30% of the time, with
    ``n`` = 4 10%, with ``n`` = 16 0.4%. s(1) = 6366, s(4) = 13.1, s(64) = 1.61, s(1024) = 1.12. A defect is not
    hidden by this: it shows in the larger outputs the small one is computed from (docs/numerics.md)."""
    return _ratio_quantile(n, FALSE_FAILURE)


POWER = 0.95  # the probability with which the rounding check's stated increase is caught


@functools.lru_cache(maxsize=4096)
def detectable_ratio(k: float, n: int, power: float = POWER) -> float:
    """The rounding check's stated power: the smallest true ratio ``rmse(candidate) / rmse(eager)`` that one check
    of an output of ``n`` values fails with probability ``power``.

    One check fails when the measured ratio passes ``k * s(n)``; the measured ratio is the true one times the
    square root of an F(n, n) draw, so it fails with probability ``power`` from a true ratio of
    ``k * s(n) * q`` on, ``q`` that draw's ``power`` quantile. A candidate whose error is that many times eager's
    (an increase of ``ratio - 1``) fails; a defect smaller than that is for the weights and program proofs."""
    return widened(k, n) * _ratio_quantile(n, 1.0 - power)


def widened(k: float, n: int) -> float:
    """The rule's multiplier on eager's error for an output of ``n`` values: ``k * s(n)``."""
    return k * sampling_factor(int(n))


def relative_floor(floor: float, dtype: str) -> float:
    """The floor's factor on rms(reference): ``floor`` unit roundoffs of ``dtype``."""
    return floor * UNIT_ROUNDOFF[dtype]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else float("inf")


def metrics(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    """max abs, max rel, relative L2, cosine and RMSE of ``candidate`` against ``reference`` (in float64)."""
    ref = reference.detach().to("cpu", torch.float64).reshape(-1)
    cand = candidate.detach().to("cpu", torch.float64).reshape(-1)
    judged = torch.isfinite(ref)  # where the reference is NaN/Inf nothing can be judged: counted, not summed
    ref_nonfinite = int((~judged).sum())
    ref, cand = ref[judged], cand[judged]
    if ref.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0, "cosine": 1.0, "rmse": 0.0, "ref_rms": 0.0,
                "ref_nonfinite": ref_nonfinite}
    diff = (cand - ref).abs()
    max_abs = float(diff.max())
    max_rel = float((diff / ref.abs().clamp_min(1e-12)).max())
    ref_norm = float(ref.norm())
    rel_l2 = float((cand - ref).norm()) / ref_norm if ref_norm > 0 else float((cand - ref).norm())
    denom = float(ref.norm() * cand.norm())
    cosine = float(ref @ cand) / denom if denom > 0 else (1.0 if max_abs == 0 else 0.0)
    rmse = float(((cand - ref) ** 2).mean().sqrt())
    ref_rms = float(ref.square().mean().sqrt())
    return {"max_abs": _finite(max_abs), "max_rel": _finite(max_rel), "rel_l2": _finite(rel_l2),
            "cosine": cosine if math.isfinite(cosine) else 0.0, "rmse": _finite(rmse), "ref_rms": ref_rms,
            "ref_nonfinite": ref_nonfinite}


def check_output(name: str, sample: int, reference: torch.Tensor, baseline: torch.Tensor, candidate: torch.Tensor,
                 k: float, atol: float, relative: float = 0.0) -> OutputCheck:
    """The rule: the bar is ``k * rmse(baseline, reference) + relative * rms(reference) + atol``
    (``relative``: :func:`relative_floor`)."""
    comparable = tuple(candidate.shape) == tuple(reference.shape) and reference.is_floating_point()
    base_metrics = metrics(reference, baseline) if comparable else {"rmse": 0.0, "ref_rms": 0.0}
    base, floor = base_metrics["rmse"], relative * base_metrics["ref_rms"]
    n = reference.numel()
    return check_against(name, sample, reference, candidate, widened(k, n) * base + floor + atol, base,
                         explain_bar(k, base, floor, atol, n))


def explain_bar(k: float, base: float, floor: float | None, atol: float, n: int = 0) -> str:
    """How a bar was made, for a failure's reason (``floor`` None: added later, where the reference is read;
    ``n``: the output's values, shown when their sampling widens ``k`` by 1% or more)."""
    factor = sampling_factor(int(n))
    text = f"k={k:g}" + (f" x s({n})={factor:.3g}" if factor >= 1.01 else "") + f" x baseline {base:.3g}"
    text += f" + floor {floor:.3g}" if floor else ""
    return text + (f" + atol {atol:g}" if atol else "")


def check_against(name: str, sample: int, reference: torch.Tensor, candidate: torch.Tensor, allowed: float,
                  baseline_rmse: float = 0.0, explain: str = "") -> OutputCheck:
    """``candidate`` against ``reference`` with a given bar (``allowed`` RMSE): a shape that differs, an integer
    output that differs, or NaN/Inf where the reference is finite fails whatever the bar."""
    if tuple(candidate.shape) != tuple(reference.shape):
        return OutputCheck(name, sample, math.inf, math.inf, math.inf, 0.0, math.inf, 0.0, 0.0, False,
                           f"shape {list(candidate.shape)} differs from the reference's {list(reference.shape)}")
    if not reference.is_floating_point():
        equal = bool(torch.equal(candidate.cpu().to(reference.dtype), reference.cpu()))
        value = 0.0 if equal else math.inf
        return OutputCheck(name, sample, value, value, value, 1.0 if equal else 0.0, value, 0.0, 0.0, equal,
                           "" if equal else "integer output differs")
    m = metrics(reference, candidate)
    ref_finite = torch.isfinite(reference.cpu())
    cand_finite = torch.isfinite(candidate.detach().cpu())
    nonfinite = int((ref_finite & ~cand_finite).sum())  # NaN/Inf where the reference is finite
    return check_against_metrics(name, sample, m, nonfinite, allowed, baseline_rmse, explain)


def check_against_metrics(name: str, sample: int, m: dict[str, float], nonfinite: int, allowed: float,
                          baseline_rmse: float = 0.0, explain: str = "") -> OutputCheck:
    """The verdict from a floating output's metrics (whole, or accumulated chunk by chunk) and its bar."""
    reason = ""
    passed = m["rmse"] <= allowed and math.isfinite(allowed)
    if m.get("ref_nonfinite"):
        passed = False  # fail closed: a reference with NaN/Inf in it would let anything through
        reason = (f"the float64 reference holds {m['ref_nonfinite']} NaN/Inf value(s) in this output (the original "
                  "model gives them in float64): it cannot judge the candidate there")
    elif nonfinite:
        passed = False
        reason = f"{nonfinite} NaN/Inf value(s) where the reference is finite"
    elif not math.isfinite(allowed):
        reason = (f"no finite bar: the eager model's own error against the reference is {baseline_rmse:.3g} "
                  "(NaN/Inf in its output)")
    elif not passed:
        reason = f"rmse {m['rmse']:.3g} > allowed {allowed:.3g}" + (f" ({explain})" if explain else "")
    return OutputCheck(name, sample, m["max_abs"], m["max_rel"], m["rel_l2"], m["cosine"], m["rmse"], baseline_rmse,
                       allowed, passed, reason)


def judge(candidate: str, output_names: tuple[str, ...], reference: list[Outputs], baseline: list[Outputs],
          outputs: list[Outputs], k: float, atol: float, baseline_label: str,
          relative: float = 0.0) -> CandidateNumerics:
    """Compare every sample and output (whole tensors in memory); keep each output's worst sample and every
    failure."""
    checks = []
    for index, (ref, base, cand) in enumerate(zip(reference, baseline, outputs)):
        if len(cand) != len(output_names):
            checks.append(OutputCheck("*", index, math.inf, math.inf, math.inf, 0.0, math.inf, 0.0, 0.0, False,
                                      f"returned {len(cand)} outputs, expected {len(output_names)}"))
            continue
        checks += [check_output(name, index, r, b, c, k, atol, relative)
                   for name, r, b, c in zip(output_names, ref, base, cand)]
    return verdict_of_checks(candidate, output_names, checks, k, atol, baseline_label)


def verdict_of_checks(candidate: str, output_names: tuple[str, ...], checks: list[OutputCheck], k: float, atol: float,
                      baseline_label: str) -> CandidateNumerics:
    """A candidate's verdict from its checks: each output's worst sample, every failure (worst first)."""
    result = CandidateNumerics(candidate, True, k, atol, baseline_label)
    worst: dict[str, OutputCheck] = {}
    for check in checks:
        if check.output != "*":  # "*": the run returned the wrong number of outputs
            result.checks.append(check)
        if not check.passed:
            result.failures.append(check)
            result.passed = False
        current = worst.get(check.output)
        if check.output != "*" and (current is None or ratio(check) > ratio(current)):
            worst[check.output] = check
    result.worst = [worst[n] for n in output_names if n in worst]
    result.failures.sort(key=ratio, reverse=True)  # the worst failure first: it names the candidate's error
    return result
