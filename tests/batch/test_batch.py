"""exporter batch: a plan of real converts on this host's workers and on a real dask.distributed cluster.

Each cell is a real ``exporter convert`` of a tiny random-weight transformers model (exported program only, to
keep the cells short); faults are real too: a damaged checkpoint, a cell process killed with SIGKILL, a Dask
worker process killed with SIGKILL, SIGINT sent to the batch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

MODELS = ("gpt2", "bert", "vit")
QUICK = """
[bench]
warmup = 1
rounds = 2
iterations = 2
"""


def write_plan(folder: Path, tiny_models: dict[str, Path], extra: str = "", models=MODELS) -> Path:
    """A plan folder as a user keeps one: the checkpoints, a recipe file of its own, the plan."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in models:
        if not (folder / "models" / name).exists():
            shutil.copytree(tiny_models[name], folder / "models" / name)
    recipe = (Path(__file__).parents[2] / "recipes" / "cpu-fp32.toml").read_text()
    recipe = recipe.split("[bench]")[0] + QUICK  # cpu-fp32 with a short benchmark
    (folder / "recipes").mkdir(exist_ok=True)
    (folder / "recipes" / "cpu-quick.toml").write_text(recipe)
    listed = ", ".join(f'"models/{m}"' for m in models)
    plan = folder / "plan.toml"
    plan.write_text(f"""description = "tiny models under two recipes"

[matrix]
checkpoints = [{listed}]
recipes = ["cpu-fp32", "recipes/cpu-quick.toml"]
targets = ["exported_program"]
set = ["bench.rounds=2", "bench.warmup=1", "bench.iterations=2"]
{extra}""")
    return plan


def damaged_checkpoint(folder: Path, source: Path) -> None:
    """A checkpoint whose weights file was cut short (a copy that did not finish)."""
    shutil.copytree(source, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def exporter_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "exporter", *args]


def kill_when_running(out_fragment: str, find_victim, delay_s: float = 2.0, timeout_s: float = 240.0) -> dict:
    """In a thread: once a cell's convert (``--out`` ending with ``out_fragment``) has run ``delay_s``, SIGKILL the
    process ``find_victim(supervisor)`` names (given the cell's supervising process, the one with a convert child).
    Returns a dict that gets ``pid`` when it struck."""
    psutil = pytest.importorskip("psutil")
    struck: dict = {}

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and "pid" not in struck:
            for proc in psutil.process_iter(["cmdline"]):
                cmd = proc.info["cmdline"] or []
                if "convert" in cmd and "--out" in cmd and cmd[cmd.index("--out") + 1].endswith(out_fragment):
                    try:
                        if not proc.children():  # the convert itself; its parent is the supervising process
                            continue
                        time.sleep(delay_s)
                        victim = find_victim(proc)
                        assert victim.pid != os.getpid(), "the test would kill itself"
                        os.kill(victim.pid, signal.SIGKILL)
                        struck["pid"] = victim.pid
                    except (psutil.Error, OSError):
                        continue
                    return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    struck["thread"] = thread
    return struck


def leftovers(out: Path) -> list[str]:
    """Staging folders, or cell folders without a manifest: what a half-written publish would leave."""
    found = []
    for path in out.rglob("*"):
        if path.is_dir() and path.name.startswith(".") and path.name not in (".batch", ".compile-cache") and \
                ".compile-cache" not in path.parts:
            found.append(str(path.relative_to(out)))
    return found


@pytest.fixture(scope="module")
def local_run(tiny_models, tmp_path_factory):
    """The plan (3 models x 2 recipes, and a damaged checkpoint) through the command line on 2 local workers,
    with one cell's process killed mid-run."""
    folder = tmp_path_factory.mktemp("batch-local")
    damaged_checkpoint(folder / "models" / "damaged", tiny_models["gpt2"])
    plan = write_plan(folder, tiny_models, extra='\n[[run]]\ncheckpoint = "models/damaged"\nrecipe = "cpu-fp32"\n'
                                                 'targets = ["exported_program"]\n')
    out = folder / "out"
    struck = kill_when_running("bert/cpu-fp32", lambda supervisor: supervisor)  # a lost cell
    done = subprocess.run(exporter_cmd("batch", str(plan), "--out", str(out), "--workers", "2",
                                       "--junit", str(folder / "batch.xml"), "--json"),
                          capture_output=True, text=True, timeout=900, check=False)
    struck["thread"].join(timeout=5)
    return {"plan": plan, "out": out, "done": done, "struck": struck, "folder": folder}


