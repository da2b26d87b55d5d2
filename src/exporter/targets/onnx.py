"""Target ``onnx``: the dynamo ONNX exporter, checked with ``onnx.checker``, run with onnxruntime.

At opset 23 and above SDPA becomes the ONNX ``Attention`` op. Inputs and
outputs carry the model's real names, and their dynamic dims the declared dims' names (``batch``,
``sequence``). Models over 256 MiB store their weights in
``model.onnx.data`` beside the graph: saving them inside the ``.onnx`` serialises the whole model in
memory (twice the weights, measured), external data is written tensor by tensor.

A GPU recipe needs onnxruntime's CUDA execution provider to run its ONNX model.
Without it (``onnx_dtype = "auto"``) the target is skipped, with the reason in the
report: a release gets no ONNX artifact that nobody has run, rather than one checked
nowhere. ``onnx_dtype = "float32"`` builds a float32 ONNX model instead and checks it
on the CPU provider (its bar: the float32 eager model); that takes float32 copies of
the weights on the host, so above about 1.3 GiB of float32 weights it is skipped too.

For ``--task text-generation`` it writes the decoder's programs with the cache in and out (Optimum's
``-with-past`` layout), ``prefill.onnx`` and ``decode.onnx`` (:func:`build_decoder`, :func:`load_decoder`).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort
import onnxscript.optimizer
import torch
from onnx.external_data_helper import uses_external_data

from ..dtypes import torch_dtype
from ..measure.kernels import onnxruntime_hook
from ..modelio import cast_in_place, step_positions
from ..rewrite.onnx_attention_masks import expand_attention_masks
from .context import BuildContext, Built, DecoderPrograms
from .exported_program import export_module
from .spec import DecoderLoaded, Loaded, RunnerSpec, TargetSkipped

if TYPE_CHECKING:
    from .spec import BuildSettings

FILE = "model.onnx"
# A GPU recipe without onnxruntime's CUDA provider checks ONNX in float32 on the CPU: the export, the saved
# model and onnxruntime's session each hold a float32 copy of the weights; above this the target is skipped.
CPU_COPIES = 3
CPU_FALLBACK_BYTES = 4 * 2**30
# Above this, weights go to model.onnx.data: saving them inside the .onnx serialises the whole model in
# memory (twice the weights, measured), while external data is written tensor by tensor.
EXTERNAL_DATA_BYTES = 256 * 2**20


def choose_provider(device: str) -> str:
    available = ort.get_available_providers()
    if device.startswith("cuda") and "CUDAExecutionProvider" in available:
        return "CUDAExecutionProvider"
    return "CPUExecutionProvider"


@contextlib.contextmanager
def _float32_program(ctx: BuildContext):
    """Export the model again in float32 on the CPU, casting in place (no second copy) until the ONNX file is saved."""
    example = [(t.float() if t.is_floating_point() else t).cpu() for t in ctx.example]
    with cast_in_place(ctx.io, torch.float32, "cpu"):
        yield export_module(ctx.io, example, ctx.plan, [])


def optimize(onnx_program) -> None:
    """Constant folding and clean-up, without onnxscript's opset-23 fusions.

    torch's own ``optimize`` also fuses RMSNormalization, RotaryEmbedding and GQA
    patterns; with onnxscript 0.7 and onnxruntime 1.32 the fused RotaryEmbedding
    of a Llama model is rejected at run time ("cos_cache and sin_cache are
    expected to have the same shape as input x"), so those fusions are left out.
    SDPA still becomes ``Attention``: that happens when the graph is translated.
    """
    onnxscript.optimizer.optimize_ir(onnx_program.model)


@dataclass
class Placement:
    """Where and in which dtype the ONNX model is built and run, and what the report says about it."""

    device: str
    dtype: str
    in_float32: bool
    notes: list[str]


def refused_here(settings: BuildSettings) -> bool:
    """Whether :func:`placement` refuses the recipe's ONNX target on this machine whatever the model's size
    (a GPU recipe, no CUDA provider, ``onnx_dtype = "auto"``): no process will load it."""
    try:
        placement(settings.device, settings.dtype, choose_provider(settings.device), settings.targets.onnx_dtype, 0)
    except TargetSkipped:
        return True
    return False


def placement(device: str, dtype: str, provider: str, choice: str, float_values: int) -> Placement:
    """The ONNX model's device and dtype for a recipe at ``device``/``dtype``, given onnxruntime's ``provider``
    and the recipe's ``onnx_dtype`` (``choice``); raises TargetSkipped when it cannot be built and checked here.
    ``float_values``: the model's floating-point parameter and buffer values."""
    notes = []
    if provider == "CPUExecutionProvider" and device != "cpu":
        if choice == "auto":
            raise TargetSkipped(
                "this onnxruntime has no CUDA execution provider, so an ONNX model for this GPU recipe cannot be run "
                "and checked here: not built (no artifact ships unchecked). Install onnxruntime-gpu, or set "
                "targets.onnx_dtype = \"float32\" to build a float32 ONNX model and check it on the CPU")
        if CPU_COPIES * float_values * 4 > CPU_FALLBACK_BYTES:
            raise TargetSkipped(
                f"this onnxruntime has no CUDA execution provider, and checking the model on its CPU provider "
                f"instead would take float32 copies of {float_values * 4 / 2**30:.1f} GiB of weights in the export, "
                f"the saved model and the session (over {CPU_FALLBACK_BYTES / 2**30:.0f} GiB): not built, not "
                "validated. Install onnxruntime-gpu to build and check ONNX on the GPU, or export ONNX with a "
                "CPU recipe")
        device = "cpu"
        notes.append("no CUDA execution provider in this onnxruntime: validated and timed on the CPU")
    in_float32 = dtype != "float32" and (choice == "float32" or (choice == "auto"
                                                                 and provider == "CPUExecutionProvider"))
    if in_float32:
        notes.append(f"exported in float32: onnxruntime's CPU provider has no {dtype} kernels"
                     if choice == "auto" else "exported in float32, as the recipe asks")
        dtype = "float32"
    return Placement(device, dtype, in_float32, notes)


def name_dims(proto: onnx.ModelProto, dynamic: dict[str, dict[int, Any]]) -> dict[str, str]:
    """Give the exporter's symbolic dims (``s43``) the declared dims' names (``batch``) in the graph's inputs,
    outputs and value infos, expressions (``s43*s53``) included; returns the renaming."""
    renames: dict[str, str] = {}
    for value in proto.graph.input:
        axes = dynamic.get(value.name, {})
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if axis in axes and dim.dim_param:
                renames.setdefault(dim.dim_param, axes[axis].name)
    if not renames:
        return renames
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(renames, key=len, reverse=True)) + r")\b")
    for value in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = pattern.sub(lambda m: renames[m.group(1)], dim.dim_param)
    return renames


