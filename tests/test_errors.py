"""Every case of the error catalogue (src/exporter/testing/error_cases.py) through the real command line.

Each must exit with its documented code, print one `error:` line that names the problem (and a fix),
print no traceback, and leave no output folder and no staging folder behind.
"""

from __future__ import annotations

import pytest

from exporter.testing.error_cases import CASES, Case, error_line, make_assets, run


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("catalogue"))


@pytest.mark.parametrize("build", [c[2] for c in CASES], ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_catalogue_case(build, assets, tmp_path):
    case = build(tmp_path, assets)
    try:
        result = run(case, cwd=tmp_path)
    finally:
        if case.cleanup:
            case.cleanup()
    assert result.returncode == case.code, f"{case.name}: exit {result.returncode}\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr
    if case.code != 0:
        line = error_line(result.stderr)
        assert case.fragment in line, f"{case.name}: {line!r}"
        assert line.count("Fix:") == 1, line
        assert len([ln for ln in result.stderr.splitlines() if ln.startswith("error:")]) == 1
        assert not (tmp_path / "artifacts").exists()
        out = case.out or tmp_path / "out"
        if not case.output_allowed:
            assert not out.exists() or not any(out.iterdir()), f"{case.name}: left {list(out.iterdir())}"
        leftovers = [p.name for p in out.parent.glob(f".{out.name}.partial-*")] if out.parent.exists() else []
        assert leftovers == [], f"{case.name}: staging left behind: {leftovers}"
        if "a second convert" not in case.name:  # a refused run leaves no lock file (one another run holds stays)
            assert not (out.parent / f".{out.name}.lock").exists(), f"{case.name}: lock file left behind"
    else:
        assert (tmp_path / "out" / "manifest.json").is_file()


def test_nan_weights_are_a_warning_and_a_reference_they_reach_fails_every_candidate(assets, tmp_path):
    """nonfinite_weights = "warn" (the default) goes on with a warning; this NaN reaches every output, so the
    float64 reference holds NaN there and the gate fails closed (it once passed: every bar was infinite)."""
    import json

    from exporter.testing.error_cases import _with_nan, convert

    case_argv = convert(_with_nan(assets, tmp_path), tmp_path)
    result = run(Case("NaN weights", "checkpoint", case_argv, 3, "", output_allowed=True), cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr and "warning:" in result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any("transformer.h.0.mlp.c_fc.weight" in w for w in report["warnings"])
    for variant in [report["rewritten"], *report["artifacts"]]:
        assert variant["status"] == "numerics_failed"
        assert "the float64 reference holds" in variant["numerics"]["failures"][0]["reason"]
