"""The catalogue of bad inputs and faults: each case builds its own broken input and says what must happen.

Used by tests/test_errors.py (every case is a test) and by scripts/error_catalogue.py, which runs every
case through the real command line and writes docs/errors.md from what actually came out.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .cli import run_cli

QUICK_RECIPE = """schema_version = 1
description = "one cheap target, a short benchmark"
[targets]
build = ["exported_program"]
[bench]
warmup = 0
rounds = 1
iterations = 1
"""


@dataclass
class Assets:
    """Inputs shared by the cases: a tiny GPT-2 checkpoint folder and a user factory module."""

    root: Path
    gpt2: Path
    factory_dir: Path
    factory_module: str

    @property
    def weights(self) -> Path:
        return self.gpt2 / "model.safetensors"


@dataclass
class Case:
    name: str
    category: str
    argv: list[str]
    code: int
    fragment: str  # must appear in the one error line
    env: dict[str, str] = field(default_factory=dict)
    out: Path | None = None  # the output folder that must not exist afterwards (None: only artifacts/)
    output_allowed: bool = False  # the run succeeds (e.g. a warning case)
    cleanup: Callable[[], None] | None = None


CASES: list[tuple[str, str, Callable[[Path, Assets], Case]]] = []


def case(category: str, name: str):
    def register(build):
        CASES.append((category, name, build))
        return build
    return register


def make_assets(root: Path) -> Assets:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0))
    gpt2 = root / "gpt2"
    model.save_pretrained(gpt2)
    factory_dir = root / "factories"
    factory_dir.mkdir()
    module = "catalogue_factories"
    (factory_dir / f"{module}.py").write_text(
        "import torch.nn as nn\n"
        "def good(config=None):\n    return nn.Linear(4, 4)\n"
        "def raises(config=None):\n    raise ValueError('hidden size must be even')\n"
        "def not_a_module(config=None):\n    return {'weight': 1}\n")
    from safetensors.torch import save_model

    save_model(torch.nn.Linear(4, 4), str(factory_dir / "linear.safetensors"))
    return Assets(root, gpt2, factory_dir, module)


def run(case_: Case, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_cli(case_.argv, cwd, {**os.environ, **case_.env}, timeout)


def error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    return lines[-1] if lines else ""


# --------------------------------------------------------------------------- safetensors surgery


def read_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_parts(path: Path, header: dict | bytes, data: bytes, header_len: int | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if header_len is None else header_len) + body + data)
    return path


def damaged(assets: Assets, tmp: Path, mutate: Callable[[dict, bytes], tuple]) -> Path:
    """A copy of the tiny GPT-2 folder whose model.safetensors was rewritten by ``mutate``."""
    folder = tmp / "damaged"
    shutil.copytree(assets.gpt2, folder)
    header, data = read_parts(folder / "model.safetensors")
    result = mutate(header, data)
    write_parts(folder / "model.safetensors", *result)
    return folder


def _tensor_names(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def convert(path: Path, tmp: Path, *extra: str) -> list[str]:
    recipe = tmp / "quick.toml"
    recipe.write_text(QUICK_RECIPE)
    return ["convert", str(path), "--recipe", str(recipe), "--out", str(tmp / "out"), *extra]


# --------------------------------------------------------------------------- checkpoint


@case("checkpoint", "missing file")
def _(tmp, a):
    return Case("missing file", "checkpoint", convert(tmp / "nope.safetensors", tmp), 2, "does not exist")


@case("checkpoint", "folder without weights")
def _(tmp, a):
    folder = tmp / "empty"
    folder.mkdir()
    (folder / "config.json").write_text((a.gpt2 / "config.json").read_text())
    return Case("folder without weights", "checkpoint", convert(folder, tmp), 2, "holds no weights")


@case("checkpoint", "truncated file")
def _(tmp, a):
    folder = damaged(a, tmp, lambda h, d: (h, d[:-1000]))
    return Case("truncated file", "checkpoint", convert(folder, tmp), 2, "outside the")


@case("checkpoint", "header length larger than the file")
def _(tmp, a):
    folder = damaged(a, tmp, lambda h, d: (json.dumps(h).encode(), d, 10**7))
    return Case("header length larger than the file", "checkpoint", convert(folder, tmp), 2,
                "is larger than the file")


@case("checkpoint", "header JSON invalid")
def _(tmp, a):
    folder = damaged(a, tmp, lambda h, d: (b"{not json" + b" " * (len(json.dumps(h)) - 9), d))
    return Case("header JSON invalid", "checkpoint", convert(folder, tmp), 2, "header is not valid JSON")


@case("checkpoint", "header absurdly large")
def _(tmp, a):
    folder = damaged(a, tmp, lambda h, d: (json.dumps(h).encode(), d, 2**40))
    return Case("header absurdly large", "checkpoint", convert(folder, tmp), 2, "exceeds the format's limit")


@case("checkpoint", "tensor offsets out of range")
def _(tmp, a):
    def mutate(h, d):
        last = _tensor_names(h)[-1]
        begin, end = h[last]["data_offsets"]
        h[last]["data_offsets"] = [begin + 10**6, end + 10**6]
        return h, d
    return Case("tensor offsets out of range", "checkpoint", convert(damaged(a, tmp, mutate), tmp), 2,
                "outside the")


@case("checkpoint", "tensor offsets overlapping")
def _(tmp, a):
    def mutate(h, d):
        first, second = _tensor_names(h)[:2]
        size = h[second]["data_offsets"][1] - h[second]["data_offsets"][0]
        start = h[first]["data_offsets"][0]
        h[second]["data_offsets"] = [start, start + size]
        return h, d
    return Case("tensor offsets overlapping", "checkpoint", convert(damaged(a, tmp, mutate), tmp), 2, "overlaps")


@case("checkpoint", "unknown dtype")
def _(tmp, a):
    def mutate(h, d):
        h[_tensor_names(h)[0]]["dtype"] = "F128"
        return h, d
    return Case("unknown dtype", "checkpoint", convert(damaged(a, tmp, mutate), tmp), 2, "unknown dtype 'F128'")


def _with_nan(a: Assets, tmp: Path) -> Path:
    from safetensors.torch import load_file, save_file

    folder = tmp / "nan"
    shutil.copytree(a.gpt2, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@case("checkpoint", "NaN weights with nonfinite_weights = \"error\"")
def _(tmp, a):
    argv = convert(_with_nan(a, tmp), tmp)
    (tmp / "quick.toml").write_text(QUICK_RECIPE + '[model]\nnonfinite_weights = "error"\n')
    return Case("NaN weights, recipe says error", "checkpoint", argv, 2, "holds NaN or Inf")


def _rewritten_weights(a: Assets, tmp: Path, edit: Callable[[dict], None]) -> Path:
    from safetensors.torch import load_file, save_file

    folder = tmp / "keys"
    shutil.copytree(a.gpt2, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@case("checkpoint", "missing keys")
def _(tmp, a):
    folder = _rewritten_weights(a, tmp, lambda t: t.pop("transformer.ln_f.weight"))
    return Case("missing keys", "checkpoint", convert(folder, tmp), 2, "missing: transformer.ln_f.weight")


@case("checkpoint", "unexpected keys")
def _(tmp, a):
    folder = _rewritten_weights(a, tmp, lambda t: t.update({"transformer.extra.weight": torch.zeros(2)}))
    return Case("unexpected keys", "checkpoint", convert(folder, tmp), 2, "unexpected: transformer.extra.weight")


@case("checkpoint", "mis-shaped keys")
def _(tmp, a):
    folder = _rewritten_weights(a, tmp, lambda t: t.update({"transformer.wpe.weight": torch.zeros(3, 3)}))
    return Case("mis-shaped keys", "checkpoint", convert(folder, tmp), 2, "mis-shaped: transformer.wpe.weight")


@case("checkpoint", "shard index naming a missing shard")
def _(tmp, a):
    folder = tmp / "sharded"
    shutil.copytree(a.gpt2, folder)
    header, _ = read_parts(folder / "model.safetensors")
    names = [k for k in header if k != "__metadata__"]
    weight_map = {n: "model.safetensors" for n in names[1:]}
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return Case("shard index naming a missing shard", "checkpoint", convert(folder, tmp), 2,
                "names missing shard(s): model-00002-of-00002.safetensors")


@case("checkpoint", "pickle file without --allow-pickle")
def _(tmp, a):
    from safetensors.torch import load_file

    folder = tmp / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((a.gpt2 / "config.json").read_text())
    torch.save(load_file(str(a.weights)), folder / "pytorch_model.bin")
    return Case("pickle file without --allow-pickle", "checkpoint", convert(folder / "pytorch_model.bin", tmp), 2,
                "pass --allow-pickle")


# --------------------------------------------------------------------------- architecture and config


@case("architecture", "no config.json and no --model")
def _(tmp, a):
    folder = tmp / "bare"
    folder.mkdir()
    shutil.copy(a.weights, folder / "model.safetensors")
    return Case("no config.json and no --model", "architecture", convert(folder, tmp), 2,
                "no --model factory was given and there is no config.json")


@case("architecture", "architecture transformers does not know")
def _(tmp, a):
    folder = tmp / "unknown"
    shutil.copytree(a.gpt2, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2ForTimeTravel"]
    (folder / "config.json").write_text(json.dumps(config))
    return Case("architecture transformers does not know", "architecture", convert(folder, tmp), 2,
                "'GPT2ForTimeTravel' from config.json is not known to transformers")


@case("architecture", "transformers not installed")
def _(tmp, a):
    shadow = tmp / "shadow"
    shadow.mkdir()
    (shadow / "transformers.py").write_text("raise ImportError(\"No module named 'transformers'\")\n")
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return Case("transformers not installed", "architecture", convert(a.gpt2, tmp), 5,
                "transformers is not installed", env=env)


def _factory_env(a: Assets) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(a.factory_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


@case("architecture", "factory module fails to import")
def _(tmp, a):
    return Case("factory module fails to import", "architecture",
                convert(a.weights, tmp, "--model", "no_such_package.models:build"), 2,
                "cannot import factory module 'no_such_package.models'")


@case("architecture", "factory raises")
def _(tmp, a):
    return Case("factory raises", "architecture", convert(a.weights, tmp, "--model", f"{a.factory_module}:raises"),
                2, "raised ValueError: hidden size must be even", env=_factory_env(a))


@case("architecture", "factory returns something that is not a module")
def _(tmp, a):
    return Case("factory returns something that is not a module", "architecture",
                convert(a.weights, tmp, "--model", f"{a.factory_module}:not_a_module"), 2,
                "returned dict, not a torch.nn.Module", env=_factory_env(a))


# --------------------------------------------------------------------------- recipe and inputs


@case("recipe and inputs", "declared inputs the model cannot take")
def _(tmp, a):
    argv = convert(a.factory_dir / "linear.safetensors", tmp, "--model", f"{a.factory_module}:good",
                   "--dim", "batch=2:1:8", "--input", "input:float32:batch,5")
    return Case("declared inputs the model cannot take", "recipe and inputs", argv, 2,
                "the model failed on the first sample (input [2, 5] float32)", env=_factory_env(a))


@case("recipe and inputs", "unknown recipe name")
def _(tmp, a):
    return Case("unknown recipe name", "recipe and inputs",
                ["convert", str(a.gpt2), "--recipe", "h100-fp16", "--out", str(tmp / "out")], 2,
                "did you mean h100-bf16")


@case("recipe and inputs", "fp8 with a target it does not build")
def _(tmp, a):
    argv = convert(a.gpt2, tmp, "--set", "quantize.scheme=fp8-rowwise", "--set", "runtime.dtype=bfloat16",
                   "--target", "exported_program", "--target", "onnx")
    return Case("fp8 with a target it does not build", "recipe and inputs", argv, 2,
                "fp8-rowwise builds exported_program and aoti only; the targets also name onnx")


@case("recipe and inputs", "fp8 in a float32 model")
def _(tmp, a):
    argv = convert(a.gpt2, tmp, "--set", "quantize.scheme=fp8-rowwise", "--target", "exported_program")
    return Case("fp8 in a float32 model", "recipe and inputs", argv, 2, "fp8 runs in a bfloat16 model, not float32")


def _recipe_file(tmp: Path, text: str) -> Path:
    path = tmp / "bad.toml"
    path.write_text(text)
    return path


@case("recipe and inputs", "unknown keys")
def _(tmp, a):
    path = _recipe_file(tmp, 'schema_version = 1\n[runtime]\ndevise = "cpu"\n[bench]\nrepeats = 3\n')
    return Case("unknown keys", "recipe and inputs", ["convert", str(a.gpt2), "--recipe", str(path)], 2,
                "runtime.devise: unknown key (did you mean 'device'?)")


@case("recipe and inputs", "wrong types")
def _(tmp, a):
    path = _recipe_file(tmp, 'schema_version = 1\n[bench]\nwarmup = "five"\n[inputs]\nsamples = 2.5\n')
    return Case("wrong types", "recipe and inputs", ["convert", str(a.gpt2), "--recipe", str(path)], 2,
                "bench.warmup: expected int, got str")


@case("recipe and inputs", "settings that contradict each other")
def _(tmp, a):
    path = _recipe_file(tmp, 'schema_version = 1\n[runtime]\ndevice = "cpu"\nattention_backend = "cudnn"\n'
                             '[targets]\nbuild = ["compile"]\ncompile_modes = ["reduce-overhead"]\n')
    return Case("settings that contradict each other", "recipe and inputs",
                ["convert", str(a.gpt2), "--recipe", str(path)], 2, "'cudnn' needs device 'cuda'")


@case("recipe and inputs", "--set with an unknown key")
def _(tmp, a):
    return Case("--set with an unknown key", "recipe and inputs",
                ["convert", str(a.gpt2), "--set", "numerics.atl=1e-6", "--out", str(tmp / "out")], 2,
                "numerics.atl: unknown key (did you mean 'atol'?)")


@case("recipe and inputs", "one option given twice with two values")
def _(tmp, a):
    return Case("one option given twice with two values", "recipe and inputs",
                ["convert", str(a.gpt2), "--recipe", "cpu-fp32", "--out", str(tmp / "out"), "--recipe", "h100-bf16"],
                2, "--recipe is given twice (--recipe 'cpu-fp32' and --recipe 'h100-bf16')")


@case("recipe and inputs", "one --set key given twice with two values")
def _(tmp, a):
    return Case("one --set key given twice with two values", "recipe and inputs",
                ["convert", str(a.gpt2), "--set", "numerics.k=2", "--set", "numerics.k=4", "--out", str(tmp / "out")],
                2, "--set numerics.k is given twice ('2' and '4')")


@case("recipe and inputs", "one dim sized by --dim and by --set")
def _(tmp, a):
    return Case("one dim sized by --dim and by --set", "recipe and inputs",
                ["convert", str(a.gpt2), "--dim", "batch=2", "--set", "inputs.dims.batch=3", "--out", str(tmp / "out")],
                2, "--dim 'batch=2' and --set inputs.dims.batch=3 both size dim batch")


@case("recipe and inputs", "a --dim name no input uses (a typo)")
def _(tmp, a):
    return Case("a --dim name no input uses (a typo)", "recipe and inputs",
                convert(a.gpt2, tmp, "--dim", "sequenze=32:8:64"), 2,
                "--dim sequenze names no dim of the model's inputs", out=tmp / "out")


@case("recipe and inputs", "unknown --target")
def _(tmp, a):
    return Case("unknown --target", "recipe and inputs",
                ["convert", str(a.gpt2), "--target", "trt", "--out", str(tmp / "out")], 2,
                "'trt' is not a target (did you mean 'tensorrt'?)")


@case("recipe and inputs", "CUDA recipe on a machine without a GPU")
def _(tmp, a):
    return Case("CUDA recipe on a machine without a GPU", "recipe and inputs",
                ["convert", str(a.gpt2), "--recipe", "h100-bf16", "--out", str(tmp / "out")], 5, "no usable GPU")


def _samples(tmp: Path, tensors: dict) -> Path:
    from safetensors.torch import save_file

    path = tmp / "samples.safetensors"
    save_file(tensors, str(path))
    return path


@case("recipe and inputs", "inputs file with a missing name")
def _(tmp, a):
    path = _samples(tmp, {"input_ids": torch.zeros(2, 8, dtype=torch.int64)})
    return Case("inputs file with a missing name", "recipe and inputs",
                convert(a.gpt2, tmp, "--inputs", str(path)), 2, "missing attention_mask")


@case("recipe and inputs", "inputs file with a wrong shape")
def _(tmp, a):
    path = _samples(tmp, {"input_ids": torch.zeros(2, 8, 4, dtype=torch.int64),
                          "attention_mask": torch.ones(2, 8, dtype=torch.int64)})
    return Case("inputs file with a wrong shape", "recipe and inputs",
                convert(a.gpt2, tmp, "--inputs", str(path)), 2, "input_ids has 3 dims")


@case("recipe and inputs", "inputs file with a wrong dtype")
def _(tmp, a):
    path = _samples(tmp, {"input_ids": torch.zeros(2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.int64)})
    return Case("inputs file with a wrong dtype", "recipe and inputs",
                convert(a.gpt2, tmp, "--inputs", str(path)), 2, "input_ids has dtype float32")


# --------------------------------------------------------------------------- output


@case("output and faults", "output folder not writable")
def _(tmp, a):
    if os.geteuid() == 0:
        out = Path("/sys/exporter-catalogue/out")  # refuses writes even to root
    else:
        locked = tmp / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        out = locked / "out"
    argv = convert(a.gpt2, tmp)
    argv[argv.index("--out") + 1] = str(out)
    return Case("output folder not writable", "output and faults", argv, 5, "writable --out", out=out)


@case("output and faults", "output folder from an earlier run")
def _(tmp, a):
    out = tmp / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"schema_version": 1, "files": []}))
    return Case("output folder from an earlier run", "output and faults", convert(a.gpt2, tmp), 5,
                "already holds a run", output_allowed=True)


@case("output and faults", "--overwrite on a folder that is not a run")
def _(tmp, a):
    out = tmp / "out"
    out.mkdir()
    (out / "notes.txt").write_text("a user's own file\n")
    return Case("--overwrite on a folder that is not a run", "output and faults",
                convert(a.gpt2, tmp, "--overwrite"), 5, "not an exporter run", output_allowed=True)


@case("output and faults", "--out is the checkpoint's folder")
def _(tmp, a):
    folder = tmp / "ckpt"
    shutil.copytree(a.gpt2, folder)
    argv = convert(folder, tmp, "--overwrite")
    argv[argv.index("--out") + 1] = str(folder)
    return Case("--out is the checkpoint's folder", "output and faults", argv, 5,
                "replacing it would delete the checkpoint", output_allowed=True)


@case("output and faults", "TMPDIR names a folder that does not exist")
def _(tmp, a):
    return Case("TMPDIR names a folder that does not exist", "output and faults", convert(a.gpt2, tmp), 5,
                "does not exist", env={"TMPDIR": str(tmp / "no-such-folder")})


@case("output and faults", "no C++ compiler for the aoti target")
def _(tmp, a):
    return Case("no C++ compiler for the aoti target", "output and faults",
                convert(a.gpt2, tmp, "--target", "aoti"), 5, "compiles C++ with Inductor, but the C++ compiler",
                env={"CXX": str(tmp / "no-such-compiler")})


@case("output and faults", "a second convert into the same folder")
def _(tmp, a):
    from exporter.outdir import OutputFolder

    holder = OutputFolder(tmp / "out")
    holder.open()

    def release():
        holder.discard()
        holder.release()

    return Case("a second convert into the same folder", "output and faults", convert(a.gpt2, tmp), 5,
                "another exporter run is writing", cleanup=release)


def _small_disk(tmp: Path, name: str, size: str) -> tuple[Path, Callable[[], None]]:
    mount = tmp / name
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        raise RuntimeError(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}): needs root")

    def unmount():
        for _ in range(5):
            if subprocess.run(["umount", str(mount)], capture_output=True).returncode == 0:
                return
            time.sleep(0.5)

    return mount, unmount


@case("output and faults", "the disk fills up mid-write")
def _(tmp, a):
    """A 64 KiB tmpfs as the output's parent: the inputs fit, the float64 reference outputs (100 KiB) do not."""
    mount, unmount = _small_disk(tmp, "small-disk", "64k")
    argv = convert(a.gpt2, tmp)
    argv[argv.index("--out") + 1] = str(mount / "out")
    return Case("the disk fills up mid-write", "output and faults", argv, 5, "the disk filled up while writing",
                out=mount / "out", cleanup=unmount)


