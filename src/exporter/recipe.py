"""Recipes: named, versioned run settings parsed into frozen, typed objects.

A recipe is a TOML file. Parsing checks every key and value and reports every
problem at once; unknown keys are errors, so a typo never silently falls back
to a default. The defaults live here and nowhere else.

Built-in recipes ship in the wheel as ``exporter/recipes/*.toml`` and, in a
source checkout, live in the top-level ``recipes/`` folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .dtypes import K_DEFAULTS, RUNTIME_DTYPES, TENSOR_DTYPES
from .errors import RecipeError
from .outdir import public_path
from .targets import NAMES as TARGETS

SCHEMA_VERSION = 1

DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ONNX_DTYPES = ("auto", "float32", "recipe")

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Dim:
    """A named input dimension. It is dynamic when ``min < max``."""

    name: str
    size: int
    min: int
    max: int

    @property
    def dynamic(self) -> bool:
        return self.min < self.max


@dataclass(frozen=True)
class TensorSpec:
    """A declared model input: shape entries are ints or names of dims."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str = "float32"
    low: float = -1.0
    high: float = 1.0


NONFINITE_POLICIES = ("warn", "error")


TASKS = ("forward", "text-generation", "text2text-generation", "automatic-speech-recognition")
GENERATION_TASKS = TASKS[1:]  # a prefill and decode programs over a static cache, judged step by step


@dataclass(frozen=True)
class ModelSection:
    factory: str | None = None
    outputs: tuple[str, ...] = ()
    nonfinite_weights: str = "warn"  # NaN/Inf in the checkpoint: "warn" (default) or "error"
    task: str = "forward"  # "text-generation": a decoder's prefill and decode over a static KV cache
    pipeline: bool = True  # a sentence-transformers folder's pooling/normalisation in the artifact; false: bare model


@dataclass(frozen=True)
class GenerationSection:
    """``--task text-generation``: the static cache the programs are built for, the prompts and how many
    tokens the gate generates (docs/generation.md)."""

    batch: int = 2  # prompts per batch; the programs take 1 to this many
    prompt_length: int = 16  # tokens of the generated prompts (odd rows are left-padded by a quarter of it)
    max_cache_len: int = 64  # cache slots: prompt + new tokens must fit
    new_tokens: int = 8  # greedy steps the gate judges (teacher-forced) and generates
    bench_tokens: int = 32  # decode steps timed after the prompt
    cuda_graph: bool = True  # also time the decode replayed from a CUDA graph (CUDA only)
    fuse_projections: bool = True  # export the linears that read one input (q, k, v; gate, up) as one product
    # AOTI: also a decode program with the batch fixed at 1, compiled with Inductor's coordinate-descent tuning (a
    # product of one row becomes a reduction kernel tuned to it); the runner uses it for a batch of one row
    decode_batch_1: bool = False


QUANTIZE_SCHEMES = ("none", "fp8-rowwise", "fp8-weight-only")
QUANTIZE_TARGETS = ("exported_program", "aoti")  # the targets an fp8 model is built for (docs/quantization.md)


@dataclass(frozen=True)
class QuantizeSection:
    """``[quantize]``: the weight transform applied before the attention rewrite and export, and the budget of
    the gate's second question, what the quantization cost (docs/quantization.md)."""

    scheme: str = "none"  # "fp8-rowwise" (dynamic activation + weight, per row) or "fp8-weight-only"
    exclude: tuple[str, ...] = ()  # fnmatch patterns of linears' qualified names kept in the model's dtype
    include_head: bool = False  # also quantize the output head (kept by default, as the embeddings are)
    min_sqnr_db: float = 20.0  # every output against the original float64 reference ...
    max_error_ratio: float = 16.0  # ... or its error within this many times the unquantized model's own
    layer_min_sqnr_db: float = 20.0  # every fp8 linear against its float64 product
    min_top1: float = 0.5  # logits: top-1 agreement with the unquantized model
    max_kl: float = 0.01  # logits: mean KL(unquantized || quantized) of the next-token distribution, nats

    @property
    def enabled(self) -> bool:
        return self.scheme != "none"


@dataclass(frozen=True)
class RuntimeSection:
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str = "auto"
    rewrite_attention: bool = True  # false: attention runs as written (sites still audited), to measure the rewrite


