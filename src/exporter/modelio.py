"""A uniform calling convention for every model: named tensor inputs in, a tuple of named tensors out.

Exporters and runtimes want flat tensor signatures with stable names; models
return tensors, tuples, dicts or Hugging Face ``ModelOutput`` objects and take
keyword arguments such as ``use_cache``. :class:`IOModule` wraps a model so
that ``forward(input_ids, attention_mask) -> (last_hidden_state, ...)`` holds
for all of them, with real names that the ONNX graph and the exported program
carry.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .errors import InputsError, describe


@dataclass(frozen=True)
class Signature:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def transformers_core(model: nn.Module) -> Any:
    """The transformers ``PreTrainedModel`` that ``model`` is, or that a pipeline around it wraps (a
    sentence-transformers folder's pooling: ``wrapped_transformer``); else None."""
    try:
        from transformers import PreTrainedModel  # noqa: PLC0415 - transformers is optional
    except ImportError:
        return None
    candidate = getattr(model, "wrapped_transformer", model)
    return candidate if isinstance(candidate, PreTrainedModel) else None


def is_transformers_model(model: nn.Module) -> bool:
    return transformers_core(model) is not None


def forward_parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(model.forward).parameters)


def flatten_outputs(result: Any) -> list[tuple[str, torch.Tensor]]:
    """Name the tensors a model returned: 'output', 'output_0..', or dict/ModelOutput keys."""
    if isinstance(result, torch.Tensor):
        return [("output", result)]
    if isinstance(result, dict) or hasattr(result, "keys"):
        return [(str(k), v) for k, v in result.items() if isinstance(v, torch.Tensor)]
    if isinstance(result, (list, tuple)):
        return [(f"output_{i}", v) for i, v in enumerate(result) if isinstance(v, torch.Tensor)]
    raise InputsError(f"the model returned {type(result).__name__}, not tensors",
                      "return a tensor, a tuple of tensors or a dict of tensors from forward()")


SPEC_MODULES = re.compile(r"^transformers\.(modeling_outputs|models\.[a-z0-9_]+\.modeling_[a-z0-9_]+)$")


def import_spec_types(modules: tuple[str, ...] | None) -> None:
    """Import the modules whose pytree types a foreign program's call spec names, before it is deserialized: only
    transformers' ModelOutput modules (``SPEC_MODULES``), from the installed package; any other name is refused
    (importing it would run code the artifact chose)."""
    import importlib  # noqa: PLC0415

    for module in modules or ():
        if not SPEC_MODULES.match(module):
            raise InputsError(f"the program's call spec names module {module!r}, which exporter does not import",
                              "export it with tensors, tuples, dicts or transformers' ModelOutputs")
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


def keyword_names(in_spec: Any) -> tuple[str, ...] | None:
    """The names a program or package takes its inputs by when its call spec is keywords only (``(), {...}``,
    as convert exports them), else None."""
    if (in_spec is None or in_spec.type is not tuple or in_spec.num_children != 2
            or in_spec.child(0).num_children or in_spec.child(1).type is not dict):
        return None
    return tuple(in_spec.child(1).context) or None


def by_name(fn: Any, in_spec: Any = None) -> Any:
    """``fn`` (a program's module, or ``in_spec``'s) callable by position too when it takes keywords only:
    positional inputs are bound to its names in order, as a Python function binds them (keywords pass through)."""
    names = keyword_names(in_spec if in_spec is not None else getattr(fn, "_in_spec", None))
    if names is None:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(**dict(zip(names, args)), **kwargs)

    return call


def named_call(fn: Any, keywords: tuple[str, ...] | None, outputs: tuple[str, ...] | None, positional: int = 0):
    """``fn`` (a program or package another tool made) behind the positional convention: called with its first
    ``positional`` inputs by position and the rest by the names ``keywords`` gives, when it takes keywords; its
    outputs picked by name when ``outputs`` are given (else all, in order)."""

    def call(args: list[torch.Tensor]) -> list[torch.Tensor]:
        if keywords:
            result = fn(*args[:positional], **dict(zip(keywords, args[positional:])))
        else:
            result = fn(*args)
        named = flatten_outputs(result)
        if not outputs:
            return [t for _, t in named]
        by_name = dict(named)
        if all(o in by_name for o in outputs):
            return [by_name[o] for o in outputs]
        return [t for _, t in named][:len(outputs)]  # positional outputs (a tuple), mapped in order

    return call


