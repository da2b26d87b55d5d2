"""A recipe's TOML table parsed into a ``Recipe``, every problem at once; and the combinations of settings that
cannot run together."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..dtypes import RUNTIME_DTYPES
from ..errors import Problems
from ..targets import NAMES as TARGETS
from .sections import (
    _FACTORY,
    ATTENTION_BACKENDS,
    COMPILE_MODES,
    DEVICES,
    NONFINITE_POLICIES,
    ONNX_DTYPES,
    QUANTIZE_SCHEMES,
    QUANTIZE_TARGETS,
    SCHEMA_VERSION,
    TASKS,
    BenchSection,
    GenerationSection,
    InputsSection,
    ModelSection,
    NumericsSection,
    QuantizeSection,
    Recipe,
    ReportSection,
    RuntimeSection,
    TargetsSection,
    TrustSection,
    _choice,
    _get,
    _parse_dims,
    _parse_tensors,
    _str_list,
    _typename,
    _unknown,
    recipe_problems,
)


def parse_recipe(data: dict, name: str, source: str, problems: Problems | None = None) -> Recipe:
    """Build a Recipe from parsed TOML, listing every problem at once."""
    p = problems or recipe_problems(source)
    sections = {"model", "runtime", "targets", "inputs", "numerics", "bench", "report", "generation", "quantize",
                "trust"}
    _unknown(data, {"schema_version", "description"} | sections, "", p)
    version = _get(data, "schema_version", int, None, "recipe", p)
    if version is None and "schema_version" not in data:
        p.add("schema_version", f"required (this exporter reads version {SCHEMA_VERSION})")
    elif version is not None and version != SCHEMA_VERSION:
        p.add("schema_version", f"version {version} is not supported; this exporter reads {SCHEMA_VERSION}")
    description = _get(data, "description", str, "", "recipe", p)

    def table(key: str) -> dict:
        value = data.get(key, {})
        if not isinstance(value, dict):
            p.add(key, f"expected a table, got {_typename(value)}")
            return {}
        return value

    t = table("model")
    factory = _get(t, "factory", str, None, "model", p)
    if factory is not None and not _FACTORY.match(factory):
        p.add("model.factory", f"{factory!r} is not of the form package.module:function")
    model = _section(t, ModelSection, "model", p, factory=factory)
    _choice(model.nonfinite_weights, NONFINITE_POLICIES, "model.nonfinite_weights", p)
    _choice(model.task, TASKS, "model.task", p)

    runtime = _section(table("runtime"), RuntimeSection, "runtime", p)
    _choice(runtime.device, DEVICES, "runtime.device", p)
    _choice(runtime.dtype, RUNTIME_DTYPES, "runtime.dtype", p)
    _choice(runtime.attention_backend, ATTENTION_BACKENDS, "runtime.attention_backend", p)
    if runtime.device == "cpu" and runtime.attention_backend in ("flash", "cudnn"):
        p.add("runtime.attention_backend", f"{runtime.attention_backend!r} needs device 'cuda'")

    targets = _section(table("targets"), TargetsSection, "targets", p)
    for target in targets.build:
        _choice(target, TARGETS, "targets.build", p)
    if len(set(targets.build)) != len(targets.build):
        p.add("targets.build", "a target is listed twice")
    for mode in targets.compile_modes:
        _choice(mode, COMPILE_MODES, "targets.compile_modes", p)
    if "compile" in targets.build and not targets.compile_modes:
        p.add("targets.compile_modes", "target 'compile' is listed but no mode is given")
    if not 18 <= targets.onnx_opset <= 24:
        p.add("targets.onnx_opset", f"must be between 18 and 24, got {targets.onnx_opset}")
    _choice(targets.onnx_dtype, ONNX_DTYPES, "targets.onnx_dtype", p)
    if runtime.device == "cpu":
        for mode in targets.compile_modes:
            if "compile" in targets.build and mode == "reduce-overhead":
                p.add("targets.compile_modes", "'reduce-overhead' captures CUDA graphs and needs device 'cuda'")
        if targets.aoti_cuda_graph:
            p.add("targets.aoti_cuda_graph", "a CUDA graph needs device 'cuda' (set it false on a CPU recipe)")

    t = table("inputs")
    di = InputsSection()
    _unknown(t, {"seed", "samples", "dims", "tensor"}, "inputs", p)
    dims = _parse_dims(t["dims"], p) if "dims" in t else di.dims
    inputs = InputsSection(
        seed=_get(t, "seed", int, di.seed, "inputs", p),
        samples=_get(t, "samples", int, di.samples, "inputs", p),
        dims=dims,
        tensors=_parse_tensors(t["tensor"], dims, p) if "tensor" in t else (),
    )
    if not 1 <= inputs.samples <= 64:
        p.add("inputs.samples", f"must be between 1 and 64, got {inputs.samples}")

    t = table("numerics")
    dn = NumericsSection()
    grid_sizes = _get(t, "grid_sizes", list, list(dn.grid_sizes), "numerics", p)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in grid_sizes):
        p.add("numerics.grid_sizes", "expected a list of integers >= 1")
        grid_sizes = list(dn.grid_sizes)
    numerics = _section(t, NumericsSection, "numerics", p, grid_sizes=tuple(grid_sizes))
    if not numerics.grid_budget >= 1.0:
        p.add("numerics.grid_budget", f"must be at least 1, got {numerics.grid_budget}")
    if numerics.k is not None and not numerics.k >= 1.0:
        p.add("numerics.k", f"must be at least 1, got {numerics.k}")
    if not numerics.atol >= 0.0:
        p.add("numerics.atol", f"must be non-negative, got {numerics.atol}")
    if not numerics.floor >= 0.0:
        p.add("numerics.floor", f"must be non-negative, got {numerics.floor}")

    bench = _section(table("bench"), BenchSection, "bench", p)
    for key in ("warmup", "rounds", "iterations"):
        low = 0 if key == "warmup" else 1
        if getattr(bench, key) < low:
            p.add(f"bench.{key}", f"must be at least {low}, got {getattr(bench, key)}")
    if bench.peak_tflops < 0:
        p.add("bench.peak_tflops", "must be non-negative")
    if bench.max_seconds < 0:
        p.add("bench.max_seconds", "must be non-negative (0: no limit)")

    report = _section(table("report"), ReportSection, "report", p)
    generation = _section(table("generation"), GenerationSection, "generation", p)
    if generation.batch < 2:
        p.add("generation.batch", f"must be at least 2 (the programs also run batch 1), got {generation.batch}")
    if generation.prompt_length < 2:
        p.add("generation.prompt_length", f"must be at least 2, got {generation.prompt_length}")
    if generation.new_tokens < 1 or generation.bench_tokens < 1:
        p.add("generation.new_tokens", "new_tokens and bench_tokens must be at least 1")
    if generation.prompt_length + max(generation.new_tokens, 1) > generation.max_cache_len:
        p.add("generation.max_cache_len", f"{generation.max_cache_len} slots cannot hold a "
              f"{generation.prompt_length}-token prompt and {generation.new_tokens} new tokens")

    quantize = _section(table("quantize"), QuantizeSection, "quantize", p)
    _choice(quantize.scheme, QUANTIZE_SCHEMES, "quantize.scheme", p)
    if quantize.max_error_ratio < 1.0:
        p.add("quantize.max_error_ratio", f"must be at least 1, got {quantize.max_error_ratio}")
    if not 0.0 <= quantize.min_top1 <= 1.0:
        p.add("quantize.min_top1", f"must be between 0 and 1, got {quantize.min_top1}")
    if quantize.max_kl < 0.0:
        p.add("quantize.max_kl", f"must be non-negative, got {quantize.max_kl}")

    trust = _section(table("trust"), TrustSection, "trust", p)

    p.raise_if_any()
    recipe = Recipe(name=name, description=description, schema_version=SCHEMA_VERSION, model=model,
                    runtime=runtime, targets=targets, inputs=inputs, numerics=numerics, bench=bench,
                    report=report, generation=generation, quantize=quantize, trust=trust, source=source)
    return recipe


def _section(table: dict, cls: type, where: str, p: Problems, **given: Any) -> Any:
    """The section ``cls`` read from its ``table``: each field by the type of its default (a float where the default
    is a float or None, a list of strings where it is a tuple), an unknown key refused; ``given``: fields the caller
    read itself."""
    default = cls()
    fields = dataclasses.fields(cls)
    _unknown(table, {f.name for f in fields}, where, p)
    values = dict(given)
    for f in fields:
        value = getattr(default, f.name)
        if f.name in given:
            continue
        if isinstance(value, tuple):
            values[f.name] = _str_list(table, f.name, value, where, p)
        else:
            kind = float if value is None or isinstance(value, float) else type(value)
            values[f.name] = _get(table, f.name, kind, value, where, p)
    return cls(**values)


def check_combination(recipe: Recipe, source: str = "") -> None:
    """Settings of different sections that cannot hold together: refused, never one silently winning. Checked on
    the recipe a run uses (:func:`resolve_recipe`: after ``--set``, ``--target`` and ``--task``), so a command line
    can mend what the file alone would not allow."""
    _check_decode_batch_1(recipe, source)
    q = recipe.quantize
    if not q.enabled:
        return
    p = recipe_problems(source or recipe.source or recipe.name,
                  "change the settings named, in the recipe's [quantize] section or on the command line "
                  "(docs/quantization.md)")
    others = [t for t in recipe.targets.build if t not in QUANTIZE_TARGETS]
    if others:
        p.add("quantize.scheme", f"{q.scheme} builds {' and '.join(QUANTIZE_TARGETS)} only; the targets also name "
              f"{', '.join(others)} (choose with --target exported_program --target aoti)")
    if recipe.model.task not in ("forward", "text-generation"):
        p.add("quantize.scheme", f"{q.scheme} is built for --task forward and text-generation; --task "
              f"{recipe.model.task} with fp8 is not built yet (convert it without quantize.scheme)")
    if recipe.runtime.dtype != "bfloat16":
        # CUDA's rowwise-scaled fp8 product writes bfloat16 only; and in a float32 model the roundings of
        # activations to fp8 flip so rarely that their count, which dominates the error, is too noisy to judge
        # one compiled program against the eager model (docs/quantization.md)
        p.add("quantize.scheme", f"fp8 runs in a bfloat16 model, not {recipe.runtime.dtype} "
              "(set runtime.dtype = \"bfloat16\", e.g. --set runtime.dtype=bfloat16)")
    p.raise_if_any()


def _check_decode_batch_1(recipe: Recipe, source: str) -> None:
    """``generation.decode_batch_1`` asks for a program only the aoti target builds, for a decoder's generation."""
    if not recipe.generation.decode_batch_1 or recipe.model.task == "forward":
        return
    p = recipe_problems(source or recipe.source or recipe.name,
                  "set generation.decode_batch_1 = false, or build what it needs (docs/generation.md)")
    if recipe.model.task != "text-generation":
        p.add("generation.decode_batch_1", f"the decode program of batch 1 is built for --task text-generation; "
              f"--task {recipe.model.task} has none yet")
    elif "aoti" not in recipe.targets.build:
        p.add("generation.decode_batch_1", "the decode program of batch 1 is built by the aoti target, which the "
              f"targets ({', '.join(recipe.targets.build) or 'none'}) leave out (add --target aoti)")
    p.raise_if_any()