def cells_of(out: Path) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads((out / "batch.json").read_text())["cells"]}


def test_a_plan_runs_every_cell_and_a_failing_one_does_not_stop_the_rest(local_run):
    from exporter.published.verification import verify

    done, out = local_run["done"], local_run["out"]
    assert done.returncode == 2, done.stderr[-2000:]  # the damaged checkpoint's usage error is the worst code
    assert json.loads(done.stdout) == json.loads((out / "batch.json").read_text())
    cells = cells_of(out)
    assert len(cells) == 7
    good = {f"{m}/{r}" for m in MODELS for r in ("cpu-fp32", "cpu-quick")}
    for name in good:
        assert cells[name]["status"] == "passed", cells[name]
        assert verify(out / name).exit_code == 0, name
        assert (out / cells[name]["log"]).is_file()
    bad = cells["damaged/cpu-fp32"]
    assert bad["status"] == "failed" and bad["exit_code"] == 2
    assert "model.safetensors" in bad["error"] and "Fix:" in bad["error"], bad["error"]
    assert not (out / "damaged" / "cpu-fp32").exists()
    assert "error: damaged/cpu-fp32:" in done.stderr
    assert leftovers(out) == []
    summary = json.loads((out / "batch.json").read_text())
    assert summary["engine"]["kind"] == "local" and summary["engine"]["workers"] == 2
    assert summary["counts"] == {"passed": 6, "failed": 1}
    assert summary["timings"]["cells_s"] > summary["timings"]["wall_s"]  # two cells at a time
    md = (out / "batch.md").read_text()
    assert "damaged/cpu-fp32" in md and "Cells that did not pass" in md


def test_a_cell_whose_process_is_killed_runs_again_on_another_worker(local_run):
    assert "pid" in local_run["struck"], "the cell was never seen running"
    cell = cells_of(local_run["out"])["bert/cpu-fp32"]
    assert cell["status"] == "passed" and cell["attempt"] == 2
    [lost] = cell["lost_attempts"]
    assert "SIGKILL" in lost["error"]
    assert lost["worker"] != cell["worker"]
    log = (local_run["out"] / cell["log"]).read_text()
    assert "# attempt 1 on" in log and "# attempt 2 on" in log


def test_the_junit_file_has_one_case_per_cell(local_run):
    root = ET.parse(local_run["folder"] / "batch.xml").getroot()
    cases = root.findall(".//testcase")
    assert len(cases) == 7
    failed = [c.get("name") for c in cases if c.find("failure") is not None]
    assert failed == ["damaged/cpu-fp32"]


def test_the_summary_matches_its_schema(local_run):
    jsonschema = pytest.importorskip("jsonschema")
    from exporter.report import command_schema

    summary = json.loads((local_run["out"] / "batch.json").read_text())
    jsonschema.Draft202012Validator(command_schema("batch")).validate(summary)


