"""A recipe's typed sections (frozen dataclasses, their defaults) and the checks of one value each, which gather
every problem before raising."""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import K_DEFAULTS, TENSOR_DTYPES
from ..errors import Problems, RecipeError
from ..targets import NAMES as TARGETS
from ..targets import TARGETS as TARGET_ROWS
from ..targets.spec import BuildSettings, TargetsSection

__all__ = [
    "ATTENTION_BACKENDS", "COMPILE_MODES", "DEVICES", "GENERATION_TASKS", "NONFINITE_POLICIES", "ONNX_DTYPES",
    "QUANTIZE_SCHEMES", "QUANTIZE_TARGETS", "SCHEMA_VERSION", "TASKS", "BenchSection", "Dim", "GenerationSection",
    "InputsSection", "ModelSection", "NumericsSection", "QuantizeSection", "Recipe", "ReportSection",
    "RuntimeSection", "TargetsSection", "TensorSpec", "TrustSection",
]

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
    # the decode program of batch 1 (where decode_batch_1 builds one), on CUDA: each attention as
    # exporter::decode_attention (kernels/decode_attention.py), the cache's grouped heads read once and the mask as one
    # row, instead of SDPA after transformers' repeat_kv; false keeps SDPA
    decode_attention_kernel: bool = True
    # the same program, on CUDA: each such attention with this step's rotary embedding of q and the key and the
    # cache write folded in, as one exporter::decode_step_attention kernel (kernels/decode_step_attention.py);
    # false leaves them to Inductor
    decode_step_kernel: bool = True
    # the same program, on CUDA: each product of one row, with the RMSNorm before it, silu(gate) * up after a fused
    # gate/up product and the residual add after it, as one exporter::gemv kernel (kernels/decode_products.py), an
    # fp8 weight-only product too (the kernel reads the fp8 weight and its row scales); false keeps Inductor's
    # reductions and exporter::fp8_gemv
    decode_gemv_kernel: bool = True


QUANTIZE_SCHEMES = ("none", "fp8-rowwise", "fp8-weight-only")
QUANTIZE_TARGETS = tuple(t.name for t in TARGET_ROWS if t.quantized)  # what an fp8 model is built for


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

    def build_settings(self) -> BuildSettings:
        """What the targets' builds read of this recipe."""
        return BuildSettings(self.runtime.device, self.runtime.dtype, self.runtime.attention_backend, self.targets)

    def with_factory(self, factory: str | None) -> "Recipe":
        if not factory:
            return self
        _check_factory(factory)
        return dataclasses.replace(self, model=dataclasses.replace(self.model, factory=factory))

    def with_targets(self, targets: tuple[str, ...] = ()) -> "Recipe":
        """``--target NAME`` (repeatable): build only these targets, in the recipe's order of stages."""
        if not targets:
            return self
        problems = recipe_problems("given with --target", f"choose from {', '.join(TARGETS)}")
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
        problems = recipe_problems("given with --task", f"choose from {', '.join(TASKS)}")
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
            parsed_dim = parse_dim_option(text)
            name = next(iter(parsed_dim))
            before = given.setdefault(name, text)
            if parsed_dim[name] != parse_dim_option(before)[name]:  # neither may silently win
                raise RecipeError(f"--dim {name} is given twice ({before!r} and {text!r})",
                                  f"give --dim {name}=... once")
            data["dims"].update(parsed_dim)
        declared = [_parse_input_option(t) for t in tensors] if tensors else [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "low": t.low, "high": t.high}
            for t in self.inputs.tensors]
        problems = recipe_problems("given with --dim/--input",
                             "correct the --dim/--input options (see exporter convert --help)")
        parsed_dims = _parse_dims(data["dims"], problems)
        parsed = _parse_tensors(declared, parsed_dims, problems) if declared else ()
        problems.raise_if_any()
        return dataclasses.replace(self, inputs=dataclasses.replace(self.inputs, dims=parsed_dims, tensors=parsed,
                                                                    given=tuple(given)))


# --------------------------------------------------------------------------- parsing


def recipe_problems(source: str, hint: str = "correct the recipe file (see docs/recipes.md for every key)") -> Problems:
    return Problems(f"recipe {source}", RecipeError, hint)


def _typename(value: Any) -> str:
    return type(value).__name__


def _get(table: dict, key: str, kind: type | tuple, default: Any, where: str, problems: Problems) -> Any:
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


def _choice(value: Any, allowed: tuple, where: str, problems: Problems) -> None:
    if value not in allowed:
        problems.add(where, f"{value!r} is not one of {', '.join(allowed)}")


def _unknown(table: dict, known: set[str], where: str, problems: Problems) -> None:
    for key in table:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.add(f"{where}.{key}" if where else key, f"unknown key{hint}")


def _str_list(table: dict, key: str, default: tuple, where: str, problems: Problems) -> tuple[str, ...]:
    value = _get(table, key, list, list(default), where, problems)
    if not all(isinstance(v, str) for v in value):
        problems.add(f"{where}.{key}", "expected a list of strings")
        return default
    return tuple(value)


def parse_dim_option(text: str) -> dict[str, dict[str, int]]:
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


def _parse_dims(table: Any, problems: Problems) -> tuple[Dim, ...]:
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


def _parse_tensors(items: Any, dims: tuple[Dim, ...], problems: Problems) -> tuple[TensorSpec, ...]:
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
