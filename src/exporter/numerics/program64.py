"""The program proof: an exported program run in float64, with the checkpoint's weights, against the float64
reference.

A bfloat16 artifact's outputs sit ~4e-3 from float64 whatever its program does, so a wrong softmax scale, a
tanh-approximated GELU or a causal mask shifted by one can hide under bfloat16's own rounding when only outputs
are compared. The program itself, though, is a graph of ATen ops that runs in any dtype. Its **float64 twin**:

* every floating dtype the graph names (a cast, a ``full``/``arange``'s dtype, a softmax's accumulation dtype) is
  promoted to float64: the casts the model wrote for its precision become no-ops;
* every floating constant is the checkpoint's tensor in float64, found by the program's own name for it (a
  prefix such as ``model.`` allowed), else by exact content (the constant equals the checkpoint tensor cast to
  its dtype, possibly transposed), else the nearest tensor of its shape (a changed weight: the weights proof names
  it); a constant traced to nothing keeps its own value, upcast, and is named.

The weights proof (``numerics/weights.py``) has already compared those constants with the checkpoint bit for bit,
so the twin asks the other half of the question: given exactly the checkpoint's weights, does the program compute
what the model computes? It runs on the recipe's device with float64 inputs and is compared with the float64
reference (itself run with its casts promoted, :class:`PromoteCasts`). Both sides are float64 computations of
the same function, which agree to ~1e-15 of the output's RMS; the bar is :data:`PROGRAM_BAR` (2^-20, sixteen
float32 roundings) of it. Anything a program does differently shows orders of magnitude above it.

When the twin fails, the first module whose float64 output diverges is named: the twin is unflattened and run end
to end with hooks on its submodules, each compared with the reference's own module output against the same bar.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import describe
from .promote import LOW, PromoteCasts
from .weights import PAIRING, _named, _same, _suffixes

PROGRAM_BAR = 2.0 ** -20  # of rms(reference): sixteen float32 roundings; float64 twins measure ~1e-15
# where the twin had to keep constants traced to no checkpoint tensor at their own float32 values (an ONNX
# optimizer's folded cos/sin tables, whose float32 angles are off by position x 2^-24): their rounding, not the
# program's, then sets the floor; a wrong scale, mask or RoPE base still shows far above it
KEPT_BAR = 2.0 ** -12


@dataclass
class ProgramProof:
    passed: bool
    bar: float = PROGRAM_BAR  # relative RMSE the twin may show
    worst: float = 0.0  # the largest relative RMSE over samples and outputs
    worst_output: str = ""
    worst_sample: int = 0
    outputs: dict[str, float] = field(default_factory=dict)  # output -> its largest relative RMSE
    by_name: int = 0
    by_content: int = 0
    kept: list[str] = field(default_factory=list)  # floating constants traced to nothing: their own value, upcast
    module: str | None = None  # the first module whose float64 output diverges
    locate_note: str = ""
    seconds: float = 0.0

    def summary(self) -> str:
        where = f" (output {self.worst_output}, sample {self.worst_sample})" if self.worst_output else ""
        if self.passed:
            kept = f" (widened: {len(self.kept)} constant(s) traced to no checkpoint tensor kept their own " \
                   f"precision, {', '.join(self.kept[:3])})" if self.kept else ""
            return (f"the program in float64 is {self.worst:.3g} of the output's RMS from the float64 reference"
                    f"{where}; bar {self.bar:.3g}{kept}")
        text = (f"the program computed in float64 with the checkpoint's weights is {self.worst:.3g} of the output's "
                f"RMS from the float64 reference{where}, over the bar {self.bar:.3g}: it computes another function")
        if self.module:
            text += f"; first divergent module {self.module} (float64)"
        elif self.locate_note:
            text += f"; {self.locate_note}"
        if self.kept:
            text += f" ({len(self.kept)} constant(s) traced to no checkpoint tensor kept their own precision: " \
                    f"{', '.join(self.kept[:3])})"
        return text

    def judge(self) -> None:
        """The verdict: the bar is :data:`PROGRAM_BAR`, or :data:`KEPT_BAR` where floating constants kept their own
        (float32) values."""
        if self.kept:
            self.bar = max(self.bar, KEPT_BAR)
        self.passed = self.worst <= self.bar

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "bar": self.bar, "worst": self.worst, "worst_output": self.worst_output,
                "worst_sample": self.worst_sample, "outputs": self.outputs, "by_name": self.by_name,
                "by_content": self.by_content, "kept": self.kept, "module": self.module,
                "seconds": round(self.seconds, 3), "summary": self.summary()}


def promote_graph(graph: torch.fx.Graph) -> int:
    """Every floating dtype a node names becomes float64 (in place); returns how many were changed."""
    changed = 0

    def swap(value):
        nonlocal changed
        if value in LOW:
            changed += 1
            return torch.float64
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    for node in graph.nodes:
        if node.op == "call_function":
            node.args = tuple(swap(a) for a in node.args)
            node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}
    return changed


def relax_views(graph: torch.fx.Graph) -> int:
    """Every ``view`` becomes ``reshape`` (in place); returns how many. The graph was traced with the low-precision
    kernels' output layouts: on CUDA, flash attention's output with its heads transposed back is contiguous, so a
    model's ``.contiguous()`` left no copy in the graph and its ``reshape`` was traced as a view. In float64 SDPA
    takes the math kernel, whose output is laid out otherwise, and that view needs a copy. ``reshape`` is the same
    view wherever a view is possible and a copy of the same values elsewhere."""
    changed = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (torch.ops.aten.view.default,
                                                           torch.ops.aten._unsafe_view.default):
            node.target = torch.ops.aten.reshape.default
            changed += 1
    return changed


class Sources:
    """Where each constant of an artifact comes from in the checkpoint: its own name (a prefix allowed), else
    exact content (equal after the cast, possibly transposed), else the nearest tensor of its shape (what the
    weights proof pairs a changed constant with: that proof names the change; the program is asked with the
    checkpoint's value)."""

    def __init__(self, tensors: dict[str, torch.Tensor], proof: ProgramProof):
        self.tensors, self.proof = tensors, proof
        self.names = _suffixes(tensors)
        self.by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for tensor in tensors.values():
            if tensor.is_floating_point():
                self.by_shape.setdefault(tuple(tensor.shape), []).append(tensor)
                if tensor.dim() == 2:
                    self.by_shape.setdefault((tensor.shape[1], tensor.shape[0]), []).append(tensor.t())

    def float64(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The checkpoint's tensor for the artifact's constant ``name`` in float64 (the constant itself, upcast
        and listed in ``kept``, where none is found)."""
        return self.source(name, value).to(torch.float64)

    def source(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The checkpoint's tensor for the artifact's constant ``name``, in the checkpoint's own dtype (the constant
        itself, listed in ``kept``, where none is found)."""
        source = self.tensors.get(_named(name, self.names) or "")
        if source is not None and source.numel() == value.numel() and source.is_floating_point():
            source = source if source.shape == value.shape else (
                source.t() if source.dim() == 2 and source.t().shape == value.shape else None)
        else:
            source = None
        if source is not None:
            self.proof.by_name += 1
            return source.detach()
        value = value.detach().cpu()
        candidates = self.by_shape.get(tuple(value.shape), [])
        source = next((t for t in candidates if _same(value, t)), None)
        if source is None and value.numel() > 1:
            scored = [(float((value.double() - t.double()).norm()) / max(float(t.double().norm()), 1e-300), i)
                      for i, t in enumerate(candidates)]
            scored = [x for x in scored if x[0] < PAIRING]
            source = candidates[min(scored)[1]] if scored else None
        if source is not None:
            self.proof.by_content += 1
            return source.detach()
        if value.numel() > 1:
            self.proof.kept.append(name)
        return value


def twin_tensors(program: Any, tensors: dict[str, torch.Tensor], device: torch.device | str) -> ProgramProof:
    """Replace ``program``'s floating state and constants (in place) by the checkpoint's ``tensors`` on ``device``,
    in their own dtype (each op of the twin upcasts what it reads: :class:`Twin`); returns a passing proof holding
    the tracing counts."""
    proof = ProgramProof(True)
    sources = Sources(tensors, proof)
    for table in (program.state_dict, program.constants):
        for name, value in list(table.items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                found = sources.source(name, value).to(device)
                table[name] = torch.nn.Parameter(found, requires_grad=False) if isinstance(
                    value, torch.nn.Parameter) else found
    return proof


def _up(value: Any) -> Any:
    return value.to(torch.float64) if isinstance(value, torch.Tensor) and value.dtype in LOW else value


class _Float64(torch.fx.Interpreter):
    """Runs a promoted graph with each op's floating inputs upcast as it reads them: the weights stay in the
    checkpoint's dtype, and only one op's float64 copies live at a time (a float64 copy of a 1 GB float32
    checkpoint would be 2 GB more)."""

    def call_function(self, target, args, kwargs):
        return target(*torch.utils._pytree.tree_map(_up, args), **torch.utils._pytree.tree_map(_up, kwargs))


class Twin:
    """A promoted program called as the artifact is (positional or keyword inputs, its own output structure)."""

    def __init__(self, program: Any):
        self.program = program
        self._in_spec = program.call_spec.in_spec  # read by ``modelio.by_name``, as a program's module's is

    def __call__(self, *args, **kwargs):
        from torch.export.graph_signature import OutputKind  # noqa: PLC0415

        program = self.program
        flat = program._graph_module_flat_inputs(args, kwargs)
        out = _Float64(program.graph_module).run(*flat)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        user = len([o for o in program.graph_signature.output_specs if o.kind == OutputKind.USER_OUTPUT])
        return torch.utils._pytree.tree_unflatten(out[len(out) - user:], program.call_spec.out_spec)


def materialize(program: Any) -> None:
    """Every floating state tensor and constant of a twin in float64 (in place): for ``torch.export.unflatten``,
    which runs the graph as written (localisation only, on a failure)."""
    for table in (program.state_dict, program.constants):
        for name, value in list(table.items()):
            if isinstance(value, torch.Tensor) and value.dtype in LOW:
                cast = value.detach().to(torch.float64)
                table[name] = torch.nn.Parameter(cast, requires_grad=False) if isinstance(
                    value, torch.nn.Parameter) else cast


def _compare(proof: ProgramProof, index: int, names: tuple[str, ...], expected: list[torch.Tensor],
             got: list[torch.Tensor], device: str) -> None:
    """One sample's outputs of a twin against the float64 reference: each output's relative RMSE, the worst kept."""
    for name, ref, out in zip(names, expected, got):
        if not ref.is_floating_point():
            continue
        ref64 = ref.to(device=device, dtype=torch.float64)
        rms = float(ref64.square().mean().sqrt()) if ref64.numel() else 0.0
        if tuple(out.shape) != tuple(ref64.shape):
            relative = math.inf
        else:
            out64 = out.to(device=device, dtype=torch.float64)
            error = float((out64 - ref64).square().mean().sqrt()) if ref64.numel() else 0.0
            relative = error / rms if rms > 0 else (0.0 if error == 0 else math.inf)
            relative = relative if math.isfinite(relative) else math.inf
        proof.outputs[name] = max(proof.outputs.get(name, 0.0), relative)
        if relative > proof.worst or not proof.worst_output:
            proof.worst, proof.worst_output, proof.worst_sample = relative, name, index


def run_twin(program: Any, tensors: dict[str, torch.Tensor], device: str,
             call: Callable[[Any, list[torch.Tensor]], list[torch.Tensor]], samples: list[list[torch.Tensor]],
             reference: list[list[torch.Tensor]], names: tuple[str, ...]) -> tuple[ProgramProof, Any]:
    """The twin of ``program`` (loaded fresh: it is changed in place) run on every sample, compared with
    ``reference`` (float64 outputs per sample, in ``names`` order): the proof, and the twin's module for
    localisation. ``call(module, args)`` calls it as the artifact is called, returning outputs in order."""
    for module in list(program.graph_module.modules()):  # and every subgraph (autocast and grad regions)
        if isinstance(module, torch.fx.GraphModule):
            promote_graph(module.graph)
            relax_views(module.graph)
            module.recompile()
    proof = twin_tensors(program, tensors, device)
    module = Twin(program)
    with torch.inference_mode():
        for index, (sample, expected) in enumerate(zip(samples, reference)):
            args = [(t.to(torch.float64) if t.is_floating_point() else t).to(device) for t in sample]
            _compare(proof, index, names, expected, call(module, args), device)
    proof.judge()
    return proof, module


def locate_twin(program: Any, calls: list, sample: list[torch.Tensor], device: str, prefix: str = "",
                keywords: tuple[str, ...] | None = None, positional: int = 0) -> dict[str, Any]:
    """The first module whose output in the float64 twin (``program``, already made by :func:`run_twin`) misses
    :data:`PROGRAM_BAR` against the reference's own float64 module outputs (``calls``, from
    :func:`exporter.numerics.locate.record_reference`)."""
    from .locate_program import first_divergent, record_modules  # noqa: PLC0415
    from .module_checks import floats  # noqa: PLC0415

    materialize(program)
    args = [(t.to(torch.float64) if t.is_floating_point() else t).to(device) for t in sample]
    graph = record_modules(program, {prefix + c.path for c in calls}, args, prefix, keywords, positional)
    reference = {(c.path, c.index): (floats((c.args, c.kwargs)), floats(c.output)) for c in calls}

    def floor(ref: torch.Tensor) -> float:
        return PROGRAM_BAR * float(ref.to(torch.float64).square().mean().sqrt()) if ref.numel() else 0.0

    return first_divergent(calls, graph, reference, 1.0, floor)


@contextlib.contextmanager
def holding(model: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """``model`` with its parameters and buffers set to ``tensors`` (by name) while inside; its own restored
    after."""
    saved: list[tuple[dict, str, Any]] = []
    try:
        for name, tensor in tensors.items():
            owner, _, leaf = name.rpartition(".")
            try:
                module = model.get_submodule(owner) if owner else model
            except AttributeError:
                continue
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                if table.get(leaf) is not None:
                    saved.append((table, leaf, table[leaf]))
                    table[leaf] = torch.nn.Parameter(tensor, requires_grad=False) if table is module._parameters \
                        else tensor
        yield model
    finally:
        for table, leaf, value in reversed(saved):
            table[leaf] = value


def _locate(program, sample, original, tensors: dict[str, torch.Tensor], device: str, prefix: str, keywords,
            positional: int, proof: ProgramProof) -> str:
    from ..numerics.locate import record_reference  # noqa: PLC0415

    try:
        with holding(original.model, tensors):  # the checkpoint's own tensors, not the recipe's cast of them
            calls, note = record_reference(original, sample, None, [])
        entry = locate_twin(program, calls, sample, device, prefix, keywords, positional)
    except Exception as exc:  # noqa: BLE001 - localisation explains a failure; it never hides one
        return f"localisation failed: {describe(exc, 200)}"
    found = entry.get("first_divergent")
    if found:
        proof.module = found["module"]
        return ""
    return note or f"no module's float64 output diverged ({entry.get('modules_checked', 0)} checked): the " \
                   "divergence is in the model's own code between modules"


def detached(program: Any) -> Any:
    """A copy of ``program`` that :func:`run_twin` may change: its graph copied, its tables of tensors new dicts
    (the tensors themselves shared until replaced)."""
    twin = copy.copy(program)
    twin._graph_module = copy.deepcopy(program.graph_module)
    twin._state_dict = dict(program.state_dict)
    twin._constants = dict(program.constants)
    return twin


def prove_twin(program: Any, tensors: dict[str, torch.Tensor], device: str, call, samples, reference,
               names: tuple[str, ...], original: Any = None, prefix: str = "", keywords=None, positional: int = 0,
               started: float | None = None) -> ProgramProof | str:
    """The program proof of ``program`` (changed in place: pass a fresh load or :func:`detached`): its twin run on
    every sample, and, when it fails and ``original`` (the reference IOModule) is given, the first divergent
    module; a string says why the twin could not run."""
    t0 = time.perf_counter() if started is None else started
    try:
        proof, _ = run_twin(program, tensors, device, call, samples, reference, names)
    except Exception as exc:  # noqa: BLE001 - the twin explains; the outputs are still judged
        return f"its program does not run in float64 ({describe(exc, 200)})"
    if not proof.passed and original is not None:
        proof.locate_note = _locate(program, samples[proof.worst_sample], original, tensors, device, prefix,
                                    keywords, positional, proof)
    proof.seconds = time.perf_counter() - t0
    return proof


__all__ = ["KEPT_BAR", "PROGRAM_BAR", "ProgramProof", "PromoteCasts", "detached", "holding", "locate_twin",
           "promote_graph", "prove_twin", "run_twin", "twin_tensors"]
