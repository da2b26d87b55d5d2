"""What the quantization cost: the second question of the fp8 gate, kept apart from the first.

The first question (is each artifact faithful to the quantized model?) is the ordinary gate, run with the
quantized model as the eager baseline and its float64 arithmetic as the reference. This module answers the
second: how far the quantized model (eager, in the recipe's dtype) sits from the original model's float64
reference, side by side with the unquantized model in the same dtype, and which layers cost most.

- Per layer: each fp8 linear's output against the float64 product of the original weight with the same input
  (its SQNR in dB). It does not depend on how chaotic the whole model is, so it is judged everywhere.
- Per output: SQNR and relative L2 against the original float64 reference, and the ratio of the fp8 error to
  the unquantized model's own error ("fp8 error = N x bf16 error"). An output passes when its SQNR reaches the
  budget, or, where the unquantized model itself is far from float64 (deep random-weight models are chaotic even
  in bf16), when the fp8 error is within ``max_error_ratio`` times that model's own error.
- Logits (an output named ``logits``, teacher-forced over every position the attention mask keeps): the top-1
  agreement of the quantized model with the unquantized one and the mean KL divergence of the next-token
  distribution, each judged against the budget or, where the unquantized model is itself far from float64,
  relative to that model's own agreement and KL (random weights: a 4-layer slice of the 8B shape in bf16 agrees
  with float64 on a third of the tokens); the KL's allowance is ``max_error_ratio`` squared, KL being second
  order in the error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import Fp8Linear
from .transform import Quantized

INF_DB = 999.0  # an exact match, written as a finite number in JSON


CHUNK_ROWS = 1024  # rows of a large output (logits: tokens x vocabulary) taken in float64 at a time


def _chunks(*tensors: torch.Tensor):
    """The tensors' rows (last dimension kept), ``CHUNK_ROWS`` at a time, detached, in float64 on the first's
    device: a 128k-vocabulary logits tensor is never copied to float64 whole."""
    flat = [t.detach().reshape(-1, t.shape[-1]) if t.dim() else t.detach().reshape(1, 1) for t in tensors]
    device = flat[0].device
    for start in range(0, flat[0].shape[0], CHUNK_ROWS):
        yield [f[start:start + CHUNK_ROWS].to(device=device, dtype=torch.float64) for f in flat]


def _noise_and_signal(candidate: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    noise = signal = 0.0
    for cand, ref in _chunks(candidate, reference):
        noise += float((cand - ref).pow(2).sum())
        signal += float(ref.pow(2).sum())
    return noise, signal


def sqnr_db(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    noise, signal = _noise_and_signal(candidate, reference)
    if noise == 0.0:
        return INF_DB
    if signal == 0.0:
        return -INF_DB
    return min(INF_DB, 10.0 * math.log10(signal / noise))


def relative_l2(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    noise, signal = _noise_and_signal(candidate, reference)
    if signal == 0.0:
        return 0.0 if noise == 0.0 else math.inf
    return math.sqrt(noise / signal)


@dataclass(frozen=True)
class Budget:
    """The second question's thresholds (``[quantize]`` in the recipe, where their defaults live)."""

    min_sqnr_db: float  # every output, against the original float64 reference
    max_error_ratio: float  # ... or its error within this many times the unquantized model's own
    layer_min_sqnr_db: float  # every fp8 linear
    min_top1: float  # logits: top-1 agreement with the unquantized model
    max_kl: float  # logits: mean KL(unquantized || quantized) of the next-token distribution, nats

    def to_dict(self) -> dict[str, float]:
        return {"min_sqnr_db": self.min_sqnr_db, "max_error_ratio": self.max_error_ratio,
                "layer_min_sqnr_db": self.layer_min_sqnr_db, "min_top1": self.min_top1, "max_kl": self.max_kl}