@case("output and faults", "not enough space for the artifacts")
def _(tmp, a):
    """A 4 MiB disk holds the reference files, not the margin every artifact build needs: refused before it."""
    mount, unmount = _small_disk(tmp, "four-mib", "4m")
    argv = convert(a.gpt2, tmp)
    argv[argv.index("--out") + 1] = str(mount / "out")
    return Case("not enough space for the artifacts", "output and faults", argv, 5,
                "not enough free disk space: the artifacts in", out=mount / "out", cleanup=unmount)


@case("output and faults", "the temporary folder on a full disk")
def _(tmp, a):
    """TMPDIR on a 4 MiB disk: the AOTInductor build and loads would fill it; the error names TMPDIR, not --out."""
    mount, unmount = _small_disk(tmp, "small-temp", "4m")
    argv = convert(a.gpt2, tmp, "--set", "targets.build=aoti")
    return Case("the temporary folder on a full disk", "output and faults", argv, 5,
                "compiler and AOTInductor temporary files in", env={"TMPDIR": str(mount)}, cleanup=unmount)


@case("text generation", "--task text-generation on a model that is not a decoder")
def _(tmp, a):
    return Case("--task text-generation on a model that is not a decoder", "text generation",
                convert(a.factory_dir / "linear.safetensors", tmp, "--model", f"{a.factory_module}:good",
                        "--task", "text-generation"), 2,
                "the model cannot run one step with a KV cache", env=_factory_env(a))


