"""ONNX generation programs: a prefill and a decode model that take the cache and return it updated.

ONNX has no in-place update of an input, so the ONNX programs are the step in the form Hugging Face Optimum's
``text-generation-with-past`` exports use: the static cache goes in as ``past_key_values.{layer}.key`` /
``.value`` ``[B, kv_heads, C, head_dim]`` and comes out updated as ``present.{layer}.key`` / ``.value`` (the
whole static cache, the step's positions written), beside ``logits`` ``[B, vocab]``. The other inputs are
``DecoderStep``'s: ``input_ids [B, q]``, ``padding_mask [B, C]``, ``cache_position [q]``; the mask the step
builds is additive with the dtype's lowest finite value, so a fully masked row (left padding) stays finite
whatever onnxruntime's ``Attention`` does with a row of ``-inf``.

``PastStep`` is that functional form of ``DecoderStep`` (it updates copies of the cache); it is exported like
the other programs (``programs.export_steps``), translated by the dynamo ONNX exporter (SDPA becomes ONNX
``Attention`` at opset 23) and checked with ``onnx.checker``. Files: ``prefill.onnx``, ``decode.onnx`` and
``generation.onnx.data``, the weights of both once (each model's initializers point into it).

``OnnxStep`` runs one with onnxruntime behind ``DecoderStep``'s in-place signature (it copies ``present`` into
the caller's cache), so the driver, the judge, the timing, ``exporter generate`` and ``exporter verify`` treat
it as any other target. Built for CPU recipes in float32: onnxruntime's CPU provider has no bfloat16 kernels,
and on a GPU recipe this onnxruntime has no CUDA provider (``refusal`` says which).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

FILES = ("prefill.onnx", "decode.onnx")
WEIGHTS = "generation.onnx.data"  # the weights of both ONNX programs, once


def refusal(device: str, dtype: str) -> str | None:
    """Why the ONNX programs cannot be built and run here for a recipe at ``device``/``dtype`` (None: they can)."""
    if not device.startswith("cpu"):
        return ("not built for text-generation on a GPU recipe: this onnxruntime has no CUDA execution provider, "
                "so the ONNX programs could not be run and checked here (convert with a CPU float32 recipe, "
                "e.g. cpu-fp32, for ONNX generation programs)")
    if dtype != "float32":
        return (f"not built for text-generation in {dtype}: onnxruntime's CPU provider has no {dtype} kernels "
                "for these programs (convert with runtime.dtype=float32)")
    return None


def input_names(layers: int) -> list[str]:
    past = [f"past_key_values.{layer}.{part}" for layer in range(layers) for part in ("key", "value")]
    return ["input_ids", "padding_mask", "cache_position", *past]


def output_names(layers: int) -> list[str]:
    return ["logits", *[f"present.{layer}.{part}" for layer in range(layers) for part in ("key", "value")]]


class PastStep(nn.Module):
    """``DecoderStep`` without in-place inputs: it updates copies of the cache and returns them after the
    logits (the form ONNX can express)."""

    def __init__(self, step: nn.Module):
        super().__init__()
        self.step = step

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor, cache_position: torch.Tensor,
                kv: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        present = [t.clone() for t in kv]
        logits = self.step(input_ids, padding_mask, cache_position, present)
        return (logits, *present)


def build(prefill: Any, decode: Any, layers: int, staging: Path, opset: int) -> list[Path]:
    """Translate the two exported ``PastStep`` programs to ONNX in ``staging``, one weights file for both;
    returns the files written."""
    import onnx  # noqa: PLC0415 - only the onnx target needs it

    from ..targets.onnx import optimize  # noqa: PLC0415

    paths = [staging / name for name in FILES]
    for program, path in zip((prefill, decode), paths):
        onnx_program = torch.onnx.export(program, (), dynamo=True, opset_version=opset,
                                         input_names=input_names(layers), output_names=output_names(layers),
                                         verbose=False, optimize=False)
        if onnx_program is None:  # only the legacy exporter returns nothing
            raise RuntimeError("torch.onnx.export returned no ONNX program")
        optimize(onnx_program)
        onnx_program.save(str(path), external_data=True)  # weights in <name>.data, written tensor by tensor
        del onnx_program
    data = staging / WEIGHTS
    share_weights(paths[0], paths[1], data)
    for path in paths:
        onnx.checker.check_model(str(path), full_check=True)
    return [*paths, data]


def attention_ops(path: Path) -> dict[str, int]:
    """``Attention`` (what SDPA becomes) and ``Softmax`` nodes in an ONNX model's graph."""
    import onnx  # noqa: PLC0415

    count = collections.Counter(node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node)
    return {"sdpa": count.get("Attention", 0), "softmax": count.get("Softmax", 0)}


def share_weights(prefill: Path, decode: Path, data: Path) -> None:
    """Make ``data`` the one weights file of both models: the prefill's own external data becomes ``data``,
    and each decode initializer that holds the same bytes under the same name points at the prefill's copy.
    One that differs (a constant traced differently) is kept inside ``decode`` itself."""
    import onnx  # noqa: PLC0415
    from onnx.external_data_helper import uses_external_data  # noqa: PLC0415

    folder = prefill.parent
    first = onnx.load(str(prefill), load_external_data=False)
    os.replace(prefill.with_name(prefill.name + ".data"), data)
    where: dict[str, tuple[Any, dict[str, str]]] = {}
    for tensor in first.graph.initializer:
        if uses_external_data(tensor):
            entries = {e.key: e.value for e in tensor.external_data}
            entries["location"] = data.name
            _set_external(tensor, entries)
            where[tensor.name] = (tensor, entries)
    onnx.save(first, str(prefill))
    second = onnx.load(str(decode), load_external_data=False)
    own = decode.with_name(decode.name + ".data")
    for tensor in second.graph.initializer:
        if not uses_external_data(tensor):
            continue
        entries = {e.key: e.value for e in tensor.external_data}
        mine = _read(folder / entries["location"], entries)
        known = where.get(tensor.name)
        if known is not None and list(known[0].dims) == list(tensor.dims) \
                and known[0].data_type == tensor.data_type and _read(data, known[1]) == mine:
            _set_external(tensor, known[1])
        else:
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
            tensor.raw_data = mine
    onnx.save(second, str(decode))
    own.unlink(missing_ok=True)


def _set_external(tensor: Any, entries: dict[str, str]) -> None:
    del tensor.external_data[:]
    for key, value in entries.items():
        item = tensor.external_data.add()
        item.key, item.value = key, value


def _read(path: Path, entries: dict[str, str]) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(int(entries.get("offset", 0)))
        length = entries.get("length")
        return handle.read(int(length)) if length is not None else handle.read()


class OnnxStep:
    """One ONNX program run by onnxruntime (CPU provider) with ``DecoderStep``'s signature: the updated cache it
    returns is copied into the caller's tensors."""

    def __init__(self, path: Path):
        import onnxruntime as ort  # noqa: PLC0415

        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def __call__(self, input_ids: torch.Tensor, padding_mask: torch.Tensor, cache_position: torch.Tensor,
                 kv: list[torch.Tensor]) -> torch.Tensor:
        values = (input_ids, padding_mask, cache_position, *kv)
        feed = {name: t.detach().cpu().contiguous().numpy() for name, t in zip(self.names, values)}
        logits, *present = self.session.run(None, feed)
        for tensor, updated in zip(kv, present):
            tensor.copy_(torch.from_numpy(updated))
        return torch.from_numpy(logits)


__all__ = ["FILES", "WEIGHTS", "OnnxStep", "PastStep", "attention_ops", "build", "refusal", "share_weights"]
