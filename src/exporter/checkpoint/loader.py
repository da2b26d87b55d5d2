"""Build the model with its parameters on the meta device, then assign the mapped weights.

Host memory stays near one copy of the weights: parameters are created on the
meta device (buffers, which checkpoints often omit, are created for real), and
the checkpoint's tensors, which map the file, are assigned in their place.

Every name, shape and dtype kind is checked; every missing, unexpected and
mis-shaped key is listed in one error. Parameters the model ties together (one
Parameter registered under several names, as transformers does for tied
embeddings) stay tied: one stored copy serves all its names.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..errors import CheckpointError
from .architecture import Architecture
from .files import Checkpoint

MAX_LISTED = 8


@contextlib.contextmanager
def parameters_on_meta():
    """Create every parameter on the meta device; buffers stay real (accelerate's init_empty_weights)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param):
        original(module, name, param)
        stored = module._parameters.get(name)
        if stored is not None and param.device.type != "meta":
            kwargs = dict(stored.__dict__)
            kwargs["requires_grad"] = stored.requires_grad
            module._parameters[name] = type(stored)(stored.to("meta"), **kwargs)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@dataclass
class LoadReport:
    loaded: int = 0
    tied: list[tuple[str, str]] = field(default_factory=list)  # (alias, source)
    ignored_unexpected: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)


def listing(names) -> str:
    """The first MAX_LISTED names, and how many more."""
    names = [str(n) for n in names]
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def _patterns(model: nn.Module, attr: str) -> list[re.Pattern]:
    values = getattr(model, attr, None) or []
    return [re.compile(v) for v in values if isinstance(v, str)]


def _prefix_map(model_keys: set[str], ckpt_keys: set[str], prefix: str | None) -> tuple[str, str] | None:
    """When a checkpoint was saved with or without the base-model prefix, return (strip, add)."""
    if not prefix or model_keys & ckpt_keys:
        return None
    p = prefix + "."
    if all(k.startswith(p) for k in ckpt_keys) and {k[len(p):] for k in ckpt_keys} & model_keys:
        return (p, "")
    if {p + k for k in ckpt_keys} & model_keys:
        return ("", p)
    return None


def build_model(arch: Architecture) -> nn.Module:
    with parameters_on_meta():
        model = arch.builder()
    return model


def load_weights(model: nn.Module, checkpoint: Checkpoint) -> LoadReport:
    """Assign the checkpoint's tensors to ``model`` (built by build_model); raise listing every key problem."""
    report = LoadReport()
    expected = model.state_dict(keep_vars=True)
    alias_groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        alias_groups.setdefault(id(param), []).append(name)
    group_of = {name: names for names in alias_groups.values() for name in names}

    ckpt_names = set(checkpoint.entries)
    strip_add = _prefix_map(set(expected), ckpt_names, getattr(model, "base_model_prefix", None))

    def model_name(ckpt_name: str) -> str:
        if strip_add is None:
            return ckpt_name
        strip, add = strip_add
        return add + ckpt_name[len(strip):]

    ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")

    unexpected, misshaped = [], []
    to_assign: dict[str, torch.Tensor] = {}
    for info in checkpoint.entries.values():
        name = model_name(info.name)
        if name not in expected:
            if any(p.search(info.name) for p in ignore_unexpected):
                report.ignored_unexpected.append(info.name)
            elif _is_nonpersistent_buffer(model, name):
                report.ignored_unexpected.append(info.name)
            else:
                unexpected.append(info.name)
            continue
        target = expected[name]
        if tuple(target.shape) != info.shape:
            misshaped.append(f"{info.name} (checkpoint {list(info.shape)}, model {list(target.shape)})")
            continue
        if (target.dtype.is_floating_point != info.dtype.is_floating_point
                or (target.dtype == torch.bool) != (info.dtype == torch.bool)):
            misshaped.append(f"{info.name} (checkpoint dtype {info.dtype}, model {target.dtype})")
            continue
    if misshaped or unexpected:
        problems = []
        if misshaped:
            problems.append(f"{len(misshaped)} mis-shaped: {listing(misshaped)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected: {listing(sorted(unexpected))}")
        raise CheckpointError(f"checkpoint {checkpoint.path} does not fit the architecture; " + "; ".join(problems),
                              "use the config.json or --model factory the checkpoint was saved from")

    wanted = {model_name(n) for n in checkpoint.entries} & set(expected)
    for ckpt_name, tensor in checkpoint.tensors():
        name = model_name(ckpt_name)
        if name in wanted:
            to_assign[name] = tensor

    # Tied names: assign one stored copy to every alias; refuse aliases stored with different values.
    for name in list(to_assign):
        for alias in group_of.get(name, [name]):
            if alias == name:
                continue
            if alias in to_assign and to_assign[alias] is not to_assign[name]:
                if not torch.equal(to_assign[alias], to_assign[name]):
                    raise CheckpointError(f"{alias} and {name} are tied in the model but differ in the checkpoint",
                                          "save the checkpoint from this architecture, or untie them in the factory")
    missing = []
    for name in expected:
        if name in to_assign:
            continue
        sources = [a for a in group_of.get(name, []) if a in to_assign]
        if sources:
            report.tied.append((name, sources[0]))
            continue
        tensor = expected[name]
        if tensor.device.type != "meta":
            continue  # a buffer the model computed itself
        if any(p.search(name) for p in ignore_missing):
            continue
        missing.append(name)
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint.path} does not fit the architecture; "
                              f"{len(missing)} missing: {listing(missing)}",
                              "use the config.json or --model factory the checkpoint was saved from")

    # One pass per tied group keeps a single Parameter object for every alias.
    model.load_state_dict(to_assign, strict=False, assign=True)
    for names in alias_groups.values():
        source = next((n for n in names if n in to_assign), None)
        if source is None:
            continue
        param = model.get_parameter(source)
        for alias in names:
            if alias != source:
                owner, _, leaf = alias.rpartition(".")
                (model.get_submodule(owner) if owner else model)._parameters[leaf] = param
    report.loaded = len(to_assign)

    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise CheckpointError(f"checkpoint {checkpoint.path} does not fit the architecture; "
                              f"{len(left)} missing: {listing(left)}",
                              "use the config.json or --model factory the checkpoint was saved from")
    for param in model.parameters():
        param.requires_grad_(False)
    model.eval()
    return report


def _is_nonpersistent_buffer(model: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    return leaf in module._buffers and leaf in module._non_persistent_buffers_set


def _all_finite(tensor: torch.Tensor, chunk: int = 1 << 22) -> bool:
    # In chunks: isfinite over a whole tensor makes temporaries larger than the tensor itself.
    return all(bool(torch.isfinite(part).all()) for part in tensor.detach().reshape(-1).split(chunk))


def check_finite(model: nn.Module, limit: int = 64) -> list[str]:
    """Names of floating-point parameters and buffers holding NaN or Inf (reads every weight once)."""
    bad = []
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and tensor.numel() and not _all_finite(tensor):
            bad.append(name)
            if len(bad) >= limit:
                break
    return bad
