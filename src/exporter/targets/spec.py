"""The run contract: how a target's artifacts are described to, and loaded by, the process that runs them.

``Target`` declares an artifact kind once: its name, the module that builds and loads it, what it needs, and the
files it writes for a decoder's prefill and decode programs (``--task text-generation``). ``RunnerSpec`` is the
plain, picklable description from which another process loads a variant (the target's ``load`` returns
``Loaded``); ``load_decoder`` loads a decoder's two programs back (``DecoderLoaded``).
``prepare.ModelSource`` says how a process rebuilds the model itself from the checkpoint (the compile
variants). What a target is built from, in the convert process, is :mod:`exporter.targets.context`.

Nothing here imports torch or another exporter stage at module level, so the target list can be read by the
command line's help and by the recipe parser.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..errors import RunnerFailed

if TYPE_CHECKING:
    import torch

    from ..prepare import ModelSource


class TargetSkipped(Exception):
    """A target that cannot be built here, for a reason the report gives (not a failure of the run)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TargetsSection:
    """The recipe's ``[targets]`` table: which targets are built and how (the recipe's parser reads it)."""

    build: tuple[str, ...] = ("exported_program", "aoti", "onnx")
    compile_modes: tuple[str, ...] = ("default",)
    compile_dynamic: bool = False
    aoti_cuda_graph: bool = False  # also time (and judge) the AOTI package replayed from a CUDA graph
    onnx_opset: int = 23
    onnx_dtype: str = "auto"


@dataclass(frozen=True)
class BuildSettings:
    """What a target's build reads of a recipe (``Recipe.build_settings()``), as plain values."""

    device: str
    dtype: str
    attention_backend: str
    targets: TargetsSection


@dataclass(frozen=True)
class RunnerSpec:
    name: str  # the variant's name in the report
    target: str  # the target that knows how to load it
    device: str
    dtype: str
    path: str | None = None
    source: ModelSource | None = None
    options: tuple[tuple[str, Any], ...] = ()
    attention_backend: str = "auto"

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    def file(self) -> str:
        """The artifact's file, for a target whose variants have one."""
        if self.path is None:
            raise RunnerFailed(f"{self.name} has no artifact file to load")
        return self.path

    def model_source(self) -> ModelSource:
        """How to rebuild the model, for a variant built in its own process."""
        if self.source is None:
            raise RunnerFailed(f"{self.name} needs the checkpoint to rebuild the model, and its spec names none")
        return self.source


@dataclass
class Loaded:
    """What a target's loader returns: a callable over device tensors, and facts for the report."""

    call: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    device: str
    input_dtype: torch.dtype
    info: dict[str, Any] = field(default_factory=dict)  # plain data, sent back to the parent
    hooks: dict[str, Callable[..., Any]] = field(default_factory=dict)  # extra commands, e.g. a profiler


Step = Callable[..., Any]  # DecoderStep's signature: (input_ids, padding_mask, cache_position, kv) -> logits


@dataclass
class DecoderLoaded:
    """A decoder's two programs loaded back, callable with ``DecoderStep``'s signature."""

    prefill: Step
    decode: Step
    # a second instance of the decode program, for a CUDA graph to capture: an AOTInductor container whose run
    # was captured cannot run outside the graph again (its completion event was recorded in the capture)
    fresh_decode: Callable[[], Step] | None = None
    # the decode program of batch 1 where the target built one (``Target.decoder_one``), and a fresh instance of it
    decode_one: Step | None = None
    fresh_decode_one: Callable[[], Step] | None = None


