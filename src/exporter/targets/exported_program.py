"""Target ``exported_program``: a torch.export program, saved as ``model.pt2``.

The program is decomposed to core ATen with SDPA kept out of the table, so
attention stays one fused ``scaled_dot_product_attention`` node instead of
turning back into matmul + softmax (the default table decomposes it).

For ``--task text-generation`` it writes the decoder's two programs, ``prefill.pt2`` and ``decode.pt2``
(:func:`build_decoder`), and loads them back as modules (:func:`load_decoder`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.export import default_decompositions

from ..attention_backend import backend_context
from ..dtypes import torch_dtype
from ..errors import shorten
from ..measure.kernels import hook
from ..modelio import by_name, import_spec_types, named_call
from ..rewrite.graph_facts import count_graph_ops
from ..rewrite.transformers_masks import positions_from_model, trivial_masks_skipped
from .context import BuildContext, Built, DecoderPrograms
from .program_file import load_program
from .spec import DecoderLoaded, Loaded, RunnerSpec

if TYPE_CHECKING:
    from .spec import BuildSettings

FILE = "model.pt2"


def decomposition_table():
    table = default_decompositions()
    aten = torch.ops.aten
    for op in (aten.scaled_dot_product_attention.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):
        table.pop(op, None)
    return table


def export_program(ctx: BuildContext):
    return export_module(ctx.io, ctx.example, ctx.plan, ctx.notes, hints_first=ctx.device != "cpu")


def export_module(module, example, plan, notes: list[str], hints_first: bool = False):
    """torch.export ``module`` with the plan's dynamic dims (training IR; :func:`core_aten` decomposes it),
    inside ``trivial_masks_skipped`` (transformers builds no mask SDPA does not need).

    Named dims (``Dim("sequence", min, max)``) come first: they tie equal dims
    across inputs and name them in every artifact. Where torch rejects them over a
    guard it cannot prove for the whole range (seen on CUDA with torch 2.11:
    ``min(16*s, 32*s) == 16*s`` for a grouped-query model), the export is retried
    with ``Dim.DYNAMIC`` hints of the same range, and a note says so. On CUDA that
    happened for every model with a sequence dim, so there (``hints_first``) the
    hints are used at once instead of paying for a trace that fails: the program's
    signature is still checked against the declared ranges, and the shape grid runs it.
    """
    with trivial_masks_skipped(positions_from_model(module)):
        return _export_module(module, example, plan, notes, hints_first)


def called_by_keyword(program):
    """``program`` taking its inputs by name, in any order: ``model.pt2``'s ``.module()(**tokens)`` and the AOTI
    package compiled from it take a tokenizer's dict as it comes (torch records a positional export's call spec
    as positional only). The graph and its placeholders are unchanged; only the call spec and the example
    inputs the package is compiled from are recorded as keywords."""
    import torch.utils._pytree as pytree  # noqa: PLC0415

    signature = program._module_call_graph[0].signature
    args, kwargs = program.example_inputs
    names = signature.forward_arg_names if signature is not None else None
    if signature is None or kwargs or not names or len(names) != len(args):
        return program
    signature.in_spec = pytree.tree_structure(((), dict.fromkeys(names, 0)))
    program.example_inputs = ((), dict(zip(names, args)))
    return program


def _export_module(module, example, plan, notes: list[str], hints_first: bool = False):
    return called_by_keyword(_export_traced(module, example, plan, notes, hints_first))


def _export_traced(module, example, plan, notes: list[str], hints_first: bool = False):
    hinted = plan.export_dynamic_shapes(hints=True)
    if hints_first and hinted is not None:
        program = torch.export.export(module, tuple(example), dynamic_shapes=hinted, strict=False)
        notes.append("exported with Dim.DYNAMIC hints of the declared ranges (on CUDA named dims are refused over "
                     "guards torch cannot prove for the whole range)")
        return program
    try:
        program = torch.export.export(module, tuple(example), dynamic_shapes=plan.export_dynamic_shapes(),
                                      strict=False)
    except Exception as exc:
        if "Constraints violated" not in str(exc) or hinted is None:
            raise
        program = torch.export.export(module, tuple(example), dynamic_shapes=hinted, strict=False)
        notes.append("named dims were rejected by a guard torch could not prove over the declared range "
                     f"({shorten(str(exc), 160)}); exported with Dim.DYNAMIC hints of the same range")
    return program


def core_aten(ctx: BuildContext):
    """The exported program decomposed to core ATen with SDPA kept (what ``model.pt2`` holds and AOTInductor
    compiles), made once, on first need: an ONNX-only run never pays for it (the ONNX exporter decomposes
    the program with its own table)."""
    if ctx.decomposed is None:
        t0 = time.perf_counter()
        ctx.decomposed = ctx.program.run_decompositions(decomposition_table())
        ctx.decompose_s = time.perf_counter() - t0
    return ctx.decomposed


def build(ctx: BuildContext) -> list[Built]:
    t0 = time.perf_counter()
    program = core_aten(ctx)
    path = ctx.staging / FILE
    torch.export.save(program, str(path))
    spec = RunnerSpec("exported_program", "exported_program", ctx.device, ctx.dtype, path=str(path),
                      attention_backend=ctx.settings.attention_backend)
    graph: dict[str, Any] = dict(count_graph_ops(program.graph))
    graph["placeholders"] = [n.name for n in program.graph.nodes if n.op == "placeholder"
                             and n.name in ctx.plan.names]
    return [Built("exported_program", "exported_program", spec, path, [path],
                  time.perf_counter() - t0 + ctx.program_export_s, notes=list(ctx.notes), graph=graph)]


def load(spec: RunnerSpec) -> Loaded:
    import_spec_types(spec.option("imports"))  # a foreign program's ModelOutput types, registered first
    program = load_program(spec.file(), allow_pickle=bool(spec.option("pickle")))  # nothing unpickled unless allowed
    module = by_name(program.module())
    # a program another tool exported (exporter check): called by name, its outputs picked by name
    inner = named_call(module, spec.option("keywords"), spec.option("outputs"),
                       spec.option("positional", 0)) if spec.option("named") else None

    def call(args):
        with backend_context(spec.attention_backend, spec.device):
            return inner(args) if inner is not None else list(module(*args))

    return Loaded(call, spec.device, torch_dtype(spec.dtype), hooks={"kernels": hook(spec.device)})


def program_attention(program: Any) -> dict[str, int]:
    """SDPA and softmax nodes in a program's graph: what its attention runs as (and ``exporter::decode_attention`` and
    ``exporter::gemv`` nodes, where the decode program of batch 1 holds any)."""
    ops = count_graph_ops(program.graph_module.graph)
    found = {"sdpa": ops["sdpa"], "softmax": ops["softmax"]}
    for kernel in ("decode_attention", "decode_step_attention", "gemv"):
        if ops.get(kernel):
            found[kernel] = ops[kernel]
    return found


def build_decoder(programs: DecoderPrograms, settings: BuildSettings, files: tuple[Path, ...]) -> list[Path]:
    """``prefill.pt2`` and ``decode.pt2``: the two programs as exported (core ATen, SDPA kept)."""
    for program, path in zip((programs.prefill, programs.decode), files):
        torch.export.save(program, str(path))
    return list(files)


def load_decoder(files: tuple[Path, ...]) -> DecoderLoaded:
    prefill, decode = (load_program(path).module() for path in files)
    return DecoderLoaded(prefill, decode)


def decoder_attention(programs: DecoderPrograms, files: tuple[Path, ...]) -> dict[str, dict[str, int]]:
    """What each program runs its attention as (the decode program of batch 1 too where ``files`` names it)."""
    found = {"prefill": program_attention(programs.prefill), "decode": program_attention(programs.decode)}
    if len(files) > 2 and programs.decode_one is not None:
        found["decode_batch_1"] = program_attention(programs.decode_one)
    return found