def pack_weights(proto: onnx.ModelProto, path: Path) -> None:
    """Write ``proto`` (whose initializers may point at external data beside ``path``) to ``path`` as one file
    with every weight inside, holding one tensor's bytes at a time.

    Protobuf merges a message that appears twice on the wire and concatenates repeated fields, so the file is
    the model without its initializers followed by one ``ModelProto(graph=GraphProto(initializer=[t]))`` per
    tensor: parsed, that is the whole model (``onnx.checker`` checks the result). ``onnx.save`` of the same
    model would hold the weights twice over (the message and its serialised bytes).
    """
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data  # noqa: PLC0415

    initializers = list(proto.graph.initializer)
    del proto.graph.initializer[:]
    staged = path.with_name(path.name + ".packing")
    with open(staged, "wb") as f:
        f.write(proto.SerializeToString())
        for tensor in initializers:
            if uses_external_data(tensor):
                load_external_data_for_tensor(tensor, str(path.parent))
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.DEFAULT
            f.write(onnx.ModelProto(graph=onnx.GraphProto(initializer=[tensor])).SerializeToString())
            tensor.ClearField("raw_data")
    proto.graph.initializer.extend(initializers)  # the caller's graph again (without the weights' bytes)
    staged.replace(path)


def build(ctx: BuildContext) -> list[Built]:
    t0 = time.perf_counter()
    provider = choose_provider(ctx.device)
    values = sum(t.numel() for t in list(ctx.io.parameters()) + list(ctx.io.buffers()) if t.is_floating_point())
    where = placement(ctx.device, ctx.dtype, provider, ctx.settings.targets.onnx_dtype, values)
    device, dtype, in_float32 = where.device, where.dtype, where.in_float32
    notes = where.notes if in_float32 else list(ctx.notes) + where.notes
    path = ctx.staging / FILE
    with (_float32_program(ctx) if in_float32 else contextlib.nullcontext(ctx.program)) as program:
        # onnxruntime's Attention rejects masks that broadcast over the query length: spell them out
        # (views only; the program's .pt2 and AOTI package are already written)
        expanded = expand_attention_masks(program)
        if expanded:
            notes.append(f"{expanded} attention mask(s) expanded over the query length for onnxruntime")
        onnx_program = torch.onnx.export(program, (), dynamo=True, opset_version=ctx.settings.targets.onnx_opset,
                                         input_names=list(ctx.plan.names), output_names=list(ctx.io.signature.outputs),
                                         verbose=False, optimize=False)
        if onnx_program is None:  # only the legacy exporter returns nothing
            raise RuntimeError("torch.onnx.export returned no ONNX program")
        optimize(onnx_program)
        size = sum(t.numel() * t.element_size() for t in program.state_dict.values())
        external = size > EXTERNAL_DATA_BYTES
        # always written with the weights apart, tensor by tensor: serialising them inside the graph's protobuf
        # took three times the weights in memory at once (MiniLM: +280 MiB); a small model's weights are then
        # streamed into model.onnx one tensor at a time (pack_weights)
        onnx_program.save(str(path), external_data=True)
        del onnx_program
    data = path.with_name(path.name + ".data")
    proto = onnx.load(str(path), load_external_data=False)
    renamed = name_dims(proto, ctx.plan.dynamic_axes())
    if not external:
        pack_weights(proto, path)
        data.unlink(missing_ok=True)
    elif renamed:
        onnx.save(proto, str(path))  # the graph only: weights in model.onnx.data stay where they are
    ops = collections.Counter(node.op_type for node in proto.graph.node)
    files = [path] + ([data] if external and data.exists() else [])
    graph = {"attention": ops.get("Attention", 0), "softmax": ops.get("Softmax", 0), "matmul": ops.get("MatMul", 0),
             "opset": next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None),
             "inputs": [i.name for i in proto.graph.input], "outputs": [o.name for o in proto.graph.output],
             "shapes": {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                        for v in [*proto.graph.input, *proto.graph.output]},
             "provider": provider, "dtype": dtype}
    del proto  # the checker loads the file itself
    onnx.checker.check_model(str(path), full_check=True)
    spec = RunnerSpec("onnx", "onnx", device, dtype, path=str(path), options=(("provider", provider),))
    return [Built("onnx", "onnx", spec, path, files, time.perf_counter() - t0, notes=notes, graph=graph)]