@case("text generation", "a cache longer than the model's positions")
def _(tmp, a):
    return Case("a cache longer than the model's positions", "text generation",
                convert(a.gpt2, tmp, "--task", "text-generation", "--set", "generation.max_cache_len=128"), 2,
                "the model has 64 positions (max_position_embeddings) but the cache holds 128", out=tmp / "out")


@case("text generation", "generate from a folder without generation programs")
def _(tmp, a):
    return Case("generate from a folder without generation programs", "text generation",
                ["generate", str(tmp), "--target", "aoti", "--input-ids", "1,2,3"], 2,
                "holds no generation programs")


# --------------------------------------------------------------------------- exporter check


def check_argv(artifact: Path, a: Assets, tmp: Path, *extra: str) -> list[str]:
    return ["check", str(artifact), "--against", str(a.gpt2), "--out", str(tmp / "out"), *extra]


@case("exporter check", "the artifact does not exist")
def _(tmp, a):
    return Case("the artifact does not exist", "exporter check", check_argv(tmp / "missing.onnx", a, tmp), 2,
                "missing.onnx does not exist", out=tmp / "out")


@case("exporter check", "the artifact is neither ONNX nor .pt2")
def _(tmp, a):
    return Case("the artifact is neither ONNX nor .pt2", "exporter check", check_argv(a.gpt2 / "config.json", a, tmp),
                2, "is neither an .onnx nor a .pt2 file", out=tmp / "out")