@dataclass(frozen=True)
class Target:
    """One artifact kind. ``module`` defines ``build(BuildContext) -> list[Built]`` and, for a target whose
    artifacts can be run, ``load(RunnerSpec) -> Loaded``; a target with ``decoder`` files also defines
    ``build_decoder(DecoderPrograms, BuildSettings, files) -> list[Path]``, ``load_decoder(files) -> DecoderLoaded``
    and ``decoder_attention(DecoderPrograms, files)`` (``files``: its ``decoder`` files in the folder). The
    module is imported only when the target is used (building is :func:`exporter.targets.context.build`)."""

    name: str
    module: str
    describe: str
    requires: tuple[str, ...] = ()  # importable modules it needs
    needs_program: bool = False  # built from the torch.export program
    loadable: bool = True
    decoder: tuple[str, ...] = ()  # the prefill and decode programs' files, for --task text-generation
    decoder_note: str = "not available for text-generation"  # why there are none, where ``decoder`` is empty
    decoder_one: str = ""  # the file of its decode program of batch 1, where it builds one (generation.decode_batch_1)
    preload: bool = False  # its artifacts load with the compiler's libstdc++ preloaded where needed (toolchain)
    encoder_decoder: bool = False  # its ``decoder`` writer also takes an encoder-decoder's programs (cross-attention)
    quantized: bool = False  # built from an fp8-quantized model ([quantize] in a recipe; docs/quantization.md)
    compiler_on: tuple[str, ...] = ()  # the devices on which its build runs a C++ compiler (environment.check_compiler)
    # copies of the weights it writes: into the output folder, into the temporary folder (a compile's cache, a
    # load's extraction), and into the output folder as a decoder's programs (environment.check_space reads them)
    out_copies: float = 0.0
    temp_copies: float = 0.0
    decoder_copies: float = 0.0
    float32_copies: bool = False  # written in float32 where its runtime has no kernels for the recipe's dtype
    graph_temp_copies: float = 0.0  # more, when a CUDA-graph variant loads (extracts) its artifact once more

    def space(self, weight_bytes: int, dtype_bytes: int, decoder: bool = False,
              cuda_graph: bool = False) -> tuple[int, int]:
        """Bytes it writes into the output folder and into the temporary folder, for ``weight_bytes`` of weights
        stored ``dtype_bytes`` to a value (``cuda_graph``: the recipe also replays it from a CUDA graph)."""
        widen = 4 / dtype_bytes if self.float32_copies and dtype_bytes < 4 else 1.0
        out = (self.decoder_copies if decoder else self.out_copies) * widen
        temp = 0.0 if decoder else self.temp_copies + (self.graph_temp_copies if cuda_graph else 0.0)
        return int(weight_bytes * out), int(weight_bytes * temp)

    def implementation(self) -> Any:
        return importlib.import_module(self.module)

    def load(self, spec: RunnerSpec) -> Loaded:
        if not self.loadable:
            raise RuntimeError(f"target {self.name} cannot be loaded")
        return self.implementation().load(spec)

    def load_decoder(self, folder: Path) -> DecoderLoaded:
        """This target's prefill and decode programs in ``folder``, loaded (in the process that runs them)."""
        if not self.decoder:
            raise ValueError(f"no generation programs for target {self.name!r}")
        return self.implementation().load_decoder(self.decoder_files(folder))

    def decoder_refusal(self, device: str, dtype: str) -> str | None:
        """Why this target builds no decoder programs for a recipe at ``device``/``dtype`` here (None: it does)."""
        if not self.decoder:
            return self.decoder_note
        why = self.unavailable()
        if why is None and hasattr(self.implementation(), "decoder_refusal"):
            why = self.implementation().decoder_refusal(device, dtype)
        return why

    def decoder_files(self, folder: Path, one: bool | None = None) -> tuple[Path, ...]:
        """Its prefill and decode files in ``folder``, then its decode program of batch 1 where ``one`` (None: where
        ``folder`` holds one)."""
        if one is None:
            one = bool(self.decoder_one) and (folder / self.decoder_one).is_file()
        return tuple(folder / name for name in self.decoder) + ((folder / self.decoder_one,) if one else ())

    def decoder_built(self, folder: Path) -> bool:
        """Whether ``folder`` holds this target's prefill and decode programs."""
        return bool(self.decoder) and all((folder / name).is_file() for name in self.decoder)

    def unavailable(self) -> str | None:
        """Why the target cannot run here, or None."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            return f"{', '.join(missing)} not importable (install it to build this target)"
        return None