def load(spec: RunnerSpec) -> Loaded:
    if spec.option("past"):  # a decoder with past another tool exported (exporter check): its two steps
        return load_past_steps(spec)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(spec.file(), sess_options=options, providers=[spec.option("provider")])
    names = [i.name for i in session.get_inputs()]

    def call(args):
        feed = {name: np.ascontiguousarray(t.detach().cpu().numpy()) for name, t in zip(names, args)}
        return [torch.from_numpy(np.asarray(o)) for o in session.run(None, feed)]

    return Loaded(call, "cpu" if spec.option("provider") == "CPUExecutionProvider" else spec.device,
                  torch_dtype(spec.dtype), {"provider": spec.option("provider")},
                  hooks={"kernels": onnxruntime_hook(spec.file(), spec.option("provider"))})


# --------------------------------------------------------------------------- decoder programs
# ONNX has no in-place update of an input, so the decoder's programs are the step in the form Hugging Face Optimum's
# ``text-generation-with-past`` exports use: the static cache goes in as ``past_key_values.{layer}.key`` /
# ``.value`` ``[B, kv_heads, C, head_dim]`` and comes out updated as ``present.{layer}.key`` / ``.value`` (the whole
# static cache, the step's positions written), beside ``logits`` ``[B, vocab]``; the other inputs are
# ``DecoderStep``'s (``input_ids [B, q]``, ``padding_mask [B, C]``, ``cache_position [q]``). The two programs
# (``generation.programs.PastStep``, exported with the others) are translated by the dynamo exporter (SDPA becomes
# ONNX ``Attention`` at opset 23) into ``prefill.onnx`` and ``decode.onnx``, checked with ``onnx.checker``, with
# ``generation.onnx.data`` holding the weights of both once. ``OnnxStep`` runs one with onnxruntime behind
# ``DecoderStep``'s in-place signature (it copies ``present`` into the caller's cache). Built for CPU recipes in
# float32 (:func:`decoder_refusal` says why not elsewhere).