@case("exporter check", "a quantize recipe")
def _(tmp, a):
    broken = tmp / "model.pt2"
    broken.write_bytes(b"not a zip file")
    argv = check_argv(broken, a, tmp) + ["--set", "quantize.scheme=fp8-rowwise", "--set", "runtime.dtype=bfloat16"]
    return Case("a quantize recipe", "exporter check", argv, 2,
                "would judge it against a model exporter quantized itself", out=tmp / "out")


@case("exporter check", "a .pt2 that is not an archive")
def _(tmp, a):
    broken = tmp / "model.pt2"
    broken.write_bytes(b"not a zip file")
    return Case("a .pt2 that is not an archive", "exporter check", check_argv(broken, a, tmp), 2,
                "is not a .pt2 archive", out=tmp / "out")


@case("exporter check", "a .pt2 whose program description is damaged")
def _(tmp, a):
    import zipfile

    made, broken = _linear_program(tmp), tmp / "model.pt2"
    with zipfile.ZipFile(made) as old, zipfile.ZipFile(broken, "w") as new:
        for info in old.infolist():
            new.writestr(info.filename, b"{not json" if info.filename.endswith("models/model.json") else
                         old.read(info.filename))
    return Case("a .pt2 whose program description is damaged", "exporter check", check_argv(broken, a, tmp), 2,
                "is not a readable torch.export archive", out=tmp / "out")


