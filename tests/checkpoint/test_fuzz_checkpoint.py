"""Fuzz the checkpoint reading path: whatever the bytes, only CheckpointError comes out, never a crash or hang.

A quick slice runs with the normal tests; the fuzz run (`pytest -m fuzz`, several thousand cases,
EXPORTER_FUZZ_EXAMPLES per strategy) is recorded in docs/errors.md.
"""

from __future__ import annotations

import faulthandler
import json
import os
import struct
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from exporter.checkpoint.files import open_checkpoint
from exporter.dtypes import BY_CODE
from exporter.errors import CheckpointError

QUICK = 60
FULL = int(os.environ.get("EXPORTER_FUZZ_EXAMPLES", "1500"))
WORK = Path(tempfile.mkdtemp(prefix="exporter-fuzz-"))


def _valid_file() -> bytes:
    path = WORK / "valid.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64),
               "c": torch.zeros(2, 2, dtype=torch.bfloat16)}, str(path), metadata={"format": "pt"})
    return path.read_bytes()


VALID = _valid_file()


OUTCOMES: dict[str, int] = {"loaded": 0, "CheckpointError": 0}


def read_everything(data: bytes, name: str = "fuzz.safetensors") -> None:
    """Open and read every tensor; anything but CheckpointError fails the test."""
    path = WORK / name
    path.write_bytes(data)
    faulthandler.dump_traceback_later(60, exit=True, file=sys.__stderr__)  # a hang kills the run loudly
    try:
        checkpoint = open_checkpoint(path)
        for _, tensor in checkpoint.tensors():
            tensor.float().sum() if tensor.dtype != torch.bool else tensor.any()
        OUTCOMES["loaded"] += 1
    except CheckpointError as exc:
        assert exc.exit_code == 2 and exc.message and "\n" not in exc.one_line()
        OUTCOMES["CheckpointError"] += 1
    finally:
        faulthandler.cancel_dump_traceback_later()


def pack(header_bytes: bytes, data: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header_bytes) if length is None else length) + header_bytes + data


raw_bytes = st.binary(max_size=600)


@st.composite
def mutated(draw):
    """A valid file with byte flips, truncation or splices."""
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "length"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif op == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "length" and len(data) >= 8:
            data[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
    return bytes(data)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=4), max_leaves=12)


@st.composite
def structured(draw):
    """Headers that look right: known and unknown dtypes, odd shapes and offsets, random data lengths."""
    header = {}
    for i in range(draw(st.integers(0, 4))):
        entry = {
            "dtype": draw(st.sampled_from(list(BY_CODE) + ["F128", "", "f32", 7])),
            "shape": draw(st.lists(st.integers(-3, 2**40), max_size=4) | json_values),
            "data_offsets": draw(st.lists(st.integers(-10, 2**64), min_size=0, max_size=3) | json_values),
        }
        if draw(st.booleans()):
            entry[draw(st.text(max_size=4))] = draw(json_values)
        header[draw(st.text(max_size=10)) or f"t{i}"] = entry
    if draw(st.booleans()):
        header["__metadata__"] = draw(json_values)
    body = json.dumps(header, allow_nan=True).encode()
    return pack(body, draw(st.binary(max_size=128)), draw(st.none() | st.integers(0, 2**64 - 1)))


@st.composite
def consistent(draw):
    """Well-formed headers with data that fits: these must load."""
    tensors, offset, header = [], 0, {}
    for i in range(draw(st.integers(1, 4))):
        code = draw(st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F64"]))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        nbytes = BY_CODE[code].itemsize
        for d in shape:
            nbytes *= d
        header[f"t{i}"] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        tensors.append(nbytes)
    return pack(json.dumps(header).encode(), draw(st.binary(min_size=offset, max_size=offset)))


def _check(strategy, examples):
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(strategy)
    def inner(data):
        read_everything(data)
    inner()


@pytest.mark.parametrize("strategy", [raw_bytes, mutated(), structured()], ids=["raw", "mutated", "structured"])
def test_quick_slice(strategy):
    _check(strategy, QUICK)


def test_consistent_files_load():
    @settings(max_examples=QUICK, deadline=None, database=None)
    @given(consistent())
    def inner(data):
        path = WORK / "ok.safetensors"
        path.write_bytes(data)
        checkpoint = open_checkpoint(path)
        assert len(dict(checkpoint.tensors())) == len(checkpoint.entries)
    inner()


def test_index_files():
    @settings(max_examples=QUICK, deadline=None, database=None)
    @given(json_values)
    def inner(value):
        folder = Path(tempfile.mkdtemp(dir=WORK))
        (folder / "model.safetensors").write_bytes(VALID)
        (folder / "model.safetensors.index.json").write_text(json.dumps(value))
        try:
            open_checkpoint(folder)
        except CheckpointError:
            pass
    inner()


@pytest.mark.fuzz
@pytest.mark.parametrize("strategy", [raw_bytes, mutated(), structured()], ids=["raw", "mutated", "structured"])
def test_fuzz_run(strategy, capsys):
    before = sum(OUTCOMES.values())
    _check(strategy, FULL)
    cases = sum(OUTCOMES.values()) - before
    with capsys.disabled():
        print(f"\nfuzz {strategy!r:.40}: {cases} cases; totals so far {OUTCOMES}")
    assert cases >= 0.9 * FULL
