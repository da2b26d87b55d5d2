"""Resolve a checkpoint's architecture: a user factory, else a Hugging Face config.json.

Order: ``--model package.module:factory`` (command line, then recipe); else the
``config.json`` beside the checkpoint, built with transformers from its
``architectures`` entry; else an error that says what was looked for.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn

from ..errors import ArchitectureError, EnvironmentProblem


@dataclass
class Architecture:
    """How to build the model, without weights."""

    source: str  # "factory" or "transformers"
    name: str  # factory path or transformers class name
    config: dict[str, Any] | None
    builder: Callable[[], nn.Module] = field(repr=False)
    hf_config: Any = field(default=None, repr=False)

    @property
    def is_transformers(self) -> bool:
        return self.source == "transformers"


def implementations(model_class: Any) -> dict[str, str]:
    """How a transformers model is built for the pipeline: eager attention (the reference, and what the rewrite
    starts from) and, for a mixture of experts, ``batched_mm`` experts: the default ``grouped_mm`` has no float64
    kernel (so no reference could be run) and the eager experts loop over data-dependent token sets, which
    ``torch.export`` cannot trace."""
    chosen = {"attn_implementation": "eager"}
    with contextlib.suppress(Exception):
        if model_class._can_set_experts_implementation():
            chosen["experts_implementation"] = "batched_mm"
    return chosen


def read_config(root: Path) -> dict[str, Any] | None:
    path = root / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArchitectureError(f"{path} is not valid JSON ({exc})", "fix or regenerate config.json") from None
    if not isinstance(data, dict):
        raise ArchitectureError(f"{path} does not hold a JSON object", "fix or regenerate config.json")
    return data


def resolve_architecture(root: Path, factory: str | None) -> Architecture:
    config = read_config(root)
    if factory:
        return _factory_architecture(factory, config)
    if config is not None:
        return _transformers_architecture(config, root)
    raise ArchitectureError(
        f"cannot tell the model's architecture: no --model factory was given and there is no config.json in {root}",
        "pass --model package.module:function that returns the nn.Module, or put the Hugging Face config.json "
        "beside the weights",
    )


def import_factory(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ArchitectureError(f"model factory {spec!r} is not of the form package.module:function",
                                "pass --model package.module:function")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ArchitectureError(f"cannot import factory module {module_name!r} ({type(exc).__name__}: {exc})",
                                "check the module name and that it is importable from the current folder or "
                                "PYTHONPATH") from None
    except Exception as exc:
        raise ArchitectureError(f"importing factory module {module_name!r} raised {type(exc).__name__}: {exc}",
                                "fix the error in that module") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ArchitectureError(f"module {module_name!r} has no callable {attr!r}",
                                f"define {attr}() in {module_name}, or name the right function")
    return fn


def _factory_architecture(spec: str, config: dict | None) -> Architecture:
    fn = import_factory(spec)

    def build() -> nn.Module:
        try:
            model = fn(dict(config)) if config is not None else fn()
        except Exception as exc:
            raise ArchitectureError(f"model factory {spec} raised {type(exc).__name__}: {exc}",
                                    "fix the factory so it builds the model") from None
        if not isinstance(model, nn.Module):
            raise ArchitectureError(f"model factory {spec} returned {type(model).__name__}, not a torch.nn.Module",
                                    "return the model instance from the factory")
        return model

    return Architecture("factory", spec, config, build)


def _transformers_architecture(config: dict, root: Path) -> Architecture:
    names = config.get("architectures")
    model_type = config.get("model_type")
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise ArchitectureError(f"{root / 'config.json'} has no 'architectures' entry naming the model class",
                                "add e.g. \"architectures\": [\"LlamaForCausalLM\"], or pass --model "
                                "package.module:function")
    if not isinstance(model_type, str):
        raise ArchitectureError(f"{root / 'config.json'} has no 'model_type'",
                                "add the model_type (e.g. \"llama\"), or pass --model package.module:function")
    try:
        import transformers  # noqa: PLC0415 - transformers is optional
    except ImportError:
        raise EnvironmentProblem(
            f"config.json names the transformers architecture {names[0]}, but transformers is not installed",
            "pip install 'exporter[transformers]', or pass --model package.module:function") from None
    cls = getattr(transformers, names[0], None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ArchitectureError(
            f"architecture {names[0]!r} from config.json is not known to transformers {transformers.__version__}",
            "upgrade transformers, fix 'architectures' in config.json, or pass --model package.module:function")
    from transformers import AutoConfig  # noqa: PLC0415 - transformers is optional

    try:
        hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    except ValueError as exc:
        raise ArchitectureError(f"model_type {model_type!r} in config.json is not known to transformers "
                                f"{transformers.__version__} ({str(exc).splitlines()[0]})",
                                "upgrade transformers or pass --model package.module:function") from None
    except Exception as exc:
        raise ArchitectureError(f"config.json does not make a valid {model_type} config ({type(exc).__name__}: {exc})",
                                "fix config.json") from None

    def build() -> nn.Module:
        try:
            model_class: Any = cls  # a transformers PreTrainedModel class
            return model_class._from_config(hf_config, **implementations(model_class))
        except Exception as exc:
            raise ArchitectureError(f"transformers could not build {names[0]} from config.json "
                                    f"({type(exc).__name__}: {exc})",
                                    "check that config.json matches the architecture") from None

    return Architecture("transformers", names[0], config, build, hf_config)