@case("exporter check", "a --junit file no one can write")
def _(tmp, a):
    return Case("a --junit file no one can write", "exporter check",
                check_argv(_linear_program(tmp), a, tmp, "--junit", "/sys/exporter-check.xml"), 5,
                "cannot write the JUnit file", out=tmp / "out")


@case("exporter check", "an artifact of another model")
def _(tmp, a):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["pixel_values"], ["logits"])], "vision",
                              [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3, 8, 8])])
    path = tmp / "vision.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return Case("an artifact of another model", "exporter check", check_argv(path, a, tmp), 2,
                "it takes pixel_values, which GPT2LMHeadModel.forward does not", out=tmp / "out")


@case("exporter check", "--out holds the artifact")
def _(tmp, a):
    folder = tmp / "export"
    folder.mkdir()
    shutil.copy(a.gpt2 / "config.json", folder / "config.json")
    (folder / "model.onnx").write_bytes(b"")
    return Case("--out holds the artifact", "exporter check",
                ["check", str(folder / "model.onnx"), "--against", str(a.gpt2), "--out", str(folder)], 2,
                "holds the artifact being checked")


@case("exporter check", "an empty ONNX file")
def _(tmp, a):
    empty = tmp / "model.onnx"
    empty.write_bytes(b"")
    return Case("an empty ONNX file", "exporter check", check_argv(empty, a, tmp), 2, "holds no ONNX graph",
                out=tmp / "out")