def step_positions(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the prompt's position ids, the next step's attention mask, the next token's position id): positions
    count real tokens (padding gets 1, as transformers' own generation does); the next token comes after them."""
    mask = mask.to(torch.int64)
    prompt = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    following = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
    return prompt, following, mask.sum(-1, keepdim=True)


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str | None):
    """Temporarily switch a transformers model's attention implementation (restored on exit)."""
    hf = transformers_core(model)  # config and set_attn_implementation
    if name is None or hf is None or hf.config._attn_implementation == name:
        yield
        return
    previous = hf.config._attn_implementation
    hf.set_attn_implementation(name)
    try:
        yield
    finally:
        hf.set_attn_implementation(previous)


class IOModule(nn.Module):
    """forward(*inputs, in signature order) -> tuple of outputs, in signature order."""

    def __init__(self, model: nn.Module, signature: Signature, attn_implementation: str | None = None):
        super().__init__()
        self.model = model
        self.signature = signature
        self.attn_implementation = attn_implementation
        params = forward_parameters(model)
        self._extra: dict[str, Any] = {}
        if is_transformers_model(model):
            for key, value in (("use_cache", False), ("return_dict", True)):
                if key in params:
                    self._extra[key] = value

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kwargs = dict(zip(self.signature.inputs, args))
        with attention_implementation(self.model, self.attn_implementation):
            result = self.model(**kwargs, **self._extra)
        named = dict(flatten_outputs(result))
        return tuple(named[name] for name in self.signature.outputs)


def make_io_module(model: nn.Module, signature: Signature, attn_implementation: str | None = None) -> IOModule:
    """An IOModule whose forward signature lists the real input names, so exported graphs carry them."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("self",) + signature.inputs]

    def forward(self, *args):
        return IOModule.forward(self, *args)

    forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    cls = type("IOModule", (IOModule,), {"forward": forward})
    return cls(model, signature, attn_implementation)


def discover_outputs(model: nn.Module, inputs: dict[str, torch.Tensor],
                     wanted: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Run once (where the model's weights are) and name the tensor outputs; keep ``wanted`` (in that order)
    when given."""
    probe = IOModule(model, Signature(tuple(inputs), ()))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with torch.inference_mode():
            result = model(**{k: v.to(device) for k, v in inputs.items()}, **probe._extra)
    except Exception as exc:
        shapes = ", ".join(f"{k} {list(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in inputs.items())
        raise InputsError(f"the model failed on the first sample ({shapes}): {describe(exc, 300)}",
                          "check the inputs (declared in the recipe or with --input, or the --inputs file) "
                          "against the model's forward()") from None
    names = [n for n, _ in flatten_outputs(result)]
    if not names:
        raise InputsError("the model returned no tensors", "return at least one tensor from forward()")
    if wanted:
        unknown = [w for w in wanted if w not in names]
        if unknown:
            raise InputsError(f"model.outputs names {', '.join(unknown)}, but the model returns {', '.join(names)}",
                              "list only outputs the model returns in the recipe's model.outputs")
        return tuple(wanted)
    return tuple(names)


def _round_trips(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether every ``source`` value survives a cast to ``target`` and back (a widening cast)."""
    if source == target or not (source.is_floating_point and target.is_floating_point):
        return source == target or not source.is_floating_point
    wide, narrow = torch.finfo(target), torch.finfo(source)
    return wide.eps <= narrow.eps and wide.max >= narrow.max and wide.smallest_normal <= narrow.smallest_normal


@contextlib.contextmanager
def cast_in_place(model: nn.Module, dtype: torch.dtype | None, device: str = "cpu"):
    """Move every parameter and buffer to ``device`` and cast floating ones to ``dtype`` (None: keep); on exit each
    tensor is its own again, bit for bit: a widening cast (bf16 to float64) is cast back, a narrowing one (float32 to
    bf16) gives back the tensor it replaced (kept, on its own device, while inside)."""
    originals: dict[str, tuple[torch.dtype, torch.device, torch.Tensor | None]] = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        kept = None if dtype is None or _round_trips(tensor.dtype, dtype) else tensor.data
        originals[name] = (tensor.dtype, tensor.device, kept)
    model.to(device=device)
    if dtype is not None:
        model.to(dtype=dtype)
    try:
        yield model
    finally:
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            original_dtype, original_device, kept = originals.get(name, (tensor.dtype, tensor.device, None))
            if tensor.dtype != original_dtype or tensor.device != original_device or kept is not None:
                owner, _, leaf = name.rpartition(".")
                module = model.get_submodule(owner) if owner else model
                restored = kept if kept is not None else tensor.data.to(device=original_device, dtype=original_dtype)
                parameter = module._parameters.get(leaf)
                if parameter is not None:
                    parameter.data = restored
                else:
                    module._buffers[leaf] = restored