@dataclass(frozen=True)
class TargetsSection:
    build: tuple[str, ...] = ("exported_program", "aoti", "onnx")
    compile_modes: tuple[str, ...] = ("default",)
    compile_dynamic: bool = False
    aoti_cuda_graph: bool = False  # also time (and judge) the AOTI package replayed from a CUDA graph
    onnx_opset: int = 23
    onnx_dtype: str = "auto"


@dataclass(frozen=True)
class InputsSection:
    seed: int = 0
    samples: int = 2
    dims: tuple[Dim, ...] = (Dim("batch", 2, 1, 16), Dim("sequence", 32, 2, 128))
    tensors: tuple[TensorSpec, ...] = ()
    # dims named on the command line (--dim): each must be one the model's inputs use (a typo is refused, not run);
    # not part of the recipe a run records
    given: tuple[str, ...] = field(default=(), compare=False)

    def dim(self, name: str) -> Dim | None:
        return next((d for d in self.dims if d.name == name), None)


@dataclass(frozen=True)
class NumericsSection:
    k: float | None = None  # None: K_DEFAULTS for the candidate's dtype
    atol: float = 0.0  # an absolute floor, in the outputs' units, added to the bar
    floor: float = 1.0  # roundings to the candidate's dtype at the reference output's RMS, added to the bar
    grid: bool = True  # check every artifact with dynamic dims over the shape grid (docs/numerics.md)
    grid_sizes: tuple[int, ...] = (1, 7, 129)  # awkward sizes tried on every dynamic dim whose range holds them
    grid_budget: float = 8.0  # a grid point holds at most this many times the typical sample's input elements
    locate: bool = True  # find the first diverging module of every candidate that fails numerics

    def multiplier(self, dtype: str) -> float:
        if self.k is not None:
            return self.k
        return K_DEFAULTS[dtype]


@dataclass(frozen=True)
class BenchSection:
    warmup: int = 5
    rounds: int = 5
    iterations: int = 10
    peak_tflops: float = 0.0  # the device's dense matmul ceiling; 0 means unknown
    max_seconds: float = 10.0  # a variant whose calls are slow is timed for about this long (0: no limit)


@dataclass(frozen=True)
class ReportSection:
    host: bool = False  # write the machine's host name into report.json and manifest.json


