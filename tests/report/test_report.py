"""The report files: report.json has a JSON Schema, shipped in the package (a real report validates, damaged
ones do not; conftest.py's ``every_report_validates`` also checks every report the rest of the suite
writes); report.png draws the timings and report.md links it."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from exporter.report import SCHEMA_FILE, report_schema

pytestmark = pytest.mark.slow


@pytest.fixture
def folder(converted_tiny):
    """The tiny ViT converted once for the whole run, every target (``converted_tiny`` in conftest.py)."""
    return converted_tiny("vit").out


@pytest.fixture
def report(folder):
    return json.loads((folder / "report.json").read_text())


def errors(report) -> list[str]:
    validator = jsonschema.Draft202012Validator(report_schema(), format_checker=jsonschema.FormatChecker())
    return ["/".join(map(str, e.absolute_path)) or "(top)" for e in validator.iter_errors(report)]


def test_the_schema_is_a_valid_json_schema_inside_the_package():
    jsonschema.Draft202012Validator.check_schema(report_schema())
    assert SCHEMA_FILE.parent.name == "report" and SCHEMA_FILE.parent.parent.name == "exporter"


def test_a_real_report_validates(report):
    assert errors(report) == []


@pytest.mark.parametrize("damage, where", [
    (lambda r: r["artifacts"][0].update(surprise=1), "artifacts/0"),
    (lambda r: r["artifacts"][0]["bench"].pop("noise"), "artifacts/0/bench"),
    (lambda r: r["model"].update(checkpoint="/home/someone/models/vit"), "model/checkpoint"),
    (lambda r: r["artifacts"][0].update(status="fine"), "artifacts/0/status"),
    (lambda r: r.pop("run"), "(top)"),
    (lambda r: r["environment"]["device"].update(hostname="build-7"), "environment/device"),
    (lambda r: r["artifacts"][0]["files"][0].update(sha256="not-a-hash"), "artifacts/0/files/0/sha256"),
])
def test_damaged_reports_do_not_validate(report, damage, where):
    broken = copy.deepcopy(report)
    damage(broken)
    assert where in errors(broken)


def test_the_chart_is_an_image_of_the_timed_variants_linked_from_the_markdown(folder, report):
    from PIL import Image

    from exporter.report.chart import size_px, timed_rows

    assert report["chart"] == "report.png"
    rows = timed_rows(report)
    assert [name for name, _ in rows] == ["eager (baseline)", "rewritten", "exported_program", "aoti", "onnx"]
    with Image.open(folder / "report.png") as image:
        image.verify()  # a whole, valid PNG
    with Image.open(folder / "report.png") as image:
        assert image.format == "PNG" and image.size == size_px(len(rows))
        assert len(set(image.convert("RGB").getdata())) > 50  # drawn, not blank
    assert "![Latency and speedup per variant](report.png)" in (folder / "report.md").read_text()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert "report.png" in {f["path"] for f in manifest["files"]}


def _timed(**artifacts):
    """A report's head for the verdict: each artifact's speedup and whether the quartiles support it."""
    return {"passed": True, "allow_drift": False, "exit_code": 0, "baseline": {"bench": {"noise": 0.3}},
            "artifacts": [{"name": name, "bench": {"speedup_vs_eager": value, "speedup_supported": supported}}
                          for name, (value, supported) in artifacts.items()]}


def test_the_headline_gives_both_verdicts():
    from exporter.report.markdown import headline

    assert headline(_timed(aoti=(1.6, True), onnx=(2.0, False))) == \
        "numerics: passed · speed: faster (aoti 1.60× eager)"
    assert headline(_timed(aoti=(1.6, False))) == "numerics: passed · speed: not measurable (eager's noise 30%)"
    assert headline(_timed(aoti=(0.8, True))) == \
        "numerics: passed · speed: not faster than eager (best: aoti 0.80×)"
    failed = {**_timed(aoti=(1.2, True)), "passed": False, "exit_code": 3}
    assert headline(failed).startswith("numerics: FAILED · speed: faster")


TABLE = """| variant | status | worst rel. L2 | median ms | p90 ms | p99 ms | noise | speedup | TFLOP/s | build s \
| size | attention kernels |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| eager (baseline) | — | — | 18.6 | 33.2 | 83.9 | 30% | 1.00× | 0.07 | — | — | softmax ×6 |
| exported_program | ✅ ok | 1.01e-06 | 18.9 | 24.3 | 27.4 | 33% | 0.99× ⚠ | 0.07 | 8.7 | 87.6 MiB | flash ×6 |
| onnx | ✅ ok | 9.40e-07 | 11.6 | 19.7 | 29.2 | 48% | 1.61× | 0.12 | 5.5 | 87.1 MiB | onnxruntime Attention ×6 |
"""


@pytest.mark.parametrize("width", [80, 100, 119])
def test_a_narrow_terminal_leaves_columns_out_whole_and_never_cuts_the_main_figures(width):
    from rich.console import Console

    from exporter.commandline import show_markdown

    console = Console(width=width, force_terminal=True, record=True, highlight=False, color_system=None)
    show_markdown(TABLE, console=console)
    shown = console.export_text()
    for figure in ("exported_program", "18.6", "11.6", "9.40e-07", "1.61×", "0.99× ⚠", "1.00×"):
        assert figure in shown, (figure, shown)
    assert "…" not in shown and "left out for this" in shown, shown
    wide = Console(width=200, force_terminal=True, record=True, highlight=False, color_system=None)
    show_markdown(TABLE, console=wide)
    everything = wide.export_text()
    assert "left out" not in everything and "onnxruntime Attention ×6" in everything
