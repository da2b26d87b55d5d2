"""Chunked comparison: the same numbers as comparing whole tensors, without holding them whole."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from exporter.child import chunks
from exporter.numerics.compare import Accumulator, InFile, InMemory, rmse_of, safetensors_index
from exporter.numerics.tolerance import check_output, explain_bar, metrics, widened
from exporter.outdir import save_tensors


def accumulate(reference: torch.Tensor, candidate: torch.Tensor, size: int) -> Accumulator:
    accumulator = Accumulator(InMemory(reference))
    for piece in chunks(candidate, size):
        accumulator.add(piece)
    return accumulator


@pytest.mark.parametrize("size", [1, 7, 1000, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_metrics_equal_whole_tensor_metrics(size, dtype):
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(3, 17, 29, dtype=torch.float64, generator=generator)
    candidate = (reference + 1e-3 * torch.randn(reference.shape, dtype=torch.float64, generator=generator)).to(dtype)
    got = accumulate(reference, candidate, size).metrics()
    want = metrics(reference, candidate)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key


def test_nan_and_inf_are_counted_and_reported_as_whole_metrics_do():
    reference = torch.linspace(-1, 1, 101, dtype=torch.float64)
    candidate = reference.clone().float()
    candidate[5], candidate[60] = float("nan"), float("inf")
    accumulator = accumulate(reference, candidate, 13)
    assert int(accumulator.nonfinite) == 2
    got, want = accumulator.metrics(), metrics(reference, candidate)
    assert got.pop("ref_rms") == pytest.approx(want.pop("ref_rms"), rel=1e-12)  # summed in another order
    assert got == want and got["rmse"] == math.inf
    check = accumulator.check("y", 0, allowed=1.0)
    assert not check.passed and "2 NaN/Inf" in check.reason
    whole = check_output("y", 0, reference, reference.float(), candidate, 2.0, 1.0)
    assert whole.reason == check.reason


def test_the_verdict_matches_check_output():
    generator = torch.Generator().manual_seed(1)
    reference = torch.randn(64, 33, dtype=torch.float64, generator=generator)
    baseline = reference.to(torch.bfloat16)
    candidate = (reference * 1.01).to(torch.bfloat16)
    base = rmse_of(reference, baseline, chunk=100)
    assert base == pytest.approx(metrics(reference, baseline)["rmse"], rel=1e-12)
    whole = check_output("logits", 1, reference, baseline, candidate, 3.0, 1e-3)
    n = reference.numel()
    chunked = accumulate(reference, candidate, 50).check("logits", 1, widened(3.0, n) * base + 1e-3, base,
                                                           explain_bar(3.0, base, None, 1e-3, n))
    assert (chunked.passed, chunked.reason) == (whole.passed, whole.reason)
    assert chunked.rmse == pytest.approx(whole.rmse, rel=1e-12)


def test_integer_outputs_must_match_exactly_and_every_value_must_arrive():
    reference = torch.arange(100)
    assert accumulate(reference, reference.clone(), 9).check("ids", 0, 0.0).passed
    changed = reference.clone()
    changed[99] = 0
    assert accumulate(reference, changed, 9).check("ids", 0, 0.0).reason == "integer output differs"
    partial = Accumulator(InMemory(reference.double()))
    partial.add(reference[:50].double())
    assert "returned 50 of the reference's 100 values" in partial.check("ids", 0, 1.0).reason
    with pytest.raises(ValueError, match="runs past the reference"):
        partial.add(reference.double())


def test_the_streamed_safetensors_file_is_standard_and_read_slice_by_slice(tmp_path, monkeypatch):
    monkeypatch.setattr("exporter.outdir.WRITE_CHUNK_BYTES", 24)  # many slices per tensor
    generator = torch.Generator().manual_seed(2)
    samples = [[torch.randn(5, 7, dtype=torch.float64, generator=generator), torch.arange(6).reshape(2, 3),
                torch.randn(9, generator=generator).to(torch.bfloat16), torch.tensor([True, False, True])]
               for _ in range(2)]
    names = ("logits", "ids", "hidden", "mask")
    path = tmp_path / "outputs.safetensors"
    save_tensors(path, samples, names)
    loaded = load_file(str(path))  # the library's own reader accepts it
    for i, sample in enumerate(samples):
        for name, tensor in zip(names, sample):
            assert torch.equal(loaded[f"{i}.{name}"], tensor)
    index = safetensors_index(path)
    source = InFile(path, *index["1.logits"])
    assert source.shape == (5, 7) and torch.equal(source.flat(3, 20), samples[1][0].reshape(-1)[3:20])
    accumulator = Accumulator(source)
    for piece in chunks(samples[1][0].float(), 4):
        accumulator.add(piece)
    assert accumulator.metrics()["rmse"] == pytest.approx(metrics(samples[1][0], samples[1][0].float())["rmse"])


def test_a_reference_with_nan_fails_closed_whole_and_chunked():
    """transformers' eager attention gives NaN in float64 on a left-padded row (finfo.min overflows) while
    float32 is finite; a NaN reference made every bar infinite and let any candidate pass. Now it fails, and
    says the reference is what cannot judge."""
    reference = torch.linspace(-1, 1, 101, dtype=torch.float64)
    reference[10:20] = float("nan")
    good = torch.linspace(-1, 1, 101).float()
    for check in (check_output("logits", 0, reference, good, good, 2.0, 0.0, 1e-7),
                  accumulate(reference, good, 13).check("logits", 0, allowed=1.0)):
        assert not check.passed and "reference holds 10 NaN/Inf" in check.reason
    metrics_there = metrics(reference, good)
    assert metrics_there["ref_nonfinite"] == 10 and math.isfinite(metrics_there["rmse"])  # the rest is compared


def test_an_infinite_bar_fails():
    reference = torch.linspace(-1, 1, 101, dtype=torch.float64)
    check = accumulate(reference, reference.float(), 13).check("y", 0, allowed=math.inf, baseline_rmse=math.inf)
    assert not check.passed and "no finite bar" in check.reason