def layer_sqnr(model: nn.Module, quantized: Quantized, run) -> None:
    """Run ``run()`` (one forward of the quantized model) with a hook on every fp8 linear that compares its
    output with the original weight's float64 product of the same input; fills each layer's ``sqnr_db``
    (the worst over the calls of one forward)."""
    names = {id(m): n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    handles = []

    def hook(module, args, output):
        name = names.get(id(module))
        weight, bias = quantized.originals.get(name, (None, None))
        if weight is None:
            return
        x = args[0].detach()
        noise = signal = 0.0
        w64, b64 = weight.detach().double(), None if bias is None else bias.detach().double()
        for rows, out in _chunks(x, output):  # the float64 product of the original weight, rows at a time
            exact = F.linear(rows, w64, b64)
            noise += float((out - exact).pow(2).sum())
            signal += float(exact.pow(2).sum())
        value = INF_DB if noise == 0.0 else (-INF_DB if signal == 0.0 else
                                             min(INF_DB, 10.0 * math.log10(signal / noise)))
        layer = quantized.layer(name)
        layer.sqnr_db = value if layer.sqnr_db is None else min(layer.sqnr_db, value)

    for module in model.modules():
        if isinstance(module, Fp8Linear):
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            run()
    finally:
        for handle in handles:
            handle.remove()


def _positions(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The logits rows to judge: every position, or those the attention mask keeps."""
    rows = logits.reshape(-1, logits.shape[-1])
    if mask is not None and mask.dim() >= 1 and tuple(mask.shape) == tuple(logits.shape[:-1]):
        rows = rows[mask.reshape(-1).to(rows.device) != 0]
    return rows


def top1_and_kl(candidate: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None) -> tuple[float, float]:
    """(share of positions whose argmax agrees, mean KL(target || candidate) in nats), in float64, a chunk of
    positions at a time."""
    cand_rows, ref_rows = _positions(candidate, mask), _positions(target, mask)
    if cand_rows.shape[0] == 0:
        return 1.0, 0.0
    agree = kl = 0.0
    for cand, ref in _chunks(cand_rows, ref_rows.to(cand_rows.device)):
        agree += float((cand.argmax(-1) == ref.argmax(-1)).sum())
        kl += float(F.kl_div(F.log_softmax(cand, -1), F.log_softmax(ref, -1), log_target=True,
                             reduction="sum"))
    return agree / cand_rows.shape[0], kl / cand_rows.shape[0]


@dataclass
class Cost:
    """The second question's figures and verdict."""

    scheme: str
    budget: Budget
    dtype: str  # the unquantized model's dtype, its error shown beside the fp8 one
    outputs: list[dict[str, Any]] = field(default_factory=list)
    logits: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def error(self) -> str | None:
        return "; ".join(self.problems) if self.problems else None


def judge_outputs(cost: Cost, names: tuple[str, ...], samples: list[dict[str, torch.Tensor]],
                  quantized: list[list[torch.Tensor]], unquantized: list[list[torch.Tensor]],
                  reference: list[list[torch.Tensor]]) -> None:
    """Fill ``cost`` with every output's figures (quantized and unquantized eager outputs in the recipe's dtype,
    the original model's float64 reference) and its problems against the budget."""
    budget = cost.budget
    for index, (sample, q_outs, u_outs, refs) in enumerate(zip(samples, quantized, unquantized, reference)):
        mask = sample.get("attention_mask")
        for name, q, u, ref in zip(names, q_outs, u_outs, refs):
            if not (ref.is_floating_point() and q.is_floating_point()):
                continue
            ref = ref.to(q.device)
            q_err, u_err = relative_l2(q, ref), relative_l2(u, ref)
            ratio = q_err / u_err if u_err else (1.0 if q_err == 0.0 else math.inf)
            q_db = round(sqnr_db(q, ref), 3)
            row: dict[str, Any] = {"output": name, "sample": index, "sqnr_db": q_db, "relative_l2": q_err,
                                   "unquantized_sqnr_db": round(sqnr_db(u, ref), 3), "unquantized_relative_l2": u_err,
                                   "error_ratio": ratio,
                                   "passed": q_db >= budget.min_sqnr_db or ratio <= budget.max_error_ratio}
            cost.outputs.append(row)
            if not row["passed"]:
                cost.problems.append(
                    f"output {name} (sample {index}): SQNR {row['sqnr_db']:.1f} dB < {budget.min_sqnr_db:g} dB and "
                    f"fp8 error = {ratio:.1f} x {cost.dtype} error > {budget.max_error_ratio:g} x")
            if name == "logits" and q.dim() >= 2:
                cost.logits.append(_judge_logits(cost, index, q, u, ref, mask))


def _judge_logits(cost: Cost, index: int, q: torch.Tensor, u: torch.Tensor, ref: torch.Tensor,
                  mask: torch.Tensor | None) -> dict[str, Any]:
    """Top-1 agreement and KL of the quantized logits against the unquantized model's. Each passes at its budget,
    or by the relative allowance the output's SQNR has, in its own units:
    - top-1: fp8 departs from bf16 no more than bf16 departs from float64 (its own agreement with the reference);
    - KL: within ``max_error_ratio ** 2`` times bf16's own KL from float64. KL is second order in a small logit
      error (``KL ~ Var(error) / 2``), so an error 16x bf16's is a KL 256x bf16's. Measured on the H200 (2 layers
      of the 8B shape, random weights): fp8 error = 9.9x bf16's, KL = 97x bf16's (9.9 squared is 98)."""
    budget = cost.budget
    top1, kl = top1_and_kl(q, u, mask)
    own_top1, own_kl = top1_and_kl(u, ref, mask)
    allowed_kl = budget.max_error_ratio ** 2 * own_kl
    top1_ok = top1 >= budget.min_top1 or top1 >= own_top1
    kl_ok = kl <= budget.max_kl or kl <= allowed_kl
    if not top1_ok:
        cost.problems.append(f"logits (sample {index}): top-1 agreement with the {cost.dtype} model {top1:.3f} < "
                             f"{budget.min_top1:g} (and below {cost.dtype}'s own agreement with float64, "
                             f"{own_top1:.3f})")
    if not kl_ok:
        cost.problems.append(f"logits (sample {index}): mean KL against the {cost.dtype} model {kl:.4g} > "
                             f"{budget.max_kl:g} nats (and above {budget.max_error_ratio:g}^2 x {cost.dtype}'s own "
                             f"against float64, {own_kl:.3g})")
    return {"sample": index, "top1_agreement": top1, "kl": kl, "unquantized_top1_vs_float64": own_top1,
            "unquantized_kl_vs_float64": own_kl, "passed": top1_ok and kl_ok}


def judge_layers(cost: Cost, quantized: Quantized) -> None:
    """Every fp8 layer against the per-layer budget, the worst named first."""
    low = [(name, value) for name, value in quantized.judged() if value < cost.budget.layer_min_sqnr_db]
    if low:
        named = ", ".join(f"{name} {value:.1f} dB" for name, value in low[:5])
        more = f" and {len(low) - 5} more" if len(low) > 5 else ""
        cost.problems.insert(0, f"{len(low)} fp8 layer(s) below {cost.budget.layer_min_sqnr_db:g} dB SQNR: "
                                f"{named}{more}")
    missing = [layer.name for layer in quantized.layers if layer.status == quantized.label and layer.sqnr_db is None]
    if missing:
        cost.notes.append(f"{len(missing)} fp8 layer(s) never ran on the first sample, so have no SQNR: "
                          f"{', '.join(missing[:5])}")


def cost_problems(quantization: dict[str, Any], sample: int, measured: dict[str, float]) -> list[str]:
    """The second question asked again (``exporter verify``) of an artifact's outputs: their relative L2 against
    the original model's float64 reference, against the budget and the unquantized model's error stored at
    convert (``report.json`` -> ``quantization``)."""
    budget = quantization["budget"]
    stored = {(o["sample"], o["output"]): o for o in quantization["outputs"]}
    problems = []
    for name, rel in measured.items():
        row = stored.get((sample, name))
        if row is None:
            problems.append(f"output {name} (sample {sample}): report.json holds no quantization figures for it")
            continue
        sqnr = INF_DB if rel == 0.0 else (-20.0 * math.log10(rel) if math.isfinite(rel) else -INF_DB)
        own = row["unquantized_relative_l2"]
        ratio = rel / own if own else (1.0 if rel == 0.0 else math.inf)
        if sqnr < budget["min_sqnr_db"] and ratio > budget["max_error_ratio"]:
            problems.append(f"output {name} (sample {sample}): against the original model SQNR {sqnr:.1f} dB < "
                            f"{budget['min_sqnr_db']:g} dB and error = {ratio:.1f} x the unquantized model's > "
                            f"{budget['max_error_ratio']:g} x")
    return problems
