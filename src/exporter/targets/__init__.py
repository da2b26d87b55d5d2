"""The export stage: one module per artifact kind, each declared once in :data:`TARGETS`, in build order.

Each target declares what it needs (``requires``: importable modules; ``needs_program``: the torch.export
program), the files of a decoder's prefill and decode programs it writes for ``--task text-generation``
(``decoder``; none, and why, in ``decoder_note``), and provides ``build`` (in the convert process, into the
staging folder) and ``load`` (in the process that runs it). The run contract is :mod:`exporter.targets.spec`,
what a target is built from :mod:`exporter.targets.context`; building them all, in this order, is
:func:`exporter.targets.build.build_targets`. This module imports no torch: the command line reads :data:`NAMES`
for its help and the recipe parser checks target names against it.
"""

from __future__ import annotations

from .spec import DecoderLoaded, Loaded, RunnerSpec, Target

TARGETS: tuple[Target, ...] = (
    Target("exported_program", "exporter.targets.exported_program", "torch.export program (.pt2)",
           needs_program=True, decoder=("prefill.pt2", "decode.pt2"), out_copies=1, decoder_copies=2,
           encoder_decoder=True, quantized=True),
    Target("aoti", "exporter.targets.aoti", "AOTInductor package (.pt2)", needs_program=True,
           decoder=("prefill.aoti.pt2", "decode.aoti.pt2"), decoder_one="decode1.aoti.pt2", preload=True,
           out_copies=1, temp_copies=2, graph_temp_copies=1, decoder_copies=1, encoder_decoder=True, quantized=True,
           compiler_on=("cpu", "cuda")),
    Target("onnx", "exporter.targets.onnx", "ONNX (dynamo exporter) run with onnxruntime",
           requires=("onnx", "onnxruntime", "onnxscript"), needs_program=True, decoder=("prefill.onnx", "decode.onnx"),
           out_copies=1, decoder_copies=1, float32_copies=True, encoder_decoder=True),
    Target("compile", "exporter.targets.compile", "torch.compile of the rewritten model (benchmark variant)",
           compiler_on=("cpu",),
           decoder_note="not built for text-generation: the AOTI decode replayed in a CUDA graph is the compiled "
                        "decode this run times"),
    Target("tensorrt", "exporter.targets.tensorrt", "Torch-TensorRT", requires=("torch_tensorrt", "tensorrt"),
           needs_program=True, loadable=False, out_copies=1),
)
NAMES: tuple[str, ...] = tuple(t.name for t in TARGETS)


def get(name: str) -> Target:
    for target in TARGETS:
        if target.name == name:
            return target
    raise KeyError(f"unknown target {name!r}; targets are {', '.join(NAMES)}")


def load_runner(spec: RunnerSpec) -> Loaded:
    """Load a variant in this process (called in the runner's child process)."""
    return get(spec.target).load(spec)


__all__ = ["TARGETS", "NAMES", "Target", "DecoderLoaded", "Loaded", "RunnerSpec", "get", "load_runner"]
