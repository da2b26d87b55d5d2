"""Several AOTInductor packages compiled at once (``targets.compile_apart``): a program compiled in a process of its
own computes what the same program compiled here computes, a child's failure fails the build with its output and
leaves no process and no file behind, and what a child needs travels with it."""

from __future__ import annotations

import ast
import io
import os
import tempfile
from pathlib import Path

import pytest
import torch
from torch.export import Dim

from exporter.targets import compile_apart, package_cache
from exporter.targets.aoti_loader import load_package
from exporter.targets.compile_apart import Job

SRC = Path(compile_apart.__file__).parents[1]


class Step(torch.nn.Module):
    """A decode step's shape of work: an embedding, a norm, a write into a cache the caller owns, a masked read."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, ids, mask, position, cache):
        h = self.embed(ids)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        cache.index_copy_(2, position, self.proj(h).unsqueeze(1).expand(-1, 2, -1, -1))
        return self.proj(h[:, -1]) + (cache * mask[:, None, :, None]).sum(2).sum(1)


def inputs(batch: int) -> tuple[torch.Tensor, ...]:
    return (torch.arange(batch)[:, None] % 50, torch.ones(batch, 8, dtype=torch.long), torch.tensor([3]),
            torch.zeros(batch, 2, 8, 16))


def program(dynamic: bool) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    dims = ({0: Dim.AUTO}, {0: Dim.AUTO}, None, {0: Dim.AUTO}) if dynamic else None
    return torch.export.export(Step().eval(), inputs(2), dynamic_shapes=dims)


def run(path: Path, batch: int) -> list[torch.Tensor]:
    args = inputs(batch)
    out = load_package(path)(*args)
    return [out, args[3]]  # the logits and the cache the package wrote


@pytest.mark.slow
def test_programs_compiled_apart_compute_what_they_compute_compiled_here(tmp_path, monkeypatch):
    scratch = own_temporary_folder(tmp_path, monkeypatch)
    monkeypatch.setenv(compile_apart.ENV, "3")
    monkeypatch.delenv(package_cache.ENV, raising=False)  # every job compiled, none reused
    dynamic, static = program(True), program(False)
    jobs = [Job(dynamic, tmp_path / "first.pt2", {}), Job(dynamic, tmp_path / "dynamic.pt2", {}),
            Job(static, tmp_path / "static.pt2", {})]
    outcomes = compile_on_cpu(jobs)
    assert [o["apart"] for o in outcomes] == [False, True, True]
    for batch in (1, 2):  # batch 1: the size a dynamic batch loaded without its ranges was compiled wrong for
        here, apart = run(tmp_path / "first.pt2", batch), run(tmp_path / "dynamic.pt2", batch)
        assert all(torch.equal(a, b) for a, b in zip(apart, here)), batch
    args = inputs(2)
    expected = static.module()(*args)
    assert torch.allclose(run(tmp_path / "static.pt2", 2)[0], expected, rtol=1e-5, atol=1e-6)
    assert not list(scratch.glob("exporter-compile-*"))  # the programs saved for the children went with them


def own_temporary_folder(tmp_path: Path, monkeypatch) -> Path:
    """This test's own temporary folder (another worker's builds use the shared one at the same time)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", cache_dir())  # Inductor's caches where they were
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


def compile_on_cpu(jobs: list[Job]) -> list[dict]:
    return compile_apart.compile_all(jobs, "cpu", "auto")


def test_a_child_that_fails_to_compile_fails_the_build_with_its_output_and_leaves_nothing(tmp_path, monkeypatch):
    psutil = pytest.importorskip("psutil")
    scratch = own_temporary_folder(tmp_path, monkeypatch)
    monkeypatch.setenv(compile_apart.ENV, "2")
    monkeypatch.delenv(package_cache.ENV, raising=False)
    static = program(False)
    jobs = [Job(static, tmp_path / "here.pt2", {}),
            Job(static, tmp_path / "apart.pt2", {"no_such_inductor_option": True})]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match="no_such_inductor_option"):
        compile_on_cpu(jobs)
    assert not (tmp_path / "apart.pt2").exists()
    from exporter import forkserver  # its server may have started for the child: it is not the child

    left = {p.pid for p in psutil.Process().children(recursive=True)} - before - set(forkserver.server_pids())
    assert not [p for p in left if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not list(scratch.glob("exporter-compile-*"))


def test_a_loaded_program_gets_the_ranges_of_its_symbols_back():
    original = program(True)
    buffer = io.BytesIO()
    torch.export.save(original, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    ranges = compile_apart.shape_ranges(original)
    compile_apart.restore_ranges(loaded, ranges)
    assert compile_apart.shape_ranges(loaded).items() <= ranges.items()
    assert compile_apart.shape_ranges(loaded)
    with pytest.raises(ValueError, match="no range"):
        compile_apart.restore_ranges(loaded, {})
    assert compile_apart.shape_ranges(program(False)) == {}


def test_how_many_compile_at_once(monkeypatch):
    monkeypatch.delenv(compile_apart.ENV, raising=False)
    assert compile_apart.jobs_at_once("cpu") == 1  # one after the other: each reuses the kernels of the one before
    assert compile_apart.jobs_at_once("cuda") == (os.cpu_count() or 1)
    monkeypatch.setenv(compile_apart.ENV, "3")
    assert compile_apart.jobs_at_once("cpu") == 3
    monkeypatch.setenv(compile_apart.ENV, "none")
    assert compile_apart.jobs_at_once("cpu") == 1


def test_every_module_that_registers_an_op_is_imported_by_a_child():
    registering = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "triton_op", "custom_op", "define"):
                args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if any(a.startswith("exporter::") for a in args):
                    registering.add(".".join(path.relative_to(SRC.parent).with_suffix("").parts))
    assert registering and registering <= set(compile_apart.OP_MODULES), registering - set(compile_apart.OP_MODULES)


def test_the_shared_generation_folder_judged_a_decode_package_compiled_apart(llama_generation):
    """The suite's tiny Llama generation (tests/conftest.py) compiled its decode package in a process of its own;
    every test that reads that folder judges it, and here its gate passed at batch 1 and at the recipe's batch."""
    report = llama_generation.report
    (entry,) = [a for a in report["artifacts"] if a["target"] == "aoti"]
    assert entry["status"] == "ok" and entry["numerics"]["passed"], entry
    assert any("decode.aoti.pt2 at the same time, each in a process of its own" in n for n in entry["notes"])
    assert any("prefill.aoti.pt2 compiled here" in n for n in entry["notes"])