def test_a_second_run_skips_finished_cells_and_runs_failed_ones_again(local_run):
    out = local_run["out"]
    before = {name: (out / name / "manifest.json").stat().st_mtime_ns
              for name in cells_of(out) if "damaged" not in name}
    done = subprocess.run(exporter_cmd("batch", str(local_run["plan"]), "--out", str(out), "--workers", "2"),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    cells = cells_of(out)
    for name, mtime in before.items():
        assert cells[name]["status"] == "skipped" and cells[name]["run_s"] is None
        assert (out / name / "manifest.json").stat().st_mtime_ns == mtime  # not written again
        assert cells[name]["report"]["passed"]  # its figures still shown, from its own report
    assert cells["damaged/cpu-fp32"]["status"] == "failed" and cells["damaged/cpu-fp32"]["attempt"] == 1
    assert "not run again" in done.stderr


def test_a_cell_is_run_again_when_its_recipe_or_checkpoint_changed(local_run, tmp_path):
    from exporter.batch.cell import Hashes, finished
    from exporter.batch.plan import load_plan

    out = local_run["out"]
    cell = next(c for c in load_plan(local_run["plan"]).cells if c.name == "gpt2/cpu-fp32")
    assert finished(cell, out, Hashes())[0]
    changed = dataclasses.replace(cell, recipe_dict={**cell.recipe_dict, "bench": {**cell.recipe_dict["bench"],
                                                                                 "rounds": 9}})
    assert finished(changed, out, Hashes()) == (False, "the recipe or the cell's options changed")
    copy = tmp_path / "gpt2"
    shutil.copytree(cell.checkpoint, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one weight's last byte: same size, other bytes
    weights.write_bytes(bytes(data))
    assert finished(dataclasses.replace(cell, checkpoint=copy), out, Hashes()) == (False, "the checkpoint changed")


def test_the_plan_is_checked_whole_before_anything_runs(tiny_models, tmp_path):
    plan = write_plan(tmp_path, tiny_models, models=("gpt2",), extra="""
[[run]]
checkpoint = "models/missing"
recipe = "cpu-fp32"

[[run]]
checkpoint = "models/gpt2"
recipe = "cpu-fp23"
targt = ["onnx"]

[[run]]
checkpoint = "models/gpt2"
recipe = "cpu-fp32"
targets = ["onnxx"]
set = ["numerics.atol=-1"]

[[run]]
checkpoint = "models/gpt2"
recipe = "cpu-fp32"
targets = ["exported_program"]
set = ["bench.rounds=2", "bench.warmup=1", "bench.iterations=2"]

[[run]]
checkpoint = "models/gpt2"
recipe = "cpu-fp32"
out = "{model}/{dtype}"
""")
    out = tmp_path / "out"
    done = subprocess.run(exporter_cmd("batch", str(plan), "--out", str(out)), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: plan ") and "Fix:" in line
    for expected in ("run[1].checkpoint: models/missing does not exist", "'cpu-fp23'", "did you mean cpu-fp32",
                     "run[2].targt: unknown key (did you mean 'targets'?)", "'onnxx' is not a target",
                     "matrix (models/gpt2 x cpu-fp32): writes gpt2/cpu-fp32, as run[4] does",
                     "{dtype} is not a placeholder", "run[3].set: numerics.atol: must be non-negative"):
        assert expected in line, expected
    assert not out.exists()


def test_a_batch_folder_inside_a_checkpoint_folder_is_refused_before_anything_is_written(tiny_models, tmp_path):
    plan = write_plan(tmp_path, tiny_models, models=("gpt2",))
    before = sorted(p.name for p in (tmp_path / "models" / "gpt2").iterdir())
    out = tmp_path / "models" / "gpt2" / "batch"
    done = subprocess.run(exporter_cmd("batch", str(plan), "--out", str(out)), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 5, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "lies inside the checkpoint folder" in line and "Fix:" in line, line
    assert sorted(p.name for p in (tmp_path / "models" / "gpt2").iterdir()) == before


def test_a_scheduler_address_nothing_listens_on_fails_at_once(tiny_models, tmp_path):
    """A refused connection is told in one line within seconds, not after the Dask client's 30 s of retries."""
    import socket
    import time

    pytest.importorskip("distributed")
    plan = write_plan(tmp_path, tiny_models, models=("gpt2",))
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    t0 = time.monotonic()
    done = subprocess.run(exporter_cmd("batch", str(plan), "--out", str(tmp_path / "out"), "--scheduler",
                                       f"tcp://127.0.0.1:{port}"), capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 5, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "cannot reach the Dask scheduler" in line and "Fix:" in line, line
    assert time.monotonic() - t0 < 20  # the interpreter and the plan check, no 30 s wait


def test_a_plan_on_a_dask_cluster_runs_and_a_killed_worker_is_replaced(tiny_models, tmp_path):
    pytest.importorskip("distributed")
    from distributed import LocalCluster

    from exporter.batch import batch
    from exporter.published.verification import verify

    plan = write_plan(tmp_path, tiny_models)
    out = tmp_path / "out"
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit=0,
                      dashboard_address=None) as cluster:
        # the Dask worker process running the vit/cpu-quick cell (the supervising process's parent) dies
        struck = kill_when_running("vit/cpu-quick", lambda supervisor: supervisor.parent())
        result = batch(plan, out, scheduler=cluster.scheduler_address)
        struck["thread"].join(timeout=5)
    stop_resource_tracker()
    assert result.exit_code == 0, result.problems
    assert "pid" in struck, "the cell was never seen running"
    cells = cells_of(out)
    assert {c["status"] for c in cells.values()} == {"passed"}
    assert len(cells) == 6
    assert cells["vit/cpu-quick"]["attempt"] == 2
    assert {c["worker"].split(":")[1] for c in cells.values()} <= {"dask-0", "dask-1"}
    for name in cells:
        assert verify(out / name).exit_code == 0, name
    assert result.summary["engine"]["kind"] == "dask" and result.summary["engine"]["workers"] == 2
    assert leftovers(out) == []


def stop_resource_tracker() -> None:
    """The cluster's worker processes were spawned through multiprocessing, which leaves its resource-tracker
    process running for the rest of this test process; later tests check that a run leaves no child of theirs
    alive, so the test that started it ends it."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_pid", None) is not None:
        tracker._stop()


def test_sigint_stops_every_cell_and_publishes_nothing(tiny_models, tmp_path):
    psutil = pytest.importorskip("psutil")
    plan = write_plan(tmp_path, tiny_models, models=("gpt2", "bert"))
    out = tmp_path / "out"
    batch_proc = subprocess.Popen(exporter_cmd("batch", str(plan), "--out", str(out), "--workers", "2"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    def command(proc) -> list[str]:
        try:
            return proc.cmdline()
        except psutil.Error:  # a process that ended since it was listed
            return []

    while time.monotonic() < deadline:  # both first cells have a convert running
        converts = [p for p in psutil.Process(batch_proc.pid).children(recursive=True) if "convert" in command(p)]
        if len(converts) >= 4:  # 2 cells x (supervising process + convert)
            break
        time.sleep(0.2)
    time.sleep(2)
    batch_proc.send_signal(signal.SIGINT)
    _, stderr = batch_proc.communicate(timeout=180)
    assert batch_proc.returncode == 130, stderr
    summary = json.loads((out / "batch.json").read_text())
    assert summary["stopped_by"] == "SIGINT"
    assert summary["counts"] == {"interrupted": 2, "not run": 2}
    assert not list(out.rglob("manifest.json"))
    assert leftovers(out) == []
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert "interrupted by SIGINT: 2 running cell(s) stopped" in stderr


def test_the_worst_code_wins_and_workers_follow_the_gpus():
    from exporter.batch.engines import LocalEngine
    from exporter.errors import UsageError, worst_code

    assert worst_code([0, 0]) == 0
    assert worst_code([0, 4, 3]) == 3  # wrong numbers outrank a target that could not be built, as in convert
    assert worst_code([2, 5, 4]) == 4
    assert worst_code([1, 5, 130]) == 130
    assert LocalEngine(gpus=["0", "1", "2"]).slots == ["0", "1", "2"]
    assert LocalEngine(2, gpus=["3", "5", "7"]).slots == ["3", "5"]
    assert LocalEngine(2, gpus=[]).slots == [None, None]
    with pytest.raises(UsageError, match="more workers than this host's 2 GPU"):
        LocalEngine(3, gpus=["0", "1"])


def test_a_group_left_with_only_zombies_is_not_waited_for():
    """A killed cell's processes can stay zombies where nothing reaps orphans (a container's first process): they
    hold no lock, so the retry must not wait its whole grace for them."""
    from exporter.batch.cell import _end_group, _group_alive

    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert _group_alive(running.pid)
    finally:
        running.kill()
        running.wait()
    dead = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)  # not reaped: a zombie
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{dead.pid}/stat", encoding="utf-8") as handle:
            if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    os.killpg(dead.pid, 0)  # the group still answers a signal: killpg alone takes it for alive
    t0 = time.monotonic()
    assert not _group_alive(dead.pid)
    _end_group(dead.pid, grace_s=30)
    assert time.monotonic() - t0 < 5
    dead.wait()