@dataclass(frozen=True)
class TrustSection:
    """What ``exporter check`` may execute of the files it judges (docs/check.md, "Threat model"): nothing, unless
    a key here says so. A recipe's own defaults never do."""

    native_code: bool = False  # load an AOTInductor package someone else compiled (its shared library runs)
    artifact_pickle: bool = False  # load a .pt2 whose weights, constants or objects are pickled (the pickle runs)


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    schema_version: int = SCHEMA_VERSION
    model: ModelSection = field(default_factory=ModelSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    targets: TargetsSection = field(default_factory=TargetsSection)
    inputs: InputsSection = field(default_factory=InputsSection)
    numerics: NumericsSection = field(default_factory=NumericsSection)
    bench: BenchSection = field(default_factory=BenchSection)
    report: ReportSection = field(default_factory=ReportSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    quantize: QuantizeSection = field(default_factory=QuantizeSection)
    trust: TrustSection = field(default_factory=TrustSection)
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["inputs"].pop("given", None)
        return data

    def with_factory(self, factory: str | None) -> "Recipe":
        if not factory:
            return self
        _check_factory(factory)
        return dataclasses.replace(self, model=dataclasses.replace(self.model, factory=factory))

    def with_targets(self, targets: tuple[str, ...] = ()) -> "Recipe":
        """``--target NAME`` (repeatable): build only these targets, in the recipe's order of stages."""
        if not targets:
            return self
        problems = _Problems("given with --target", f"choose from {', '.join(TARGETS)}")
        for name in targets:
            _choice(name, TARGETS, "--target", problems)
        if len(set(targets)) != len(targets):
            problems.add("--target", "a target is given twice")
        if "compile" in targets and not self.targets.compile_modes:
            problems.add("--target", "'compile' needs targets.compile_modes in the recipe")
        problems.raise_if_any()
        build = tuple(t for t in TARGETS if t in targets)
        return dataclasses.replace(self, targets=dataclasses.replace(self.targets, build=build))

    def with_task(self, task: str | None) -> "Recipe":
        """``--task NAME``: what the model is converted for (``forward`` or ``text-generation``)."""
        if not task or task == self.model.task:
            return self
        problems = _Problems("given with --task", f"choose from {', '.join(TASKS)}")
        _choice(task, TASKS, "--task", problems)
        problems.raise_if_any()
        return dataclasses.replace(self, model=dataclasses.replace(self.model, task=task))

    def with_rewrite(self, enabled: bool) -> "Recipe":
        if enabled == self.runtime.rewrite_attention:
            return self
        return dataclasses.replace(self, runtime=dataclasses.replace(self.runtime, rewrite_attention=enabled))

    def with_inputs(self, dims: tuple[str, ...] = (), tensors: tuple[str, ...] = ()) -> "Recipe":
        """Inputs declared on the command line: ``--dim NAME=SIZE[:MIN:MAX]`` (overrides a recipe dim of
        that name) and ``--input NAME:DTYPE:SHAPE[:LOW:HIGH]`` (replace the recipe's declared tensors)."""
        if not dims and not tensors:
            return self
        data: dict[str, Any] = {"dims": {d.name: {"size": d.size, "min": d.min, "max": d.max}
                                         for d in self.inputs.dims}}
        given: dict[str, str] = {}
        for text in dims:
            parsed_dim = _parse_dim_option(text)
            name = next(iter(parsed_dim))
            before = given.setdefault(name, text)
            if parsed_dim[name] != _parse_dim_option(before)[name]:  # neither may silently win
                raise RecipeError(f"--dim {name} is given twice ({before!r} and {text!r})",
                                  f"give --dim {name}=... once")
            data["dims"].update(parsed_dim)
        declared = [_parse_input_option(t) for t in tensors] if tensors else [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "low": t.low, "high": t.high}
            for t in self.inputs.tensors]
        problems = _Problems("given with --dim/--input",
                             "correct the --dim/--input options (see exporter convert --help)")
        parsed_dims = _parse_dims(data["dims"], problems)
        parsed = _parse_tensors(declared, parsed_dims, problems) if declared else ()
        problems.raise_if_any()
        return dataclasses.replace(self, inputs=dataclasses.replace(self.inputs, dims=parsed_dims, tensors=parsed,
                                                                    given=tuple(given)))


# --------------------------------------------------------------------------- parsing


class _Problems:
    def __init__(self, source: str, hint: str = "correct the recipe file (see docs/recipes.md for every key)"):
        self.source = source
        self.hint = hint
        self.items: list[str] = []

    def add(self, where: str, what: str) -> None:
        self.items.append(f"{where}: {what}")

    def raise_if_any(self) -> None:
        if self.items:
            listing = "; ".join(self.items)
            raise RecipeError(f"recipe {self.source} has {len(self.items)} problem(s): {listing}", self.hint)


def _typename(value: Any) -> str:
    return type(value).__name__


def _get(table: dict, key: str, kind: type | tuple, default: Any, where: str, problems: _Problems) -> Any:
    if key not in table:
        return default
    value = table[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds:
        problems.add(f"{where}.{key}", f"expected {kinds[0].__name__}, got bool")
        return default
    if not isinstance(value, kinds):
        problems.add(f"{where}.{key}", f"expected {kinds[0].__name__}, got {_typename(value)} {value!r}")
        return default
    return value


def _choice(value: Any, allowed: tuple, where: str, problems: _Problems) -> None:
    if value not in allowed:
        problems.add(where, f"{value!r} is not one of {', '.join(allowed)}")


def _unknown(table: dict, known: set[str], where: str, problems: _Problems) -> None:
    for key in table:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.add(f"{where}.{key}" if where else key, f"unknown key{hint}")


def _str_list(table: dict, key: str, default: tuple, where: str, problems: _Problems) -> tuple[str, ...]:
    value = _get(table, key, list, list(default), where, problems)
    if not all(isinstance(v, str) for v in value):
        problems.add(f"{where}.{key}", "expected a list of strings")
        return default
    return tuple(value)


def _parse_dim_option(text: str) -> dict[str, dict[str, int]]:
    name, sep, sizes = text.partition("=")
    parts = sizes.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not sep or not _NAME.match(name) or len(values) not in (1, 3):
        raise RecipeError(f"--dim {text!r} is not NAME=SIZE or NAME=SIZE:MIN:MAX",
                          "write e.g. --dim batch=2:1:32 (dynamic) or --dim batch=2 (static)")
    size, lo, hi = (values * 3)[:3] if len(values) == 1 else values
    return {name: {"size": size, "min": lo, "max": hi}}


def _parse_input_option(text: str) -> dict[str, Any]:
    parts = text.split(":")
    if len(parts) not in (3, 5) or not all(parts[:3]):
        raise RecipeError(f"--input {text!r} is not NAME:DTYPE:SHAPE or NAME:DTYPE:SHAPE:LOW:HIGH",
                          "write e.g. --input tokens:int64:batch,sequence:0:32000 or --input x:float32:batch,16")
    shape = [int(e) if e.strip().lstrip("-").isdigit() else e.strip() for e in parts[2].split(",")]
    entry: dict[str, Any] = {"name": parts[0], "dtype": parts[1], "shape": shape}
    if len(parts) == 5:
        try:
            entry["low"], entry["high"] = float(parts[3]), float(parts[4])
        except ValueError:
            raise RecipeError(f"--input {text!r}: LOW and HIGH must be numbers",
                              "write e.g. x:float32:batch,16:-1:1") from None
    return entry


def _check_factory(text: str) -> None:
    if not _FACTORY.match(text):
        raise RecipeError(f"model factory {text!r} is not of the form package.module:function",
                          "pass it as --model package.module:function")


def _parse_dims(table: Any, problems: _Problems) -> tuple[Dim, ...]:
    where = "inputs.dims"
    if not isinstance(table, dict):
        problems.add(where, f"expected a table, got {_typename(table)}")
        return InputsSection().dims
    dims = []
    for name, spec in table.items():
        at = f"{where}.{name}"
        if not _NAME.match(name):
            problems.add(at, "dim names are identifiers")
            continue
        if isinstance(spec, int) and not isinstance(spec, bool):
            spec = {"size": spec}
        if not isinstance(spec, dict):
            problems.add(at, f"expected an int or a table with size/min/max, got {_typename(spec)}")
            continue
        _unknown(spec, {"size", "min", "max"}, at, problems)
        size = _get(spec, "size", int, None, at, problems)
        if size is None:
            problems.add(at, "size is required")
            continue
        lo = _get(spec, "min", int, size, at, problems)
        hi = _get(spec, "max", int, size, at, problems)
        if size < 1 or lo < 1:
            problems.add(at, "sizes must be at least 1")
        elif not lo <= size <= hi:
            problems.add(at, f"needs min <= size <= max, got min={lo} size={size} max={hi}")
        elif lo < hi and size < 2:
            problems.add(at, "a dynamic dim needs size >= 2 (torch.export specialises sizes 0 and 1)")
        dims.append(Dim(name, size, lo, hi))
    return tuple(dims)


def _parse_tensors(items: Any, dims: tuple[Dim, ...], problems: _Problems) -> tuple[TensorSpec, ...]:
    where = "inputs.tensor"
    if not isinstance(items, list):
        problems.add(where, "expected an array of tables ([[inputs.tensor]])")
        return ()
    names = {d.name for d in dims}
    specs = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            problems.add(at, "expected a table")
            continue
        _unknown(item, {"name", "shape", "dtype", "low", "high"}, at, problems)
        name = _get(item, "name", str, "", at, problems)
        if not _NAME.match(name or ""):
            problems.add(f"{at}.name", "required, an identifier")
        shape = _get(item, "shape", list, [], at, problems)
        for entry in shape:
            if isinstance(entry, bool) or not isinstance(entry, (int, str)):
                problems.add(f"{at}.shape", f"entries are ints or dim names, got {entry!r}")
            elif isinstance(entry, int) and entry < 1:
                problems.add(f"{at}.shape", f"sizes must be at least 1, got {entry}")
            elif isinstance(entry, str) and entry not in names:
                problems.add(f"{at}.shape", f"dim {entry!r} is not declared in [inputs.dims]")
        dtype = _get(item, "dtype", str, "float32", at, problems)
        _choice(dtype, TENSOR_DTYPES, f"{at}.dtype", problems)
        low = _get(item, "low", float, 0.0 if dtype in ("int64", "int32") else -1.0, at, problems)
        high = _get(item, "high", float, 2.0 if dtype == "bool" else 1.0, at, problems)
        if low >= high:
            problems.add(at, f"needs low < high, got low={low} high={high}")
        specs.append(TensorSpec(name, tuple(shape), dtype, low, high))
    seen = [s.name for s in specs]
    for dup in sorted({n for n in seen if seen.count(n) > 1}):
        problems.add(where, f"input {dup!r} is declared twice")
    return tuple(specs)


def parse_recipe(data: dict, name: str, source: str, problems: _Problems | None = None) -> Recipe:
    """Build a Recipe from parsed TOML, listing every problem at once."""
    p = problems or _Problems(source)
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
    _unknown(t, {"factory", "outputs", "nonfinite_weights", "task", "pipeline"}, "model", p)
    factory = _get(t, "factory", str, None, "model", p)
    if factory is not None and not _FACTORY.match(factory):
        p.add("model.factory", f"{factory!r} is not of the form package.module:function")
    model = ModelSection(factory=factory, outputs=_str_list(t, "outputs", (), "model", p),
                         nonfinite_weights=_get(t, "nonfinite_weights", str, "warn", "model", p),
                         task=_get(t, "task", str, "forward", "model", p),
                         pipeline=_get(t, "pipeline", bool, True, "model", p))
    _choice(model.nonfinite_weights, NONFINITE_POLICIES, "model.nonfinite_weights", p)
    _choice(model.task, TASKS, "model.task", p)

    t = table("runtime")
    dr = RuntimeSection()
    _unknown(t, {f.name for f in dataclasses.fields(RuntimeSection)}, "runtime", p)
    runtime = RuntimeSection(
        device=_get(t, "device", str, dr.device, "runtime", p),
        dtype=_get(t, "dtype", str, dr.dtype, "runtime", p),
        attention_backend=_get(t, "attention_backend", str, dr.attention_backend, "runtime", p),
        rewrite_attention=_get(t, "rewrite_attention", bool, dr.rewrite_attention, "runtime", p),
    )
    _choice(runtime.device, DEVICES, "runtime.device", p)
    _choice(runtime.dtype, RUNTIME_DTYPES, "runtime.dtype", p)
    _choice(runtime.attention_backend, ATTENTION_BACKENDS, "runtime.attention_backend", p)
    if runtime.device == "cpu" and runtime.attention_backend in ("flash", "cudnn"):
        p.add("runtime.attention_backend", f"{runtime.attention_backend!r} needs device 'cuda'")

    t = table("targets")
    dt = TargetsSection()
    _unknown(t, {f.name for f in dataclasses.fields(TargetsSection)}, "targets", p)
    targets = TargetsSection(
        build=_str_list(t, "build", dt.build, "targets", p),
        compile_modes=_str_list(t, "compile_modes", dt.compile_modes, "targets", p),
        compile_dynamic=_get(t, "compile_dynamic", bool, dt.compile_dynamic, "targets", p),
        aoti_cuda_graph=_get(t, "aoti_cuda_graph", bool, dt.aoti_cuda_graph, "targets", p),
        onnx_opset=_get(t, "onnx_opset", int, dt.onnx_opset, "targets", p),
        onnx_dtype=_get(t, "onnx_dtype", str, dt.onnx_dtype, "targets", p),
    )
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
    _unknown(t, {f.name for f in dataclasses.fields(NumericsSection)}, "numerics", p)
    grid_sizes = _get(t, "grid_sizes", list, list(dn.grid_sizes), "numerics", p)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in grid_sizes):
        p.add("numerics.grid_sizes", "expected a list of integers >= 1")
        grid_sizes = list(dn.grid_sizes)
    numerics = NumericsSection(k=_get(t, "k", float, dn.k, "numerics", p),
                               atol=_get(t, "atol", float, dn.atol, "numerics", p),
                               floor=_get(t, "floor", float, dn.floor, "numerics", p),
                               grid=_get(t, "grid", bool, dn.grid, "numerics", p), grid_sizes=tuple(grid_sizes),
                               grid_budget=_get(t, "grid_budget", float, dn.grid_budget, "numerics", p),
                               locate=_get(t, "locate", bool, dn.locate, "numerics", p))
    if not numerics.grid_budget >= 1.0:
        p.add("numerics.grid_budget", f"must be at least 1, got {numerics.grid_budget}")
    if numerics.k is not None and not numerics.k >= 1.0:
        p.add("numerics.k", f"must be at least 1, got {numerics.k}")
    if not numerics.atol >= 0.0:
        p.add("numerics.atol", f"must be non-negative, got {numerics.atol}")
    if not numerics.floor >= 0.0:
        p.add("numerics.floor", f"must be non-negative, got {numerics.floor}")

    t = table("bench")
    db = BenchSection()
    _unknown(t, {f.name for f in dataclasses.fields(BenchSection)}, "bench", p)
    bench = BenchSection(
        warmup=_get(t, "warmup", int, db.warmup, "bench", p),
        rounds=_get(t, "rounds", int, db.rounds, "bench", p),
        iterations=_get(t, "iterations", int, db.iterations, "bench", p),
        peak_tflops=_get(t, "peak_tflops", float, db.peak_tflops, "bench", p),
        max_seconds=_get(t, "max_seconds", float, db.max_seconds, "bench", p),
    )
    for key in ("warmup", "rounds", "iterations"):
        low = 0 if key == "warmup" else 1
        if getattr(bench, key) < low:
            p.add(f"bench.{key}", f"must be at least {low}, got {getattr(bench, key)}")
    if bench.peak_tflops < 0:
        p.add("bench.peak_tflops", "must be non-negative")
    if bench.max_seconds < 0:
        p.add("bench.max_seconds", "must be non-negative (0: no limit)")

    t = table("report")
    _unknown(t, {f.name for f in dataclasses.fields(ReportSection)}, "report", p)
    report = ReportSection(host=_get(t, "host", bool, ReportSection().host, "report", p))

    t = table("generation")
    dg = GenerationSection()
    _unknown(t, {f.name for f in dataclasses.fields(GenerationSection)}, "generation", p)
    generation = GenerationSection(**{f.name: _get(t, f.name, type(getattr(dg, f.name)), getattr(dg, f.name),
                                                   "generation", p) for f in dataclasses.fields(GenerationSection)})
    if generation.batch < 2:
        p.add("generation.batch", f"must be at least 2 (the programs also run batch 1), got {generation.batch}")
    if generation.prompt_length < 2:
        p.add("generation.prompt_length", f"must be at least 2, got {generation.prompt_length}")
    if generation.new_tokens < 1 or generation.bench_tokens < 1:
        p.add("generation.new_tokens", "new_tokens and bench_tokens must be at least 1")
    if generation.prompt_length + max(generation.new_tokens, 1) > generation.max_cache_len:
        p.add("generation.max_cache_len", f"{generation.max_cache_len} slots cannot hold a "
              f"{generation.prompt_length}-token prompt and {generation.new_tokens} new tokens")

    t = table("quantize")
    dq = QuantizeSection()
    _unknown(t, {f.name for f in dataclasses.fields(QuantizeSection)}, "quantize", p)
    quantize = QuantizeSection(
        scheme=_get(t, "scheme", str, dq.scheme, "quantize", p),
        exclude=_str_list(t, "exclude", dq.exclude, "quantize", p),
        include_head=_get(t, "include_head", bool, dq.include_head, "quantize", p),
        **{key: _get(t, key, float, getattr(dq, key), "quantize", p)
           for key in ("min_sqnr_db", "max_error_ratio", "layer_min_sqnr_db", "min_top1", "max_kl")})
    _choice(quantize.scheme, QUANTIZE_SCHEMES, "quantize.scheme", p)
    if quantize.max_error_ratio < 1.0:
        p.add("quantize.max_error_ratio", f"must be at least 1, got {quantize.max_error_ratio}")
    if not 0.0 <= quantize.min_top1 <= 1.0:
        p.add("quantize.min_top1", f"must be between 0 and 1, got {quantize.min_top1}")
    if quantize.max_kl < 0.0:
        p.add("quantize.max_kl", f"must be non-negative, got {quantize.max_kl}")

    t = table("trust")
    _unknown(t, {f.name for f in dataclasses.fields(TrustSection)}, "trust", p)
    trust = TrustSection(**{f.name: _get(t, f.name, bool, False, "trust", p) for f in dataclasses.fields(TrustSection)})

    p.raise_if_any()
    recipe = Recipe(name=name, description=description, schema_version=SCHEMA_VERSION, model=model,
                    runtime=runtime, targets=targets, inputs=inputs, numerics=numerics, bench=bench,
                    report=report, generation=generation, quantize=quantize, trust=trust, source=source)
    return recipe


def check_combination(recipe: Recipe, source: str = "") -> None:
    """Settings of different sections that cannot hold together: refused, never one silently winning. Checked on
    the recipe a run uses (:func:`resolve_recipe`: after ``--set``, ``--target`` and ``--task``), so a command line
    can mend what the file alone would not allow."""
    _check_decode_batch_1(recipe, source)
    q = recipe.quantize
    if not q.enabled:
        return
    p = _Problems(source or recipe.source or recipe.name,
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
    p = _Problems(source or recipe.source or recipe.name,
                  "set generation.decode_batch_1 = false, or build what it needs (docs/generation.md)")
    if recipe.model.task != "text-generation":
        p.add("generation.decode_batch_1", f"the decode program of batch 1 is built for --task text-generation; "
              f"--task {recipe.model.task} has none yet")
    elif "aoti" not in recipe.targets.build:
        p.add("generation.decode_batch_1", "the decode program of batch 1 is built by the aoti target, which the "
              f"targets ({', '.join(recipe.targets.build) or 'none'}) leave out (add --target aoti)")
    p.raise_if_any()


# --------------------------------------------------------------------------- lookup


def builtin_dir() -> Path:
    """The folder of built-in recipes: inside the installed package, else the checkout's recipes/."""
    packaged = Path(str(importlib.resources.files("exporter"))) / "recipes"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / "recipes"
    return checkout


def public_source(recipe: Recipe) -> str:
    """Where a recipe came from, as a published report shows it: a built-in's name, or a public path."""
    if not recipe.source:
        return ""
    source = Path(recipe.source)
    folder = builtin_dir()
    if source.is_absolute() and folder.is_dir() and source.resolve().is_relative_to(folder.resolve()):
        return f"{recipe.name} (built-in)"
    return public_path(source)


def builtin_names() -> list[str]:
    folder = builtin_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.rglob("*.toml"))


def builtin_path(name: str) -> Path | None:
    folder = builtin_dir()
    matches = sorted(folder.rglob(f"{name}.toml")) if folder.is_dir() else []
    return matches[0] if matches else None


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a built-in recipe by name, or a recipe file by path: TOML, or the ``recipe.json`` a run wrote."""
    text = str(name_or_path)
    path = Path(text)
    looks_like_path = text.endswith((".toml", ".json")) or "/" in text or "\\" in text
    if not looks_like_path:
        found = builtin_path(text)
        if found is None:
            names = builtin_names()
            near = difflib.get_close_matches(text, names, n=3, cutoff=0.4)
            hint = f"did you mean {', '.join(near)}?" if near else f"built-in recipes are: {', '.join(names)}"
            raise RecipeError(f"unknown recipe {text!r}",
                              f"{hint} (or pass the path of a .toml recipe file)")
        path, name = found, text
    else:
        if not path.is_file():
            raise RecipeError(f"recipe file {text} does not exist", "check the path, or pass a built-in recipe name")
        name = path.stem
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise RecipeError(f"recipe {path} is not valid JSON ({exc})",
                              "fix the syntax at the position named") from None
        if not isinstance(data, dict):
            raise RecipeError(f"recipe {path} is not a JSON object", "pass a recipe.json written by exporter convert")
        return recipe_from_dict(data, source=str(path))
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RecipeError(f"recipe {path} is not valid TOML ({exc})", "fix the syntax at the position named") from None
    return parse_recipe(data, name=name, source=str(path))


def recipe_from_dict(data: dict[str, Any], source: str = "recipe.json") -> Recipe:
    """The Recipe a ``recipe.json`` (``Recipe.to_dict()``) holds, checked by the same parser as a TOML file."""
    return parse_recipe(_as_table(data), name=str(data.get("name") or Path(source).stem), source=source)


def _as_table(data: dict[str, Any]) -> dict[str, Any]:
    """``Recipe.to_dict()``'s shape turned into the TOML file's (what :func:`parse_recipe` reads)."""
    table: dict[str, Any] = {k: v for k, v in data.items() if k not in ("name", "source", "inputs") and v is not None}
    for section in ("model", "runtime", "targets", "numerics", "bench", "report", "generation", "quantize", "trust"):
        if isinstance(table.get(section), dict):
            table[section] = {k: v for k, v in table[section].items() if v is not None}
    inputs = data.get("inputs")
    if isinstance(inputs, dict):
        converted: dict[str, Any] = {k: v for k, v in inputs.items() if k not in ("dims", "tensors")}
        dims = inputs.get("dims")
        if isinstance(dims, list) and all(isinstance(d, dict) for d in dims):
            # [{name, size, min, max}] in JSON, a table of tables in TOML
            converted["dims"] = {str(d.get("name")): {k: v for k, v in d.items() if k != "name"} for d in dims}
        elif dims is not None:
            converted["dims"] = dims
        if inputs.get("tensors"):
            converted["tensor"] = inputs["tensors"]
        table["inputs"] = converted
    elif inputs is not None:
        table["inputs"] = inputs
    return table


_SETTING = re.compile(r"^([a-z_]+)\.([A-Za-z_][A-Za-z0-9_.]*)=(.*)$", re.S)


def _setting_value(text: str, current: Any) -> Any:
    """A ``--set`` value: a TOML value (``1e-6``, ``true``, ``["a", "b"]``), a comma-separated list where the
    key holds a list, ``SIZE[:MIN:MAX]`` for a dim, and otherwise the text itself (``bfloat16``)."""
    if isinstance(current, list) and not text.lstrip().startswith("["):
        return [part.strip() for part in text.split(",") if part.strip()]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_settings(recipe: Recipe, settings: tuple[str, ...]) -> Recipe:
    """``--set section.key=value`` (repeatable) on top of ``recipe``, checked by the recipe file's parser."""
    if not settings:
        return recipe
    table = _as_table(json.loads(json.dumps(recipe.to_dict())))  # the shape recipe.json has: lists, not tuples
    hint = "write --set section.key=value, e.g. --set numerics.atol=1e-6 (docs/recipes.md lists every key)"
    given: dict[tuple[str, str], str] = {}
    for text in settings:
        match = _SETTING.match(text)
        if not match:
            raise RecipeError(f"--set {text!r} is not section.key=value", hint)
        section, key, value = match.groups()
        before = given.setdefault((section, key), value)
        if before.strip() != value.strip():  # neither may silently win
            raise RecipeError(f"--set {section}.{key} is given twice ({before!r} and {value!r})",
                              f"give --set {section}.{key}=... once")
        if section not in table:
            table[section] = {}
        if not isinstance(table[section], dict):
            raise RecipeError(f"--set {text!r}: {section} is not a section", hint)
        if section == "inputs" and key.startswith("dims."):
            name = key[len("dims."):]
            table["inputs"].setdefault("dims", {}).update(_parse_dim_option(f"{name}={value}"))
            continue
        table[section][key] = _setting_value(value, table[section].get(key))
    problems = _Problems("given with --set", hint)
    return parse_recipe(table, name=recipe.name, source=recipe.source, problems=problems)


def _refuse_dims_set_twice(dims: tuple[str, ...], settings: tuple[str, ...]) -> None:
    """``--dim NAME=...`` and ``--set inputs.dims.NAME=...`` giving one dim two different sizes: refused, as an
    option given twice with two values is (neither silently wins); the same size given both ways is allowed."""
    if not dims:
        return
    by_set: dict[str, str] = {}
    for text in settings:
        match = _SETTING.match(text)
        if match and match.group(1) == "inputs" and match.group(2).startswith("dims."):
            by_set[match.group(2)[len("dims."):]] = match.group(3)
    for text in dims:
        parsed = _parse_dim_option(text)
        name = next(iter(parsed))
        if name in by_set and _parse_dim_option(f"{name}={by_set[name]}")[name] != parsed[name]:
            raise RecipeError(f"--dim {text!r} and --set inputs.dims.{name}={by_set[name]} both size dim {name}",
                              f"give one of them: --dim {name}=SIZE[:MIN:MAX]")


def resolve_recipe(recipe: str | Path | Recipe, factory: str | None = None, dims: tuple[str, ...] = (),
                   tensors: tuple[str, ...] = (), rewrite: bool = True, targets: tuple[str, ...] = (),
                   settings: tuple[str, ...] = (), task: str | None = None, combination: bool = True) -> Recipe:
    """The recipe (a name, a path or a Recipe) with the command line's ``--set`` overrides, then its factory,
    input declarations, ``--target`` selection and ``--no-rewrite`` (``rewrite=False``; True keeps the
    recipe's own setting). Torch is not needed: the command line checks all of it before loading torch.
    ``--target`` and ``--set targets.build=`` both choosing the targets is refused, and so are ``--dim`` and
    ``--set inputs.dims.`` giving one dim two sizes: neither silently wins."""
    if targets and any(s.split("=", 1)[0].strip() == "targets.build" for s in settings):
        raise RecipeError("--target and --set targets.build=... both choose the targets to build",
                          "give one of them: --target NAME (repeatable) or --set targets.build=NAME,NAME")
    _refuse_dims_set_twice(dims, settings)
    loaded = apply_settings(recipe if isinstance(recipe, Recipe) else load_recipe(recipe), settings)
    resolved = loaded.with_factory(factory).with_inputs(dims, tensors).with_targets(targets).with_task(task)
    if combination:  # exporter check builds nothing: it refuses [quantize] itself, whatever the targets
        check_combination(resolved, "given on the command line")
    return resolved if rewrite else resolved.with_rewrite(False)
