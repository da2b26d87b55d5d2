"""Capture a model as a torch.export graph, and run a rewritten graph as a module that shares the model's weights.

The graph rules work on ``torch.export``'s training IR (non-strict, every input dim
``Dim.AUTO``): ATen ops before decomposition, so ``matmul``, ``bmm``, ``einsum``,
``softmax`` and ``scaled_dot_product_attention`` stay whole, sizes stay symbolic
(``sym_size`` nodes), and each node carries its ``nn_module_stack``.

:class:`TracedModule` runs the rewritten graph. Parameters and buffers are lifted
graph inputs, so the module fetches them from the user's model on every call: no
second copy of the weights, and ``.to()``/``cast_in_place`` on either module is seen
by both. A trace bakes in the dtype and device it ran in (casts such as
``.to(q.dtype)``, ``device=`` arguments, ``_assert_tensor_metadata``), so when the
model's dtype or device changes the module traces and rewrites again, at the new
ones: on ``.to()``, or on the next eager call after an in-place cast.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind

from ..modelio import IOModule, Signature


class CaptureError(RuntimeError):
    """The model could not be captured as a graph the rules can rewrite."""


def dynamic_shapes(io: IOModule, example: list[torch.Tensor]) -> dict[str, Any]:
    """Every dim of every input ``Dim.AUTO``: dynamic unless the model's code pins it."""
    return {name: ({axis: Dim.AUTO for axis in range(t.dim())} if t.dim() else None)
            for name, t in zip(io.signature.inputs, example)}


def capture(io: IOModule, example: list[torch.Tensor]):
    """``torch.export`` training IR of ``io`` with symbolic sizes."""
    return torch.export.export(io, tuple(example), dynamic_shapes=dynamic_shapes(io, example), strict=False)


@dataclass
class GraphProgram:
    """A graph plus how to feed it: lifted state first (by FQN, or a constant tensor), then the user inputs."""

    module: torch.fx.GraphModule
    state: list[tuple[str, Any]]  # ("fqn", "model.layer.weight") or ("constant", tensor)
    user_outputs: list[int]  # positions of the user outputs in the graph's outputs


def program_from_export(ep) -> GraphProgram:
    state: list[tuple[str, Any]] = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            state.append(("fqn", spec.target))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            state.append(("constant", ep.constants[spec.target]))
        elif spec.kind != InputKind.USER_INPUT:
            raise CaptureError(f"the graph takes a {spec.kind.name.lower()} input, which the graph rules do not handle")
    outputs = []
    for index, spec in enumerate(ep.graph_signature.output_specs):
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(index)
        else:
            raise CaptureError(f"forward mutates state ({spec.kind.name.lower()} of {spec.target}); "
                               "the graph rules leave such models alone")
    return GraphProgram(ep.graph_module, state, outputs)


def model_key(module: nn.Module) -> tuple[str, torch.dtype | None]:
    """(device, dtype) of the first floating parameter or buffer: what a trace depends on."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point():
            return str(tensor.device), tensor.dtype
    return "cpu", None


def _tracing(inputs) -> bool:
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(t, torch.Tensor) and is_fake(t) for t in inputs)


class TracedModule(IOModule):
    """``forward(*inputs) -> tuple of outputs`` through a rewritten graph, over the same model and weights."""

    def __init__(self, source: IOModule, example: list[torch.Tensor],
                 build: Callable[[IOModule, list], GraphProgram | None],
                 program: GraphProgram):
        nn.Module.__init__(self)
        self.model = source.model  # the same object: state_dict keys and tensors are the original's
        self.signature: Signature = source.signature
        self.attn_implementation = getattr(source, "attn_implementation", None)
        self._extra: dict[str, Any] = {}
        self._source: IOModule
        object.__setattr__(self, "_source", source)  # not a submodule: its only child is self.model
        self._example = [t.detach().clone() for t in example]
        self._build = build
        self._install(program)

    def _install(self, program: GraphProgram | None) -> None:
        """Run ``program`` from now on; None (tracing again failed) runs the source module unrewritten."""
        self._passthrough = program is None
        self._key = model_key(self.model)
        if program is None:
            return
        self.graph_module = program.module
        self._user_outputs = program.user_outputs
        self._state: list[tuple[nn.Module | None, Any]] = []
        for kind, value in program.state:
            if kind == "fqn":
                owner, _, leaf = value.rpartition(".")
                self._state.append((self.get_submodule(owner) if owner else self, leaf))
            else:
                self._state.append((None, value))

    def _refresh(self) -> None:
        """Trace again if the model's dtype or device changed since the graph was traced."""
        key = model_key(self.model)
        if key == self._key:
            return
        device, dtype = key
        with torch.inference_mode(False):
            example = [(t.to(dtype) if dtype is not None and t.is_floating_point() else t).to(device).clone()
                       for t in self._example]
            program = self._build(self._source, example)
        self._install(program)

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._refresh()
        return result

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._passthrough:
            return self._source(*inputs)
        if not _tracing(inputs):
            self._refresh()
        elif model_key(self.model) != self._key:
            raise RuntimeError(f"the rewritten graph was traced for {self._key} but the model is now "
                               f"{model_key(self.model)}; call .to() on the rewritten module first")
        state = [getattr(owner, leaf) if owner is not None else leaf for owner, leaf in self._state]
        out = self.graph_module(*state, *inputs)
        return tuple(out[i] for i in self._user_outputs)


def traced_module(source: IOModule, example, build, program) -> TracedModule:
    """A :class:`TracedModule` whose forward lists the real input names (as ``make_io_module`` does)."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
              for n in ("self",) + source.signature.inputs]

    def forward(self, *args):
        return TracedModule.forward(self, *args)

    forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    cls = type("TracedModule", (TracedModule,), {"forward": forward})
    return cls(source, example, build, program)
