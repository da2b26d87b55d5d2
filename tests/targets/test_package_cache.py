"""The AOTInductor package cache: a package compiled once is reused for the same program, weights and options,
and compiled again when any of them differs (a real compile, loaded back and run)."""

from __future__ import annotations

import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.linear(x))


def program(model: torch.nn.Module):
    return torch.export.export(model.eval(), (torch.randn(2, 8),))


def test_the_key_covers_the_graph_the_weights_and_the_options():
    from exporter.targets.package_cache import key

    torch.manual_seed(0)
    model = Tiny()
    first = key(program(model), {}, "cpu")
    assert key(program(model), {}, "cpu") == first  # exported again: the same program
    assert key(program(model), {"max_autotune": True}, "cpu") != first
    assert key(program(model), {}, "cpu", {"attention_backend": "math"}) != first
    with torch.no_grad():
        model.linear.bias[0] += 1e-3  # one value of one weight
    assert key(program(model), {}, "cpu") != first


def test_a_package_is_compiled_once_and_reused_and_the_header_kept_with_inductors_cache(tmp_path, monkeypatch):
    """Also: Inductor's precompiled C++ header is written under ``TORCHINDUCTOR_CACHE_DIR`` (which a convert's
    children share), not under the temporary folder (a child's own, removed when it ends)."""
    from torch._inductor import codecache

    from exporter.targets import aoti_loader
    from exporter.targets.package_cache import ENV, compile_package

    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(codecache, "_HEADER_DIR", codecache._HEADER_DIR)  # restored after the test
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", codecache._HEADER_LOCK_DIR)
    codecache._precompile_header.cache_clear()  # an earlier build in this process would not write it again
    torch.manual_seed(0)
    model = Tiny()
    exported = program(model)
    built, reused = tmp_path / "a.pt2", tmp_path / "b.pt2"
    # one dict for every build, as a generation's prefill and decode share theirs (torch replaces an empty one)
    options = {"aot_inductor.package_constants_in_so": True}
    assert compile_package(exported, built, options, "cpu") == "stored"
    assert options == {"aot_inductor.package_constants_in_so": True}, "the build changed the options handed to it"
    assert list((tmp_path / "inductor" / "precompiled_headers").glob("*.gch")), "no header in the cache folder"
    assert compile_package(program(model), reused, options, "cpu") == "reused"
    assert reused.read_bytes() == built.read_bytes()
    x = torch.randn(2, 8)  # the exported (static) shape
    expected = model(x)
    for path in (built, reused):
        out = aoti_loader.load_package(str(path))(x)
        out = out[0] if isinstance(out, (list, tuple)) else out
        torch.testing.assert_close(out, expected)
    with torch.no_grad():
        model.linear.weight.mul_(2)
    assert compile_package(program(model), tmp_path / "c.pt2", options, "cpu") == "stored"  # other weights: compiled
    assert len(list((tmp_path / "cache").glob("*.pt2"))) == 2
