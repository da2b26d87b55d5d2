"""The house: no import cycles (type-only imports included), no test folders on ``sys.path``, a short top level,
one home for the facts that were written twice."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "exporter"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(tree: ast.AST):
    """Every import statement, at any depth: lazy ones and those under ``if TYPE_CHECKING:`` too (a type-only
    import is a dependency the day its guard goes)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(name: str, path: Path) -> set[str]:
    """The exporter modules ``name`` imports, with the packages Python runs on the way (a package's
    ``__init__`` runs before its submodule, unless the importer lives inside that package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            submodules = [f"{stem}.{a.name}" for a in node.names if f"{stem}.{a.name}" in MODULES]
            # ``from pkg import submodule`` needs pkg only on the way (see below); ``from pkg import name`` reads it
            targets = submodules + ([stem] if len(submodules) < len(node.names) else [])
        for target in targets:
            if not target.startswith("exporter"):
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                module = ".".join(parts[:i])
                on_the_way = i < len(parts) and (name == module or name.startswith(module + "."))
                if module in MODULES and module != name and not on_the_way:  # a package holding the importer
                    found.add(module)  # has run before it: not a dependency; everything else is
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    graph = {name: imported_modules(name, path) for name, path in MODULES.items()}
    assert cycles(graph) == []


def room(module: str) -> str | None:
    """The top-level module or package a module belongs to (``exporter.targets.aoti`` -> ``targets``); None for
    the package's own ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_the_stages_stack_without_an_import_running_back_up():
    """Folders and top-level modules as rooms: no two rooms import each other, even through others, so the rooms
    stack in floors with every import running down (a target reads plain values, not the recipe; the quantize stage
    is handed the generation's forced logits instead of importing them)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        here = room(name)
        if here is None:
            continue
        rooms = {room(m) for m in imported_modules(name, path)}
        graph.setdefault(here, set()).update(r for r in rooms if r is not None and r != here)
    assert cycles(graph) == []


def test_a_type_only_import_counts():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .recipe import Recipe\n")
    assert sorted(node.module for node in _imports(tree) if isinstance(node, ast.ImportFrom)) == ["recipe", "typing"]


def test_no_folder_is_put_on_sys_path_by_hand():
    """tests/, scripts/ and benchmarks/ import the shared models and catalogues from ``exporter.testing``."""
    edit = re.compile(r"sys\.path\s*(\.insert|\.append|\.extend|\[|\+=|=)|syspath_prepend\(")
    found = []
    for folder in ("tests", "scripts", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if edit.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}")
    assert found == [], found


def test_one_dtype_table():
    """Every dtype fact comes from exporter.dtypes; the loader shipped beside AOTI packages (which cannot import
    exporter) holds the one copy, and it agrees."""
    import torch

    from exporter import dtypes
    from exporter.targets import aoti_loader

    assert {code: dtypes.from_safetensors(code) for code in aoti_loader.SAFETENSORS_DTYPES} == \
        aoti_loader.SAFETENSORS_DTYPES
    assert all(dtypes.torch_dtype(d.name).itemsize == d.itemsize for d in dtypes.DTYPES)
    assert dtypes.torch_dtype("bfloat16") is torch.bfloat16 and dtypes.name_of(torch.float16) == "float16"
    tables = []
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("dtypes.py", "aoti_loader.py"):
            continue
        text = path.read_text(encoding="utf-8")
        if '"BF16"' in text or "2.0**-8" in text or '"bfloat16": torch.bfloat16' in text:
            tables.append(str(path.relative_to(PACKAGE)))
    assert tables == [], tables


def test_one_exit_code_rule_and_one_timing_loop():
    """Statuses become an exit code in ``results.exit_code`` only (verify's own checks have their precedence table
    in ``errors``); device clocks are read in ``measure/bench`` only."""
    rule, clocks = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(PACKAGE))
        if "EXIT_NUMERICS" in text and where not in ("errors.py", "results.py", "published/verification.py",
                                                          "published/reading.py"):
            rule.append(where)
        if "Event(enable_timing" in text and where != "measure/bench.py":
            clocks.append(where)
    assert rule == [] and clocks == [], (rule, clocks)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_resolved_with_their_packages():
    runners = imported_modules("exporter.runners", MODULES["exporter.runners"])
    assert {"exporter.child", "exporter.targets", "exporter.targets.spec"} <= runners
    aoti = imported_modules("exporter.targets.aoti", MODULES["exporter.targets.aoti"])
    assert "exporter.targets.spec" in aoti and "exporter.targets" not in aoti  # its own package is already there


def test_the_top_level_stays_short():
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= 22, flat


def test_no_module_outgrows_a_read():
    """A module a newcomer reads in one sitting: 500 lines at most (``testing/`` holds catalogues, not logic)."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if "testing" not in p.parts
            and (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert long == {}, long


def test_target_names_have_one_home():
    from exporter import recipe, targets

    assert recipe.TARGETS is targets.NAMES
    assert [t.name for t in targets.TARGETS] == list(targets.NAMES)


def test_exit_code_doc_is_generated_from_the_table():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "exit_codes.py"), "--check"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_describe_cuts_at_a_word_boundary():
    from exporter.errors import RecipeError, describe

    text = describe(ValueError("Fix: make the model run in float64 on the CPU " * 20), limit=60)
    assert len(text) <= 60 and text.endswith("…") and text.startswith("ValueError: Fix: make")
    assert text[:-1].split()[-1] in "Fix: make the model run in float64 on the CPU".split()
    assert describe(KeyError()) == "KeyError"
    assert describe(RecipeError("bad", "fix it")) == "bad. Fix: fix it."


def test_no_public_name_of_the_package_is_also_a_submodule_name():
    """``exporter.verify`` and the others stay the functions ``__all__`` names after every submodule is imported:
    importing a submodule sets the package attribute of its name, so a function named like a module became that
    module (``exporter.verify(out)``: 'module' object is not callable) once anything imported ``exporter.verify``."""
    import importlib
    import pkgutil

    import exporter

    modules = {info.name for info in pkgutil.iter_modules(exporter.__path__)}
    assert not set(exporter.__all__) & modules
    for name in ("published.verification", "published.revalidate", "api"):
        importlib.import_module(f"exporter.{name}")
    for name in exporter.__all__:
        assert callable(getattr(exporter, name)), name


def test_every_generation_module_is_where_the_architecture_says():
    """docs/architecture.md's account of generation/ names every module there (the families, their steps, the
    corridor), so a module added without a word there, or one removed and still described, fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## Where does a new generation family go?"):]
    section = section[:section.index("\n## ", 1)]
    stems = {p.stem for p in (PACKAGE / "generation").glob("*.py") if p.stem != "__init__"}
    assert sorted(s for s in stems if f"{s}.py" not in section and f"`{s}." not in section) == []
    named = set(re.findall(r"`(\w+)\.py`", section))
    assert sorted(named - stems) == []