def _linear_program(tmp: Path, named_output: bool = False) -> Path:
    """A small torch.export ``.pt2`` (a linear; its output a transformers ModelOutput where ``named_output``)."""

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, input_ids):
            out = self.proj(input_ids.float())
            if named_output:
                from transformers.modeling_outputs import BaseModelOutput

                return BaseModelOutput(last_hidden_state=out)
            return out

    path = tmp / "made" / "model.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(torch.export.export(Linear(), (torch.zeros(2, 4, dtype=torch.long),)), str(path))
    return path


@case("exporter check", "a .pt2 that needs a pickle (a pickled weight)")
def _(tmp, a):
    from .payloads import pickle_program

    planted = pickle_program(_linear_program(tmp), tmp / "model.pt2", tmp / "ran", "weight")
    return Case("a .pt2 that needs a pickle (a pickled weight)", "exporter check", check_argv(planted, a, tmp), 2,
                "holds pickled data", out=tmp / "out")


@case("exporter check", "an AOTInductor package without --allow-native-code")
def _(tmp, a):
    from .payloads import native_package

    planted = native_package(tmp / "model.aoti.pt2", tmp / "ran")
    return Case("an AOTInductor package without --allow-native-code", "exporter check", check_argv(planted, a, tmp),
                2, "--allow-native-code", out=tmp / "out")