DECODER_WEIGHTS = "generation.onnx.data"  # the weights of both ONNX programs, once


def decoder_refusal(device: str, dtype: str) -> str | None:
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


def build_decoder(programs: DecoderPrograms, settings: BuildSettings, files: tuple[Path, ...]) -> list[Path]:
    """Translate the two programs with the cache in and out (``programs.past``) to ONNX, one weights file for
    both; returns the files written."""
    if programs.past is None:
        raise RuntimeError(f"the programs with the cache in and out could not be exported: {programs.past_error}")
    layers, opset = programs.layers, settings.targets.onnx_opset
    paths = list(files)
    names = programs.past_names or (input_names(layers), output_names(layers), input_names(layers),
                                    output_names(layers))
    for index, (program, path) in enumerate(zip(programs.past, paths)):
        onnx_program = torch.onnx.export(program, (), dynamo=True, opset_version=opset,
                                         input_names=names[2 * index], output_names=names[2 * index + 1],
                                         verbose=False, optimize=False)
        if onnx_program is None:  # only the legacy exporter returns nothing
            raise RuntimeError("torch.onnx.export returned no ONNX program")
        optimize(onnx_program)
        onnx_program.save(str(path), external_data=True)  # weights in <name>.data, written tensor by tensor
        del onnx_program
    data = paths[0].parent / DECODER_WEIGHTS
    share_weights(paths[0], paths[1], data)
    for path in paths:
        onnx.checker.check_model(str(path), full_check=True)
    return [*paths, data]


def decoder_attention(programs: DecoderPrograms, files: tuple[Path, ...]) -> dict[str, dict[str, int]]:
    """``Attention`` (what SDPA becomes) and ``Softmax`` nodes in each written program's graph."""
    return {label: _attention_ops(path) for label, path in zip(("prefill", "decode"), files)}


def _attention_ops(path: Path) -> dict[str, int]:
    count = collections.Counter(node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node)
    return {"sdpa": count.get("Attention", 0), "softmax": count.get("Softmax", 0)}


def share_weights(prefill: Path, decode: Path, data: Path) -> None:
    """Make ``data`` the one weights file of both models: the prefill's own external data becomes ``data``,
    and each decode initializer that holds the same bytes as one of the prefill's (under the same name, or under
    another: constant folding names a transposed weight by the node that made it, ``permute_8``, differently in
    each program) points at the prefill's copy. One that matches none is kept inside ``decode`` itself."""
    folder = prefill.parent
    first = onnx.load(str(prefill), load_external_data=False)
    os.replace(prefill.with_name(prefill.name + ".data"), data)
    where: dict[str, tuple[Any, dict[str, str]]] = {}
    by_content: dict[tuple[tuple[int, ...], int, str], dict[str, str]] = {}
    for tensor in first.graph.initializer:
        if uses_external_data(tensor):
            entries = {e.key: e.value for e in tensor.external_data}
            entries["location"] = data.name
            _set_external(tensor, entries)
            where[tensor.name] = (tensor, entries)
            digest = hashlib.sha256(_read(data, entries)).hexdigest()
            by_content.setdefault((tuple(tensor.dims), tensor.data_type, digest), entries)
    onnx.save(first, str(prefill))
    second = onnx.load(str(decode), load_external_data=False)
    own = decode.with_name(decode.name + ".data")
    for tensor in second.graph.initializer:
        if not uses_external_data(tensor):
            continue
        entries = {e.key: e.value for e in tensor.external_data}
        mine = _read(folder / entries["location"], entries)
        known = where.get(tensor.name)
        same = by_content.get((tuple(tensor.dims), tensor.data_type, hashlib.sha256(mine).hexdigest()))
        if known is not None and list(known[0].dims) == list(tensor.dims) \
                and known[0].data_type == tensor.data_type and _read(data, known[1]) == mine:
            _set_external(tensor, known[1])
        elif same is not None:
            _set_external(tensor, same)
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
    """One ONNX program run by onnxruntime (CPU provider) with ``DecoderStep``'s signature (or an encoder-decoder
    step's: its inputs in order, the cache last): the inputs the program declares are fed in order, and each
    cache tensor it returns (after the logits) is copied into the caller's tensor at the same place."""

    def __init__(self, path: Path):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def __call__(self, *args: Any) -> torch.Tensor:
        *inputs, kv = args
        values = (*inputs, *kv)
        feed = {name: t.detach().cpu().contiguous().numpy() for name, t in zip(self.names, values)}
        logits, *present = self.session.run(None, feed)
        for tensor, updated in zip(kv, present):
            tensor.copy_(torch.from_numpy(updated))
        return torch.from_numpy(logits)


