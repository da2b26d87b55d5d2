"""The GPU performance suite: each model's artifacts side by side with eager and with what a user does by hand.

    python benchmarks/gpu_suite.py gpt2 bert --out DIR           # on the GPU machine: DIR/<model>.json
    python benchmarks/gpu_suite.py --write-doc docs/BENCHMARKS.md DIR/*.json
    python benchmarks/gpu_suite.py bert --tiny --out DIR         # a small smoke run (CPU: no CUDA graphs)

(``benchmarks/gpu_suite.sh`` runs it on the GPU machine in the calls it needs.) Per model:

1. random weights from the model's own config (no model hub), saved as safetensors;
2. ``exporter convert`` of that checkpoint with ``--recipe h100-bf16``, as a user runs it: the gate judges every
   artifact, and the convert's own report is kept. Every artifact target of the recipe is built (its
   ``compile`` benchmark variants are not: the hand-tuned compiles below stand for them; ``--targets`` changes
   that); the typical shape is small (8 × 512, 8 images) and the dynamic dims span the rows, and the shape grid
   is off, so that the convert fits a device call beside the timing;
3. in one process, per row (a batch shape), timed interleaved with CUDA events (``exporter.measure.bench``):
   - ``eager``: the model with its original attention (transformers' ``eager``, or the hand-written code);
   - by hand: ``torch.compile(mode="max-autotune")`` of that model; for a transformers model also the library's
     own ``attn_implementation="sdpa"``, eager and with the same compile; at batch 1 ``mode="reduce-overhead"``;
   - exporter's artifacts loaded from the convert's folder: the exported program, the AOTInductor package,
     and the package replayed from a CUDA graph (``aoti_loader.CudaGraphed``), all at the row's shape; each
     variant's output is compared with eager's there (relative L2 error: a sanity check at a shape the gate
     may not have run).

Figures per variant: median and p90 latency, throughput, speedup against eager and against the best hand-tuned
compile, TFLOP/s and the fraction of the measured bf16 peak (FLOPs of the eager model from
``torch.utils.flop_counter``), peak working GPU memory (what one call allocates beyond what is resident), build
time (a compile's first call; an artifact's build in the convert; a CUDA graph's capture). Attention: the SDPA
kernels' time inside the AOTInductor package (profiler) against the same SDPA calls (recorded from the rewritten
model at the row's shape) timed alone under each fused backend, the best kept. Whether the hand-tuned compile
fused a hand-written attention by itself is read from its kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
from exporter.measure.bench import interleaved, summarize, time_calls  # noqa: E402
from exporter.measure.kernels import _device_backend, top_by_time  # noqa: E402

PEAK_TFLOPS = 790.0  # dense bf16 matmul measured on the H200 (recipes/h100-bf16.toml, bench.peak_tflops)
LAUNCH_BOUND_MS = 0.02  # an attention kernel shorter than this is not compared with a lone call's timing
TARGETS = {"vs_hand": 1.0, "vs_hand_unfused": 1.3, "peak": 0.60, "batch1_vs_eager": 4.0, "batch1_vs_ro": 1.0,
           "attention": 0.90}


@dataclass
class Row:
    label: str
    sizes: dict[str, int]  # batch, sequence

    @property
    def batch(self) -> int:
        return self.sizes["batch"]


@dataclass
class Model:
    name: str
    title: str
    rows: list[Row]
    dims: list[str]  # --dim for the convert: its typical shape (small, for a quick convert) and a range over the rows
    transformers: bool = True
    factory: str | None = None  # --model for a factory model
    declared: list[str] = field(default_factory=list)  # --input: a factory model's inputs, or a narrower set
    causal_lm: bool = False
    family: str = ""  # the model built (hf_model's name) when ``name`` is a variant of it; default: ``name``
    note: str = ""  # what this variant of the convert is, for the document

    @property
    def builds(self) -> str:
        return self.family or self.name


def llama1b_config(tiny: bool):
    import transformers

    if tiny:
        return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        max_position_embeddings=512)
    return transformers.LlamaConfig(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True)


def hf_model(name: str, tiny: bool):
    """The transformers class and config of ``name`` (full size, or tiny for a smoke run)."""
    import transformers as t

    small = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
    if name == "gpt2":
        cfg = t.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256) if tiny else t.GPT2Config()
        return t.GPT2LMHeadModel, cfg
    if name == "bert":
        return t.BertModel, t.BertConfig(**small, vocab_size=256) if tiny else t.BertConfig()
    if name == "vit":
        cfg = t.ViTConfig(**small, image_size=32, patch_size=8, num_labels=10) if tiny else t.ViTConfig(num_labels=1000)
        return t.ViTForImageClassification, cfg
    if name == "llama1b":
        return t.LlamaForCausalLM, llama1b_config(tiny)
    raise KeyError(name)


def models(tiny: bool) -> dict[str, Model]:
    def rows(*specs):
        return [Row(label, sizes) for label, sizes in specs]

    if tiny:
        return with_variants({
            "gpt2": Model("gpt2", "GPT-2 (tiny)", rows(("2 × 64", {"batch": 2, "sequence": 64})),
                          ["batch=2:1:4", "sequence=64:16:128"], causal_lm=True),
            "bert": Model("bert", "BERT (tiny)", rows(("4 × 32", {"batch": 4, "sequence": 32}),
                                                      ("1 × 32", {"batch": 1, "sequence": 32})),
                          ["batch=4:1:4", "sequence=32:16:64"]),
            "vit": Model("vit", "ViT (tiny)", rows(("batch 4", {"batch": 4}), ("batch 1", {"batch": 1})),
                         ["batch=4:1:4"]),
            "llama1b": Model("llama1b", "Llama (tiny)", rows(("2 × 64", {"batch": 2, "sequence": 64})),
                             ["batch=2:1:4", "sequence=64:16:128"], causal_lm=True),
            "handwritten": Model("handwritten", "hand-written-attention GPT (tiny)",
                                 rows(("2 × 64", {"batch": 2, "sequence": 64})), ["batch=2:1:4", "sequence=64:16:128"],
                                 transformers=False, factory="exporter.testing.handwritten_gpt:build",
                                 declared=["input_ids:int64:batch,sequence:0:256",
                                           "attention_mask:int64:batch,sequence"]),
        }, tiny)
    return with_variants({
        "gpt2": Model("gpt2", "GPT-2 small (124M)", rows(("8 × 1024", {"batch": 8, "sequence": 1024})),
                      ["batch=8:1:64", "sequence=512:16:1024"], causal_lm=True),
        "bert": Model("bert", "BERT-base (110M)", rows(("128 × 128", {"batch": 128, "sequence": 128}),
                                                      ("1 × 128", {"batch": 1, "sequence": 128})),
                      ["batch=8:1:128", "sequence=128:16:512"]),
        "vit": Model("vit", "ViT-B/16 (86M), 224 × 224", rows(("batch 256", {"batch": 256}),
                                                             ("batch 1", {"batch": 1})), ["batch=8:1:256"]),
        "llama1b": Model("llama1b", "Llama-3.2-1B shape (1.24B)", rows(("4 × 2048", {"batch": 4, "sequence": 2048})),
                         ["batch=8:1:8", "sequence=512:16:4096"], causal_lm=True),
        "handwritten": Model("handwritten", "hand-written-attention GPT, base (exporter.testing.handwritten_gpt, 92M)",
                             rows(("8 × 1024", {"batch": 8, "sequence": 1024})),
                             ["batch=8:1:64", "sequence=512:16:4096"], transformers=False,
                             factory="exporter.testing.handwritten_gpt:build",
                             declared=["input_ids:int64:batch,sequence:0:8192", "attention_mask:int64:batch,sequence"]),
    }, tiny)


def with_variants(catalogue: dict[str, Model], tiny: bool) -> dict[str, Model]:
    """``catalogue`` and the variants of its converts a deployment may choose: ``<model>-nomask`` declares only
    ``input_ids`` (a server that sends no padding: a decoder's artifacts carry SDPA's causal kernel, an
    encoder's no mask at all), and ``bert-b1`` builds a package for batch 1 × 128 only (static shapes, which
    Inductor specialises), timed at that row."""
    vocab = {"gpt2": 50257, "bert": 30522, "llama1b": 128256}
    variants = {}
    for name, size in vocab.items():
        base = catalogue[name]
        variants[f"{name}-nomask"] = replace(
            base, name=f"{name}-nomask", family=name, title=f"{base.title}, declared without attention_mask",
            declared=[f"input_ids:int64:batch,sequence:0:{256 if tiny else size}"],
            note="the convert declares input_ids only (`--input input_ids:int64:batch,sequence:0:VOCAB`)")
    bert = catalogue["bert"]
    sequence = 32 if tiny else 128
    variants["bert-b1"] = replace(
        bert, name="bert-b1", family="bert", title=f"{bert.title}, a package for batch 1 × {sequence} only",
        rows=[row for row in bert.rows if row.batch == 1],
        dims=["batch=1:1:1", f"sequence={sequence}:{sequence}:{sequence}"],
        note=f"the convert fixes the shape (`--dim batch=1:1:1 --dim sequence={sequence}:{sequence}:{sequence}`)")
    return {**catalogue, **variants}


# ----------------------------------------------------------------------------------------------- the model itself


def write_checkpoint(model: Model, folder: Path, tiny: bool, device: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    if model.transformers:
        cls, cfg = hf_model(model.builds, tiny)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                module = cls(cfg)
        finally:
            torch.set_default_dtype(previous)
        module.save_pretrained(folder)
    else:
        from safetensors.torch import save_model

        from exporter.testing import handwritten_gpt

        config = dict(handwritten_gpt.SIZES["tiny" if tiny else "base"])
        module = handwritten_gpt.build(config).to(torch.bfloat16)
        save_model(module, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config) + "\n", encoding="utf-8")
    params = sum(p.numel() for p in module.parameters())
    del module
    return {"parameters": params, "write_s": time.perf_counter() - t0}


def load_original(model: Model, folder: Path, device: str, attention: str = "eager") -> torch.nn.Module:
    """The model as a user has it: transformers' ``from_pretrained`` with ``attention`` (eager: the original
    attention code), or the hand-written model from its factory."""
    if model.transformers:
        cls, _ = hf_model(model.builds, False)
        module = cls.from_pretrained(folder, attn_implementation=attention, dtype=torch.bfloat16)
    else:
        from safetensors.torch import load_file

        from exporter.testing import handwritten_gpt

        module = handwritten_gpt.build(json.loads((folder / "config.json").read_text()))
        module.load_state_dict(load_file(str(folder / "model.safetensors")))
        module = module.to(torch.bfloat16)
    return module.to(device).eval()


def make_inputs(names: list[str], row: Row, vocab: int, image: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    batch, seq = row.batch, row.sizes.get("sequence", 0)
    made = {}
    for name in names:
        if name == "input_ids":
            made[name] = torch.randint(0, vocab, (batch, seq), generator=g)
        elif name in ("attention_mask",):
            made[name] = torch.ones(batch, seq, dtype=torch.long)
        elif name == "token_type_ids":
            made[name] = torch.zeros(batch, seq, dtype=torch.long)
        elif name == "pixel_values":
            made[name] = torch.randn(batch, 3, image, image, generator=g).to(torch.bfloat16)
        else:
            raise KeyError(f"no generator for input {name}")
    return {k: v.to(device) for k, v in made.items()}


def first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "to_tuple"):
        return next(v for v in (out.values() if isinstance(out, dict) else out.to_tuple())
                    if isinstance(v, torch.Tensor))
    return next(v for v in out if isinstance(v, torch.Tensor))


# ----------------------------------------------------------------------------------------------- the convert


def run_convert(model: Model, checkpoint: Path, out: Path, recipe: str, timeout_s: int,
                targets: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "exporter", "convert", str(checkpoint), "--recipe", recipe, "--out", str(out),
               "--overwrite", "-q", "--set", "numerics.grid=false"]
    for target in targets:
        command += ["-t", target]
    for dim in model.dims:
        command += ["--dim", dim]
    if model.factory:
        command += ["--model", model.factory]
    for declared in model.declared:
        command += ["--input", declared]
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # as a user runs it: exporter preloads what its own AOTI children need
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "scripts"), env.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, tail = done.returncode, (done.stderr or "").strip().splitlines()[-5:]
    except subprocess.TimeoutExpired:
        code, tail = None, [f"stopped at the suite's {timeout_s} s limit"]
    result: dict[str, Any] = {"command": " ".join(["exporter", *command[3:]]), "exit_code": code,
                              "wall_s": time.perf_counter() - t0, "stderr_tail": tail}
    report = out / "report.json"
    if report.is_file():
        data = json.loads(report.read_text())
        result["passed"] = data.get("passed")
        result["inputs"] = data["inputs"]["names"]
        result["outputs"] = data["outputs"]
        result["timings_s"] = data.get("timings_s")
        result["eager"] = {k: (data.get("baseline") or {}).get("bench", {}).get(k) for k in ("median_ms",)}
        result["artifacts"] = [{
            "name": a["name"], "status": a["status"], "error": a.get("error"), "path": a.get("path"),
            "numerics_passed": (a.get("numerics") or {}).get("passed"),
            "worst_ratio": (a.get("numerics") or {}).get("worst_ratio"),
            "build_s": a.get("build_s"), "load_s": a.get("load_s"),
            **{k: (a.get("bench") or {}).get(k) for k in ("median_ms", "p90_ms", "speedup_vs_eager", "utilisation")},
        } for a in data["artifacts"]]
    return result


# ----------------------------------------------------------------------------------------------- timing


class Variant:
    """One thing timed at one row: a callable over the row's inputs, prepared (compiled, captured) first."""

    def __init__(self, name: str, group: str, make: Callable[[], Callable[[], Any]], device: str,
                 build_s: float | None = None, note: str = ""):
        self.name, self.group, self.device, self.note = name, group, device, note
        self.error: str | None = None
        self.call: Callable[[], Any] | None = None
        self.build_s = build_s
        try:
            t0 = time.perf_counter()
            self.call = make()
            self.call()  # a compile compiles here, a CUDA graph is captured here
            sync(device)
            first = time.perf_counter() - t0
            self.build_s = first if build_s is None else build_s
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported with its reason
            self.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            self.call = None

    def bench(self, count: int) -> list[float]:
        assert self.call is not None
        return time_calls(self.call, count, self.device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def working_memory_mib(call: Callable[[], Any], device: str) -> float | None:
    """What one call allocates at its peak beyond what was allocated before it (torch's allocator)."""
    if not device.startswith("cuda"):
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    sync(device)
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def device_kernels(call: Callable[[], Any]) -> tuple[list[tuple[str, float]], list[dict[str, Any]]]:
    """(name, µs) of every GPU kernel one call ran (after one warm-up call), and the top five by time."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [(e.name, float(e.time_range.elapsed_us())) for e in prof.events()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    return kernels, top_by_time(prof.key_averages(), True)


def attention_ms(kernels: list[tuple[str, float]]) -> tuple[float, dict[str, int]]:
    """Milliseconds of the fused attention kernels among ``kernels``, and how many ran of each backend."""
    total, counts = 0.0, {}
    for name, us in kernels:
        backend = _device_backend(name)
        if backend is not None:
            total += us
            counts[backend] = counts.get(backend, 0) + 1
    return total / 1e3, counts


def kernel_ms(call: Callable[[], Any], repeat: int = 10) -> float:
    """Milliseconds of GPU kernels one call runs (profiled over ``repeat`` calls after a warm-up): the same
    measure as the attention kernels' time inside an artifact, free of each call's launch."""
    kernels, _ = device_kernels(lambda: [call() for _ in range(repeat)])
    return sum(us for _, us in kernels) / 1e3 / repeat


def sdpa_alone(calls: dict, device: str) -> dict[str, Any]:
    """The recorded SDPA calls, each run alone under every fused backend that accepts it; best per call. Both
    the kernels' time (profiler: what the artifact's attention is compared with) and each call's wall time
    (CUDA events, launch included) are kept."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    per_backend: dict[str, float] = {b: 0.0 for b in backends}
    per_backend_kernels: dict[str, float] = {b: 0.0 for b in backends}
    best_total, best_kernels, shapes = 0.0, 0.0, []
    for entry in calls.values():
        args, count = entry["args"], entry["count"]
        kwargs = {k: args[k] for k in ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa") if k in args}
        times, kernel_times = {}, {}

        def fn(args=args, kwargs=kwargs):
            return torch.nn.functional.scaled_dot_product_attention(args["query"], args["key"], args["value"], **kwargs)

        for label, backend in backends.items():
            try:
                with sdpa_kernel([backend]):
                    times[label] = statistics.median(time_calls(fn, 30, device))
                    kernel_times[label] = kernel_ms(fn)
            except Exception:  # noqa: BLE001 - a backend that refuses this call is not a candidate
                per_backend[label] = per_backend_kernels[label] = float("nan")
        for label, ms in times.items():
            per_backend[label] += ms * count
            per_backend_kernels[label] += kernel_times[label] * count
        best_total += (min(times.values()) if times else float("nan")) * count
        best_kernels += (min(kernel_times.values()) if kernel_times else float("nan")) * count
        q = args["query"]
        shapes.append({"query": list(q.shape), "key": list(args["key"].shape), "count": count,
                       "mask": None if args.get("attn_mask") is None else list(args["attn_mask"].shape),
                       "is_causal": bool(args.get("is_causal")), "ms": times, "kernel_ms": kernel_times,
                       "best": min(kernel_times, key=kernel_times.get) if kernel_times else None})
    return {"best_ms": best_total, "per_backend_ms": per_backend, "best_kernel_ms": best_kernels,
            "per_backend_kernel_ms": per_backend_kernels, "calls": shapes}


def record_sdpa(module: torch.nn.Module, args: list[torch.Tensor]) -> dict:
    from exporter.measure.backend_choice import _SdpaCalls

    with torch.inference_mode(), _SdpaCalls() as recorder:
        module(*args)
    return recorder.calls


def count_flops(module: torch.nn.Module, kwargs: dict[str, torch.Tensor]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        module(**kwargs)
    return int(counter.get_total_flops())


@dataclass
class Loaded:
    originals: dict[str, torch.nn.Module]  # "eager" (original attention), "sdpa" (transformers models)
    compiled: dict[tuple[str, str], Any]  # (original, mode) -> torch.compile of it
    program: Any  # the exported program's module, or None
    aoti: Any  # the AOTInductor package loaded (aoti_loader.load_package), or None
    package: str | None  # its path
    artifacts: dict[str, dict[str, Any]]  # the convert's report, by artifact name
    experiments: dict[str, tuple[Any, float]] = field(default_factory=dict)  # name -> (package, build s)


def attention_experiments(program_path: Path, work: Path, device: str, backends: list[str]):
    """The convert's exported program compiled again to an AOTInductor package with each of ``backends`` first
    in SDPA's priority (``runtime.attention_backend``): which backend the package should bake in. Timed beside
    the convert's own package, outside the verdicts (group ``experiment``)."""
    import torch._inductor.config as inductor_config

    from exporter.attention_backend import backend_context
    from exporter.targets.aoti_loader import load_package

    built: dict[str, tuple[Any, float]] = {}
    errors: dict[str, str] = {}
    for backend in backends:
        t0 = time.perf_counter()
        try:
            program = torch.export.load(str(program_path))
            with backend_context(backend, device), inductor_config.patch({"cpp.vec_isa_ok": False}):
                path = torch._inductor.aoti_compile_and_package(program, package_path=str(work / f"aoti-{backend}.pt2"))
            built[f"exporter aoti, {backend} first"] = (load_package(path), time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - an experiment that cannot build is reported, not fatal
            errors[backend] = f"{type(exc).__name__}: {exc}"[:300]
    return built, errors


def row_variants(loaded: Loaded, row: Row, kwargs: dict[str, torch.Tensor], extra: dict[str, Any],
                 args: list[torch.Tensor], device: str, small: str) -> list[Variant]:
    """Every variant of one row, prepared (compiled, captured) at its inputs; at batch 1 only ``small`` (an
    original's label) is compiled by hand, in every mode."""
    from exporter.targets.aoti_loader import CudaGraphed

    def hf(module):
        return lambda: first_tensor(module(**kwargs, **extra))

    variants = [Variant("eager", "baseline", lambda: hf(loaded.originals["eager"]), device, 0.0,
                        "original attention")]
    if "sdpa" in loaded.originals:
        variants.append(Variant("sdpa eager", "by hand", lambda: hf(loaded.originals["sdpa"]), device, 0.0,
                                'attn_implementation="sdpa"'))
    for (label, mode), fn in loaded.compiled.items():
        wanted = label == small if row.batch == 1 else mode != "reduce-overhead"
        if not wanted:
            continue
        title = f"{'sdpa + ' if label == 'sdpa' else ''}compile {mode}"
        variants.append(Variant(title, "by hand", (lambda f=fn: hf(f)), device, note="torch.compile(model, mode=...)"))
    if loaded.program is not None:
        variants.append(Variant("exporter exported_program", "exporter", lambda: lambda: loaded.program(*args),
                                device, loaded.artifacts["exported_program"]["build_s"]))
    if loaded.aoti is not None:
        variants.append(Variant("exporter aoti", "exporter", lambda: lambda: loaded.aoti(*args), device,
                                loaded.artifacts["aoti"]["build_s"]))
        if device.startswith("cuda"):
            def graphed():
                g = CudaGraphed(loaded.package, args)
                return lambda: g(*args)
            variants.append(Variant("exporter aoti + CUDA graph", "exporter", graphed, device,
                                    note="aoti_loader.CudaGraphed"))
    for name, (package, build_s) in loaded.experiments.items():
        variants.append(Variant(name, "experiment", lambda p=package: lambda: p(*args), device, build_s,
                                note="the exported program compiled again with this SDPA backend first"))
    return variants


def time_model(model: Model, checkpoint: Path, convert_dir: Path, convert: dict[str, Any], device: str,
               hand_modes: list[str], tiny: bool, settings: dict[str, int], hand_originals: list[str],
               experiment_backends: list[str], on_row: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Every row of ``model``: the variants timed interleaved, their figures, and the attention comparison."""
    from exporter.modelio import by_name
    from exporter.prepare import ModelSource, from_source, place
    from exporter.targets.aoti_loader import load_package

    cuda = device.startswith("cuda")
    names = convert.get("inputs") or (["pixel_values"] if model.builds == "vit" else ["input_ids", "attention_mask"])
    artifacts = {a["name"]: a for a in convert.get("artifacts", [])}
    originals: dict[str, torch.nn.Module] = {"eager": load_original(model, checkpoint, device, "eager")}
    if model.transformers:
        originals["sdpa"] = load_original(model, checkpoint, device, "sdpa")
    config = getattr(originals["eager"], "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 8192 if not tiny else 256)
    image = int(getattr(config, "image_size", 224) or 224)
    program = exported = package = None
    if artifacts.get("exported_program", {}).get("status") == "ok":
        program = by_name(torch.export.load(str(convert_dir / artifacts["exported_program"]["path"])).module())
    if artifacts.get("aoti", {}).get("status") == "ok":
        package = str(convert_dir / artifacts["aoti"]["path"])
        exported = load_package(package)
    source = ModelSource(str(checkpoint), model.factory, False, tuple(names), tuple(convert.get("outputs") or ()),
                         str(convert_dir / "reference" / "inputs.safetensors"))
    rewritten, rewrite_error = None, None
    try:  # the rewritten model, as the convert built it: its SDPA calls are the ones inside the artifacts
        prepared = from_source(source)
        rewritten = place(prepared.rewritten, device, "bfloat16")
    except Exception as exc:  # noqa: BLE001 - the timings stand without the attention comparison
        rewrite_error = f"{type(exc).__name__}: {exc}"[:300]
    compiled = {}
    for label, module in originals.items():
        if hand_originals and label not in hand_originals:
            continue
        for mode in hand_modes:
            compiled[(label, mode)] = torch.compile(module, mode=mode, dynamic=False)
    # at batch 1 only the model a user would compile there: transformers' SDPA attention (else the model itself)
    small = "sdpa" if "sdpa" in originals else "eager"
    rows_out = []
    experiments, experiment_errors = {}, {}
    if device.startswith("cuda") and program is not None and experiment_backends:
        print(f"   attention experiments: {', '.join(experiment_backends)}", flush=True)
        experiments, experiment_errors = attention_experiments(
            convert_dir / artifacts["exported_program"]["path"], convert_dir.parent, device, experiment_backends)
    loaded = Loaded(originals, compiled, program, exported, package, artifacts, experiments)
    for row in model.rows:
        kwargs = make_inputs(names, row, vocab, image, device)
        args = [kwargs[n] for n in names]
        extra = {"use_cache": False} if model.causal_lm else {}
        with torch.inference_mode():
            print(f"   {row.label}: preparing variants ({time.strftime('%H:%M:%S')})", flush=True)
            variants = row_variants(loaded, row, kwargs, extra, args, device, small)
            print(f"   {row.label}: timing ({time.strftime('%H:%M:%S')})", flush=True)
            ready = [v for v in variants if v.call is not None]
            errors: dict[str, str] = {}

            def failed(variant, exc, errors=errors):
                errors[variant.name] = f"{type(exc).__name__}: {exc}"[:300]

            times = interleaved(ready, settings["warmup"], settings["rounds"], settings["iterations"], failed)
            flops = 0
            with contextlib.suppress(Exception):
                flops = count_flops(originals["eager"], {**kwargs, **extra})
            agreement = agreements(variants)
            entries = []
            for v in variants:
                entry: dict[str, Any] = {"name": v.name, "group": v.group, "note": v.note, "build_s": v.build_s,
                                         "error": v.error or errors.get(v.name), "rel_error": agreement.get(v.name)}
                if v.name in times and not entry["error"]:
                    entry.update(summarize(times[v.name], row.batch, flops, PEAK_TFLOPS))
                    assert v.call is not None
                    entry["working_mib"] = working_memory_mib(v.call, device)
                entries.append(entry)
            attention = attention_section(variants, rewritten, args, device) if cuda else \
                {"note": "measured on CUDA only"}
            if rewrite_error:
                attention["rewritten_error"] = rewrite_error
            if experiment_errors:
                attention["experiment_errors"] = experiment_errors
        rows_out.append({"row": row.label, "sizes": row.sizes, "flops": flops, "variants": entries,
                         "attention": attention})
        on_row(rows_out)
        del variants
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return rows_out


def agreements(variants: list[Variant]) -> dict[str, float]:
    """Each variant's first output against eager's at the row's inputs: relative L2 error (a sanity check at a
    shape the convert's gate may not have run; the gate's float64 judgement is in the convert's report)."""
    ready = [v for v in variants if v.call is not None]
    base = next((v for v in ready if v.name == "eager"), None)
    if base is None:
        return {}
    with torch.inference_mode():
        reference = first_tensor(base.call()).float().clone()
        out = {}
        for v in ready:
            with contextlib.suppress(Exception):
                value = first_tensor(v.call()).float()
                out[v.name] = float((value - reference).norm() / reference.norm().clamp_min(1e-30))
    return out


def attention_section(variants: list[Variant], rewritten, args, device: str) -> dict[str, Any]:
    """SDPA kernels inside the AOTI package against the same calls alone; whether the hand compile fused."""
    out: dict[str, Any] = {}
    by_name = {v.name: v for v in variants if v.call is not None}
    try:
        if "exporter aoti" in by_name:
            kernels, top = device_kernels(by_name["exporter aoti"].call)
            inside, counts = attention_ms(kernels)
            out["artifact"] = {"attention_ms": inside, "backends": counts,
                               "kernels_ms": sum(t for _, t in kernels) / 1e3,
                               "top": top}
        for v in variants:
            if v.group == "experiment" and v.call is not None:
                kernels, _ = device_kernels(v.call)
                inside, counts = attention_ms(kernels)
                out.setdefault("experiments", {})[v.name] = {"attention_ms": inside, "backends": counts,
                                                             "kernels_ms": sum(t for _, t in kernels) / 1e3}
        if rewritten is not None:
            alone = sdpa_alone(record_sdpa(rewritten, args), device)
            out["alone"] = alone
            if out.get("artifact", {}).get("attention_ms"):
                out["fraction_of_best"] = alone["best_kernel_ms"] / out["artifact"]["attention_ms"]
        hand = by_name.get("compile max-autotune")
        if hand is not None:
            kernels, top = device_kernels(hand.call)
            inside, counts = attention_ms(kernels)
            softmax = sum(1 for name, _ in kernels if "softmax" in name.lower())
            out["hand_compile"] = {"attention_ms": inside, "fused_kernels": counts, "softmax_kernels": softmax,
                                   "fused_attention": bool(counts), "top": top}
    except Exception as exc:  # noqa: BLE001 - the timings stand without the attention breakdown
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


# ----------------------------------------------------------------------------------------------- verdicts


def set_aside(result: dict[str, Any]) -> tuple[str, ...]:
    """Variants a note added to the run's JSON after it ran says are not what they claim to be (kept in the
    table, marked, left out of the verdicts): ``{"annotations": {"set_aside": [...], "why": "..."}}``."""
    return tuple((result.get("annotations") or {}).get("set_aside", ()))


def best(entries: list[dict[str, Any]], group: str, exclude: tuple[str, ...] = ()) -> dict[str, Any] | None:
    timed = [e for e in entries if e["group"] == group and e.get("median_ms") and e["name"] not in exclude]
    return min(timed, key=lambda e: e["median_ms"]) if timed else None


def verdicts(model: dict[str, Any], row: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the issue for one row: met (True/False, None when not measured) and the figures."""
    entries = row["variants"]
    eager = next((e for e in entries if e["name"] == "eager" and e.get("median_ms")), None)
    aside = set_aside(model)
    ours = best(entries, "exporter")
    hand = best(entries, "by hand", exclude=aside)
    out = []

    def add(target: str, met: bool | None, measured: str) -> None:
        out.append({"target": target, "met": met, "measured": measured})

    compiles_aside = [e["name"] for e in entries if e["group"] == "by hand" and e["name"] in aside]
    if ours and compiles_aside:
        add("best artifact ≥ the best done by hand", None,
            f"not judged from this run: {', '.join(compiles_aside)} set aside (†)")
    elif ours and hand:
        attention = row.get("attention", {}).get("hand_compile", {})
        unfused = model.get("handwritten_attention") and attention and not attention.get("fused_attention")
        bar = TARGETS["vs_hand_unfused"] if unfused else TARGETS["vs_hand"]
        ratio = hand["median_ms"] / ours["median_ms"]
        add(f"best artifact ≥ {bar:g}× the best done by hand" + (" (its compile did not fuse the attention)"
                                                                 if unfused else ""),
            ratio >= bar, f"{ours['name']} {ours['median_ms']:.3g} ms vs {hand['name']} {hand['median_ms']:.3g} ms: "
                          f"{ratio:.2f}×")
    if ours and row["sizes"]["batch"] > 1 and ours.get("utilisation") is not None and model["environment"].get("gpu"):
        add(f"large batch ≥ {TARGETS['peak']:.0%} of the bf16 peak", ours["utilisation"] >= TARGETS["peak"],
            f"{ours['name']}: {ours['tflops']:.0f} TFLOP/s, {ours['utilisation']:.0%}")
    if ours and eager and row["sizes"]["batch"] == 1:
        speed = eager["median_ms"] / ours["median_ms"]
        add(f"batch 1 ≥ {TARGETS['batch1_vs_eager']:g}× eager", speed >= TARGETS["batch1_vs_eager"],
            f"{ours['name']} {speed:.1f}× eager")
        ro = next((e for e in entries if "reduce-overhead" in e["name"] and e.get("median_ms")
                   and e["name"] not in aside), None)
        if ro:
            ratio = ro["median_ms"] / ours["median_ms"]
            add("batch 1: best artifact ≥ 1.0× reduce-overhead", ratio >= TARGETS["batch1_vs_ro"],
                f"{ours['median_ms']:.3g} ms vs {ro['median_ms']:.3g} ms: {ratio:.2f}×")
    attention = row.get("attention", {})
    fraction = attention.get("fraction_of_best")
    if fraction is not None:
        target = f"attention in the artifact ≥ {TARGETS['attention']:.0%} of the best SDPA backend alone"
        inside = attention["artifact"]["attention_ms"]
        alone = attention["alone"].get("best_kernel_ms", attention["alone"]["best_ms"])
        calls = sum(attention["artifact"]["backends"].values()) or 1
        expected = sum(c.get("count", 1) for c in attention["alone"].get("calls", []))
        kernels_alone = "best_kernel_ms" in attention["alone"]  # older runs timed the lone call with CUDA events
        if calls < expected:  # some attention ran decomposed (matmul, softmax, matmul), outside any fused kernel
            add(target, False, f"{calls if attention['artifact']['backends'] else 0} fused attention kernels for "
                               f"{expected} SDPA calls: the rest ran decomposed")
        elif not kernels_alone and inside / calls < LAUNCH_BOUND_MS:  # the lone call's timing was its launch
            add(target, None, f"not compared: {inside / calls * 1e3:.0f} µs a kernel inside the artifact, where "
                              "timing one call alone (CUDA events around it) measures its launch")
        else:
            add(target, fraction >= TARGETS["attention"],
                f"{inside:.3g} ms inside vs {alone:.3g} ms alone: {fraction:.0%}")
    return out


# ----------------------------------------------------------------------------------------------- the whole run


def environment() -> dict[str, Any]:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d"), "kernel": platform.release(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    env["commit"] = (commit.stdout.strip() + (" + uncommitted changes" if dirty else "")) or None
    return env


def run(names: list[str], out: Path, work: Path, tiny: bool, device: str, hand_modes: list[str],
        timeout_s: int, settings: dict[str, int], targets: list[str], hand_originals: list[str],
        experiment_backends: list[str]) -> None:
    recipe = "h100-bf16" if device.startswith("cuda") else "cpu-fp32"
    catalogue = models(tiny)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        model = catalogue[name]
        t0 = time.perf_counter()
        result: dict[str, Any] = {"model": name, "title": model.title, "environment": environment(),
                                  "recipe": recipe, "hand_modes": hand_modes, "settings": settings,
                                  "convert_targets": targets or "all the recipe's",
                                  "hand_originals": hand_originals or "all", "note": model.note,
                                  "handwritten_attention": not model.transformers,
                                  "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
        checkpoint, convert_dir = work / name / "checkpoint", work / name / "converted"
        print(f"== {name}: checkpoint", flush=True)
        result["checkpoint"] = write_checkpoint(model, checkpoint, tiny, device)
        print(f"== {name}: exporter convert --recipe {recipe}", flush=True)
        result["convert"] = run_convert(model, checkpoint, convert_dir, recipe, timeout_s, targets)
        print(f"   exit {result['convert']['exit_code']} in {result['convert']['wall_s']:.0f} s", flush=True)
        path = out / f"{name}.json"

        def save(rows: list[dict[str, Any]], result=result, path=path) -> None:
            result["rows"] = rows
            for row in rows:
                row["verdicts"] = verdicts(result, row)
            path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")

        save([])
        try:
            result["rows"] = time_model(model, checkpoint, convert_dir, result["convert"], device, hand_modes, tiny,
                                        settings, hand_originals, experiment_backends, save)
        except Exception as exc:  # noqa: BLE001 - what was measured is still written
            result["error"] = f"{type(exc).__name__}: {exc}"[:500]
            result["rows"] = []
        for row in result["rows"]:
            row["verdicts"] = verdicts(result, row)
        result["wall_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
        print(summary(result), flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- the document


def fmt(value: Any, spec: str = ".3g", none: str = "—") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return none
    return format(value, spec)


def gib(mib: float | None) -> float | None:
    return None if mib is None else mib / 1024


def row_table(row: dict[str, Any], aside: tuple[str, ...] = ()) -> list[str]:
    entries = row["variants"]
    eager = next((e for e in entries if e["name"] == "eager" and e.get("median_ms")), None)
    hand = best(entries, "by hand", exclude=aside)
    lines = ["| variant | median ms | p90 ms | throughput /s | vs eager | vs best by hand | TFLOP/s | "
             "of peak | working GiB | build s | rel. error vs eager |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in entries:
        if not e.get("median_ms"):
            lines.append(f"| {e['name']} | failed: {e.get('error') or 'not timed'} | | | | | | | | | |")
            continue
        vs_eager = eager["median_ms"] / e["median_ms"] if eager else None
        vs_hand = hand["median_ms"] / e["median_ms"] if hand else None
        mark = " †" if e["name"] in aside else ""
        lines.append(f"| {e['name']}{mark} | {e['median_ms']:.3f} | {e['p90_ms']:.3f} | "
                     f"{fmt(e.get('throughput_per_s'), '.0f')} "
                     f"| {fmt(vs_eager, '.2f')}× | {fmt(vs_hand, '.2f')}× | {fmt(e.get('tflops'), '.0f')} | "
                     f"{fmt(e.get('utilisation'), '.0%')} | {fmt(gib(e.get('working_mib')), '.2f')} | "
                     f"{fmt(e.get('build_s'), '.1f')} | {fmt(e.get('rel_error'), '.1e')} |")
    return lines


def attention_lines(row: dict[str, Any]) -> list[str]:
    a = row.get("attention") or {}
    lines = []
    if a.get("artifact"):
        art = a["artifact"]
        alone = a.get("alone") or {}
        kernels = "best_kernel_ms" in alone  # older runs timed the lone calls with CUDA events only
        per = ", ".join(f"{k} {fmt(v, '.3f')} ms" for k, v in
                        (alone.get("per_backend_kernel_ms" if kernels else "per_backend_ms") or {}).items())
        best_alone = alone.get("best_kernel_ms" if kernels else "best_ms")
        lines.append(f"- Attention: the AOTI package's SDPA kernels {art['attention_ms']:.3f} ms per forward pass "
                     f"({', '.join(f'{k} ×{n}' for k, n in art['backends'].items()) or 'no fused kernel'}) of "
                     f"{art['kernels_ms']:.2f} ms of kernels; the same calls alone "
                     f"({'their kernels' if kernels else 'each call timed with CUDA events'}): {per} "
                     f"(best {fmt(best_alone, '.3f')} ms) = {fmt(a.get('fraction_of_best'), '.0%')} of the best.")
        top = ", ".join(f"{t['name'][:60]} {t['share']:.0%}" for t in art.get("top", [])[:5])
        lines.append(f"- Top kernels of the AOTI package: {top}")
    for name, e in (a.get("experiments") or {}).items():
        lines.append(f"- {name}: SDPA kernels {e['attention_ms']:.3f} ms per forward pass "
                     f"({', '.join(f'{k} ×{n}' for k, n in e['backends'].items()) or 'no fused kernel'}) of "
                     f"{e['kernels_ms']:.2f} ms of kernels.")
    for backend, error in (a.get("experiment_errors") or {}).items():
        lines.append(f"- The package with {backend} first could not be built: {error}")
    if a.get("hand_compile"):
        h = a["hand_compile"]
        lines.append(f"- `torch.compile(max-autotune)` of the model as written: fused attention kernels "
                     f"{h['fused_kernels'] or 'none'}, softmax kernels {h['softmax_kernels']}"
                     f" — {'it fused' if h['fused_attention'] else 'it did not fuse'} the attention by itself.")
    if a.get("error"):
        lines.append(f"- Attention breakdown failed: {a['error']}")
    return lines


def summary(result: dict[str, Any]) -> str:
    lines = [f"## {result['title']}" + (f" — {result['label']}" if result.get("label") else "")]
    aside = set_aside(result)
    if aside:
        lines.append(f"\n† set aside from the verdicts: {result['annotations']['why']}")
    if not result["rows"]:
        lines.append("\nNo row was timed side by side in this run (see the notes below); the convert's own "
                     "figures follow.")
    for row in result["rows"]:
        lines += ["", f"### {row['row']}", "", *row_table(row, aside), "", *attention_lines(row)]
        lines += [f"- {'✅' if v['met'] else '❌' if v['met'] is False else '—'} {v['target']}: {v['measured']}"
                  for v in row.get("verdicts", [])]
    if result.get("error"):
        lines.append(f"\nTiming stopped: {result['error']}")
    return "\n".join(lines)


def write_doc(paths: list[Path], doc: Path) -> None:
    results = [json.loads(p.read_text()) for p in paths]
    for result in results:  # the verdicts as this version of the suite judges the stored figures
        for row in result["rows"]:
            row["verdicts"] = verdicts(result, row)
    env = results[0]["environment"]
    lines = ["# GPU benchmarks: exporter's artifacts against eager and against torch.compile by hand", "",
             "<!-- generated by `python benchmarks/gpu_suite.py --write-doc docs/BENCHMARKS.md RUN/*.json` from the",
             "     suite's JSON (docs/runs/suite-*.json); do not edit -->", "",
             f"Run by `bash benchmarks/gpu_suite.sh MODELS` on {env.get('gpu', 'no GPU')} (kernel {env['kernel']}, "
             f"{env['cpus']} CPUs), torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}, "
             f"dates and commits under each model; peak = {PEAK_TFLOPS:g} TFLOP/s (measured bf16 matmul). "
             "Random weights, bf16. Each model is converted with `exporter convert --recipe h100-bf16` (the command "
             "is under each model), then every variant is timed interleaved in one process (CUDA "
             "events; warm-up, then rounds of bursts in rotating order). `working GiB`: what one call allocates "
             "beyond what was resident. Build: a compile's first call, an artifact's build inside the convert, a "
             "CUDA graph's capture.", "", "## Targets", "", "| model | row | target | met | measured |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        for row in r["rows"]:
            for v in row.get("verdicts", []):
                mark = "✅" if v["met"] else "❌" if v["met"] is False else "—"
                model = r["model"] + (f" ({r['label']})" if r.get("label") else "")
                lines.append(f"| {model} | {row['row']} | {v['target']} | {mark} | {v['measured']} |")
    for r in results:
        c = r["convert"]
        ended = f"exit {c['exit_code']}" if c["exit_code"] is not None else "; ".join(c.get("stderr_tail") or [])
        env = r["environment"]
        lines += ["", summary(r), "", f"Run on {env['date']} from commit {env.get('commit')}. "
                  f"The convert (`{c['command']}`): {ended} after {c['wall_s']:.0f} s; "
                  f"hand-tuned modes {', '.join(r['hand_modes'])}; Inductor cache "
                  f"{r.get('inductor_cache') or 'default'}."
                  + (f" Convert variant: {r['note']}." if r.get("note") else ""),
                  "", "| artifact | status | gate | build s | load s | median ms (convert's own timing) | vs eager |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        if not c.get("artifacts"):
            lines = lines[:-3]  # no report: no table
        for a in c.get("artifacts", []):
            gate = "pass" if a.get("numerics_passed") else "—" if a.get("numerics_passed") is None else "FAIL"
            status = a["status"] if a["status"] == "ok" else f"{a['status']}: {(a.get('error') or '')[:90]}"
            lines.append(f"| {a['name']} | {status} | {gate} | {fmt(a.get('build_s'), '.1f')} | "
                         f"{fmt(a.get('load_s'), '.1f')} | {fmt(a.get('median_ms'), '.3f')} | "
                         f"{fmt(a.get('speedup_vs_eager'), '.2f')} |")
    notes = ROOT / "docs" / "gpu-suite-notes.md"
    if notes.is_file():
        lines += ["", notes.read_text().strip()]
    doc.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=Path("suite-out"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/exporter-suite"))
    parser.add_argument("--tiny", action="store_true", help="tiny models (a smoke run)")
    parser.add_argument("--hand-modes", default="",
                        help="torch.compile modes by hand (default: max-autotune,reduce-overhead on CUDA, "
                        "default on CPU)")
    parser.add_argument("--targets", default="",
                        help="the convert's targets (default: every artifact target of the recipe, not compile)")
    parser.add_argument("--hand-originals", default="",
                        help="compile by hand only these of eager,sdpa (default: both; a smaller run)")
    parser.add_argument("--experiments", default="flash",
                        help="SDPA backends to build an extra AOTI package with, first in priority (CUDA only; "
                        "'' for none)")
    parser.add_argument("--timeout", type=int, default=400, help="limit of each convert, seconds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--write-doc", type=Path, help="write this Markdown file from the JSON files given")
    args = parser.parse_args()
    if args.write_doc:
        write_doc([Path(m) for m in args.models], args.write_doc)
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from exporter.targets.toolchain import aoti_preload

    preload = aoti_preload()
    if preload and preload not in os.environ.get("LD_PRELOAD", ""):  # AOTI packages load with it (docs/gpu.md)
        env = {**os.environ, "LD_PRELOAD": os.pathsep.join(p for p in (preload, os.environ.get("LD_PRELOAD")) if p)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    unknown = [m for m in args.models if m not in models(args.tiny)]
    if unknown or not args.models:
        parser.error(f"name models from {', '.join(models(args.tiny))}")
    default_modes = "max-autotune,reduce-overhead" if device == "cuda" else "default"
    # every artifact target of the recipe; not its compile variants, which the hand-tuned compiles stand for
    targets = args.targets or ("exported_program,aoti,onnx,tensorrt" if device == "cuda" else
                               "exported_program,aoti,onnx")
    modes = [m for m in (args.hand_modes or default_modes).split(",") if m]
    run(args.models, args.out, args.work, args.tiny, device, modes, args.timeout,
        {"warmup": args.warmup, "rounds": args.rounds, "iterations": args.iterations},
        [t for t in targets.split(",") if t], [h for h in args.hand_originals.split(",") if h],
        [b for b in args.experiments.split(",") if b])
    return 0


if __name__ == "__main__":
    sys.exit(main())