@case("exporter check", "a call spec naming a module outside transformers")
def _(tmp, a):
    from .payloads import spec_module_program

    planted = spec_module_program(_linear_program(tmp, named_output=True), tmp / "model.pt2", "planted_spec",
                                  tmp / "ran", [tmp])
    return Case("a call spec naming a module outside transformers", "exporter check", check_argv(planted, a, tmp), 2,
                "which exporter does not import", out=tmp / "out")


def _onnx_with_data(folder: Path, location: str) -> Path:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    weight = numpy_helper.from_array(np.ones((4, 4), dtype=np.float32), "weight")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "weight"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [weight])
    path = folder / "model.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path),
                    save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    if location != "model.onnx.data":
        proto = onnx.load(str(path), load_external_data=False)
        for entry in proto.graph.initializer[0].external_data:
            if entry.key == "location":
                entry.value = location
        onnx.save_model(proto, str(path))
    return path


@case("exporter check", "an ONNX external-data name outside its folder")
def _(tmp, a):
    path = _onnx_with_data(tmp / "export", "../elsewhere/model.onnx.data")
    return Case("an ONNX external-data name outside its folder", "exporter check", check_argv(path, a, tmp), 2,
                "a path outside its own folder", out=tmp / "out")


@case("exporter check", "a file linked from outside the judged folder")
def _(tmp, a):
    path = _onnx_with_data(tmp / "export", "model.onnx.data")
    secret = tmp / "elsewhere" / "secret"
    secret.parent.mkdir()
    (path.parent / "model.onnx.data").rename(secret)
    (path.parent / "model.onnx.data").symlink_to(secret)
    return Case("a file linked from outside the judged folder", "exporter check", check_argv(path.parent, a, tmp), 2,
                "outside the judged folder", out=tmp / "out")