def load_decoder(files: tuple[Path, ...]) -> DecoderLoaded:
    prefill, decode = (OnnxStep(path) for path in files)
    return DecoderLoaded(prefill, decode)


# --------------------------------------------------------------------------- a decoder with past (exporter check)


def load_past_steps(spec: RunnerSpec) -> Loaded:
    """The ONNX decoder with past behind the two steps' convention (``INPUTS`` in, :func:`output_names` out),
    run with onnxruntime; ``spec``'s ``past`` option: ``(layers, prefill file, merged)``."""
    from pathlib import Path  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    import onnxruntime as ort  # noqa: PLC0415

    from ..dtypes import torch_dtype  # noqa: PLC0415
    from ..targets.spec import Loaded  # noqa: PLC0415

    layers, prefill_name, merged = spec.option("past")  # the prompt's file lies beside the decode step's
    prefill_file = str(Path(spec.file()).with_name(prefill_name))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    provider = spec.option("provider")
    decode = ort.InferenceSession(spec.file(), sess_options=options, providers=[provider])
    prefill = decode if prefill_file == spec.file() else ort.InferenceSession(prefill_file, sess_options=options,
                                                                             providers=[provider])
    numpy_types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}

    def empty_cache(session, batch: int) -> dict[str, np.ndarray]:
        feeds = {}
        for entry in session.get_inputs():
            if entry.name.startswith("past_key_values."):
                shape = [batch if i == 0 else 0 if i == 2 else int(d) for i, d in enumerate(entry.shape)]
                feeds[entry.name] = np.zeros(shape, dtype=numpy_types.get(entry.type, np.float32))
        return feeds

    integer_types = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}

    def run(session, feeds: dict[str, Any]) -> dict[str, np.ndarray]:
        """One step: each feed the session takes, in the element type it declares (int32 ids, a bool mask)."""
        declared = {i.name: i.type for i in session.get_inputs()}
        given = {}
        for name, value in feeds.items():
            if name not in declared:
                continue
            array = np.asarray(value.cpu().numpy() if isinstance(value, torch.Tensor) else value)
            kind = integer_types.get(declared[name])
            given[name] = np.ascontiguousarray(array.astype(kind) if kind is not None else array)
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, given)))

    def step_outputs(found: dict[str, np.ndarray]) -> list[torch.Tensor]:
        tensors = [found["logits"]]
        for layer in range(layers):
            tensors += [found[f"present.{layer}.key"], found[f"present.{layer}.value"]]
        return [torch.from_numpy(np.asarray(t)) for t in tensors]

    def call(args: list[torch.Tensor]) -> list[torch.Tensor]:
        input_ids, mask, next_ids = args
        prompt, following, position = step_positions(mask)
        first = run(prefill, {"input_ids": input_ids, "attention_mask": mask, "position_ids": prompt,
                              **empty_cache(prefill, int(input_ids.shape[0])),
                              **({"use_cache_branch": np.array([False])} if merged else {})})
        cache = {f"past_key_values.{layer}.{part}": first[f"present.{layer}.{part}"]
                 for layer in range(layers) for part in ("key", "value")}
        second = run(decode, {"input_ids": next_ids, "attention_mask": following,
                              "position_ids": position, **cache,
                              **({"use_cache_branch": np.array([True])} if merged else {})})
        return step_outputs(first) + step_outputs(second)

    device = "cpu" if provider == "CPUExecutionProvider" else spec.device
    return Loaded(call, device, torch_dtype(spec.dtype), {"provider": provider})
