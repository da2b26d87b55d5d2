"""Every case of the error catalogue (tests/error_cases.py) through the real command line.

Each must exit with its documented code, print one `error:` line that names the problem (and a fix),
print no traceback, and leave no output folder and no staging folder behind.
"""

from __future__ import annotations

import pytest

from error_cases import CASES, error_line, make_assets, run


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
    else:
        assert (tmp_path / "out" / "manifest.json").is_file()


def test_nan_weights_warning_is_recorded(assets, tmp_path):
    import json

    build = next(c[2] for c in CASES if c[1].startswith("NaN weights (default"))
    case = build(tmp_path, assets)
    result = run(case, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any("transformer.h.0.mlp.c_fc.weight" in w for w in report["warnings"])
    assert "warning:" in result.stderr