# --------------------------------------------------------------------------- exporter batch


def batch_plan(tmp: Path, a: Assets, text: str) -> Path:
    plan = tmp / "plan.toml"
    plan.write_text(text.replace("CKPT", str(a.gpt2)))
    return plan


@case("exporter batch", "the plan does not exist")
def _(tmp, a):
    return Case("the plan does not exist", "exporter batch", ["batch", str(tmp / "missing.toml"), "--out",
                                                              str(tmp / "out")], 2, "missing.toml does not exist",
                out=tmp / "out")


@case("exporter batch", "a plan with several problems")
def _(tmp, a):
    plan = batch_plan(tmp, a, '[[run]]\ncheckpoint = "CKPT"\nrecipe = "cpu-fp23"\n\n[[run]]\ncheckpoint = "nowhere"\n'
                              'recipe = "cpu-fp32"\ntarget = ["onnx"]\n')
    return Case("a plan with several problems", "exporter batch", ["batch", str(plan), "--out", str(tmp / "out")], 2,
                "has 3 problem(s)", out=tmp / "out")


@case("exporter batch", "two cells write one folder")
def _(tmp, a):
    plan = batch_plan(tmp, a, '[matrix]\ncheckpoints = ["CKPT"]\nrecipes = ["cpu-fp32"]\n\n'
                              '[[run]]\ncheckpoint = "CKPT"\nrecipe = "cpu-fp32"\ntask = "text-generation"\n')
    return Case("two cells write one folder", "exporter batch", ["batch", str(plan), "--out", str(tmp / "out")], 2,
                "give one of them an out pattern of its own", out=tmp / "out")


@case("exporter batch", "--workers 0")
def _(tmp, a):
    plan = batch_plan(tmp, a, '[[run]]\ncheckpoint = "CKPT"\nrecipe = "cpu-fp32"\n')
    return Case("--workers 0", "exporter batch", ["batch", str(plan), "--workers", "0", "--out", str(tmp / "out")],
                2, "is not a number of workers", out=tmp / "out")


@case("exporter batch", "--workers with a cluster's address")
def _(tmp, a):
    plan = batch_plan(tmp, a, '[[run]]\ncheckpoint = "CKPT"\nrecipe = "cpu-fp32"\n')
    return Case("--workers with a cluster's address", "exporter batch",
                ["batch", str(plan), "--scheduler", "tcp://127.0.0.1:8786", "--workers", "2", "--out",
                 str(tmp / "out")], 2, "has the workers it was started with", out=tmp / "out")
