"""Model inputs: read from a file of real samples, or generated at the recipe's shapes with a fixed seed.

Generated inputs follow the model's config: token ids inside the vocabulary,
attention masks with real padding (every row after the first is padded at its
end), pixel values at the configured image size. For a custom factory the
recipe declares each input (``[[inputs.tensor]]``: name, shape in ints or dim
names, dtype, value range). A dim whose ``min < max`` is dynamic and becomes a
``torch.export.Dim``.

A samples file is a safetensors (or ``.npz``) file of named tensors: ``input_ids``
for one sample, or ``0.input_ids``, ``1.input_ids``... for several.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import load_file
from torch.export import Dim as ExportDim

from .checkpoint.files import read_header
from .dtypes import torch_dtype
from .errors import CheckpointError, InputsError
from .modelio import forward_parameters, is_transformers_model
from .recipe import Dim, InputsSection, TensorSpec


@dataclass
class InputPlan:
    """What the model takes: ordered specs, which axes are dynamic, and the samples."""

    specs: tuple[TensorSpec, ...]
    dims: tuple[Dim, ...]
    samples: list[dict[str, torch.Tensor]] = field(default_factory=list)
    source: str = "generated"  # or the samples file's path
    seed: int | None = 0
    notes: list[str] = field(default_factory=list)
    pad_token_id: int | None = None  # the config's padding token, for generated input_ids (and the shape grid)
    max_padding: int | None = None  # generated attention masks pad at most this many tokens (a sliding window)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def seeds(self) -> list[int] | None:
        """The seed of each generated sample (sample i uses seed + i); None for samples read from a file."""
        return None if self.seed is None else [self.seed + i for i in range(len(self.samples))]

    def dynamic_axes(self) -> dict[str, dict[int, Dim]]:
        by_name = {d.name: d for d in self.dims}
        axes: dict[str, dict[int, Dim]] = {}
        for spec in self.specs:
            for axis, entry in enumerate(spec.shape):
                if isinstance(entry, str) and by_name[entry].dynamic:
                    axes.setdefault(spec.name, {})[axis] = by_name[entry]
        return axes

    def export_dynamic_shapes(self, hints: bool = False) -> dict[str, dict[int, Any] | None] | None:
        """torch.export dynamic_shapes keyed by input name: one named Dim per recipe dim, or with
        ``hints`` a ``Dim.DYNAMIC`` range hint per axis."""
        axes = self.dynamic_axes()
        if not axes:
            return None
        made: dict[str, Any] = {}
        for dim in self.dims:
            if dim.dynamic:
                made[dim.name] = (ExportDim.DYNAMIC(min=dim.min, max=dim.max) if hints
                                  else ExportDim(dim.name, min=dim.min, max=dim.max))
        shapes: dict[str, dict[int, Any] | None] = {}
        for name in self.names:
            shapes[name] = {axis: made[d.name] for axis, d in axes.get(name, {}).items()} or None
        return shapes


# --------------------------------------------------------------------------- specs


def _config_get(config: Any, *names: str, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _text_config(config: Any) -> Any:
    """The config of a model's text part (CLIP's ``text_config``), or the config itself."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    return text if text is not None else config


def _vision_config(config: Any) -> Any:
    return getattr(config, "vision_config", None) or config


def infer_specs(model: nn.Module, section: InputsSection) -> tuple[TensorSpec, ...]:
    """The declared tensors, else specs inferred from a transformers model's config.

    Every input the forward needs is generated from what the config says: token ids (text, with the segment
    ``token_type_ids`` where the config has more than one type, as BERT's tokenizer returns them; and a decoder's
    ``decoder_input_ids`` on dim ``decoder_sequence``), ``pixel_values`` at the configured image size (a
    text-and-image model such as CLIP gets both), Whisper's ``input_features`` (``num_mel_bins`` x
    ``2 * max_source_positions`` frames: its encoder takes no other length) and raw audio ``input_values`` on
    dim ``audio``. Dims the recipe does not declare are derived by :func:`derived_dims`.
    """
    if section.tensors:
        return section.tensors
    if not is_transformers_model(model):
        raise InputsError("the model's inputs are not declared and cannot be inferred without a transformers config",
                          "declare them in the recipe ([[inputs.tensor]] with name, shape, dtype) or with --input")
    params = forward_parameters(model)
    config: Any = model.config
    batch = "batch" if section.dim("batch") else 1
    seq: int | str = "sequence" if section.dim("sequence") else 16
    specs: list[TensorSpec] = []
    decoder = "decoder_input_ids" in params and bool(getattr(config, "is_encoder_decoder", False))
    if "input_features" in params and decoder:
        mels = _config_get(config, "num_mel_bins")
        frames = _config_get(config, "max_source_positions")
        if not mels or not frames:
            raise InputsError(f"cannot generate input_features for {type(model).__name__}: its config has no "
                              "num_mel_bins or max_source_positions", "pass real samples with --inputs FILE")
        specs.append(TensorSpec("input_features", (batch, int(mels), 2 * int(frames)), "float32", -1.0, 1.0))
    elif "input_values" in params and "input_ids" not in params:
        specs.append(TensorSpec("input_values", (batch, "audio" if seq == "sequence" else 16000), "float32",
                                -1.0, 1.0))
    vocab = _config_get(config, "vocab_size") or getattr(_text_config(config), "vocab_size", None)
    if "input_ids" in params:
        if not vocab:
            raise InputsError(f"cannot generate input_ids for {type(model).__name__}: its config has no vocab_size",
                              "pass real samples with --inputs FILE")
        specs.append(TensorSpec("input_ids", (batch, seq), "int64", 0, int(vocab)))
        if "attention_mask" in params:
            specs.append(TensorSpec("attention_mask", (batch, seq), "int64", 0, 2))
        types = int(_config_get(config, "type_vocab_size", default=0) or 0)
        if "token_type_ids" in params and types > 1:  # the tokenizer hands these over; the artifact takes them
            specs.append(TensorSpec("token_type_ids", (batch, seq), "int64", 0, types))
    if "pixel_values" in params and (not specs or hasattr(config, "vision_config")):
        vision = _vision_config(config)
        size = _config_get(vision, "image_size", default=224)
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        channels = _config_get(vision, "num_channels", default=3)
        specs.append(TensorSpec("pixel_values", (batch, int(channels), int(height), int(width)), "float32",
                                -1.0, 1.0))
    if decoder and specs:
        if not vocab:
            raise InputsError(f"cannot generate decoder_input_ids for {type(model).__name__}: its config has no "
                              "vocab_size", "pass real samples with --inputs FILE")
        specs.append(TensorSpec("decoder_input_ids", (batch, "decoder_sequence" if seq == "sequence" else 8),
                                "int64", 0, int(vocab)))
    if specs:
        return tuple(specs)
    wanted = [n for n in params if n not in ("self", "kwargs")][:3]
    raise InputsError(f"cannot generate inputs for {type(model).__name__} (its forward takes {', '.join(wanted)})",
                      "declare them in the recipe ([[inputs.tensor]]) or pass real samples with --inputs FILE")


def _audio_samples(config: Any, frames: int) -> int:
    """The fewest raw samples from which a wav2vec2-style feature encoder makes ``frames`` frames."""
    kernels = tuple(getattr(config, "conv_kernel", ()) or ())
    strides = tuple(getattr(config, "conv_stride", ()) or ())
    length = max(1, frames)
    for kernel, stride in reversed(list(zip(kernels, strides))):
        length = (length - 1) * int(stride) + int(kernel)
    return length


def derived_dims(model: nn.Module, specs: tuple[TensorSpec, ...], dims: tuple[Dim, ...]) -> tuple[
        tuple[Dim, ...], list[str]]:
    """The recipe's dims plus those the generated inputs use and the recipe does not declare, from the config.

    ``decoder_sequence`` (an encoder-decoder's target tokens) takes the sequence dim's range with half its typical
    size; ``audio`` (raw samples) spans as many samples as the feature encoder needs for the sequence dim's range
    of frames. A recipe that declares either keeps its own.
    """
    declared = {d.name for d in dims}
    used = {e for s in specs for e in s.shape if isinstance(e, str)}
    seq = next((d for d in dims if d.name == "sequence"), None)
    added, notes = [], []
    if seq is not None and "decoder_sequence" in used - declared:
        added.append(Dim("decoder_sequence", max(1, seq.size // 2), 1, seq.max))
        notes.append(f"inputs.dims.decoder_sequence: not declared; decoder_input_ids take 1..{seq.max} tokens "
                     f"(the sequence dim's maximum), typical {max(1, seq.size // 2)}")
    if seq is not None and "audio" in used - declared:
        config = getattr(model, "config", None)
        low, size, high = (_audio_samples(config, n) for n in (max(seq.min, 2), seq.size, seq.max))
        added.append(Dim("audio", size, low, high))
        notes.append(f"inputs.dims.audio: not declared; input_values take {low}..{high} samples (typical {size}): "
                     f"the feature encoder's {max(seq.min, 2)}..{seq.max} frames, the sequence dim's range")
    fixed = [s for s in specs if s.name == "input_features" and all(isinstance(e, int) for e in s.shape[1:])]
    for spec in fixed:
        notes.append(f"input {spec.name}: fixed at {spec.shape[1]} mel bins x {spec.shape[2]} frames, "
                     "2 x max_source_positions (the encoder takes no other length)")
    return dims + tuple(added), notes


def check_dims_declared(specs: tuple[TensorSpec, ...], dims: tuple[Dim, ...]) -> None:
    names = {d.name for d in dims}
    for spec in specs:
        for entry in spec.shape:
            if isinstance(entry, str) and entry not in names:
                raise InputsError(f"input {spec.name} uses dim {entry!r}, which the recipe does not declare",
                                  f"add {entry} to [inputs.dims] or use an integer size")


def concrete_shape(spec: TensorSpec, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(sizes[e] if isinstance(e, str) else int(e) for e in spec.shape)


# --------------------------------------------------------------------------- generation


def generate_sample(specs: tuple[TensorSpec, ...], sizes: dict[str, int], seed: int,
                    pad_token_id: int | None = None, max_padding: int | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sample: dict[str, torch.Tensor] = {}
    for spec in specs:
        shape = concrete_shape(spec, sizes)
        dtype = torch_dtype(spec.dtype)
        if spec.name == "attention_mask" and len(shape) == 2:
            sample[spec.name] = padding_mask(shape[0], shape[1], dtype, max_padding)
        elif dtype == torch.bool:
            sample[spec.name] = torch.randint(0, 2, shape, generator=gen).bool()
        elif not dtype.is_floating_point:
            sample[spec.name] = torch.randint(int(spec.low), int(spec.high), shape, generator=gen, dtype=dtype)
        else:
            value = torch.rand(shape, generator=gen, dtype=torch.float64) * (spec.high - spec.low) + spec.low
            sample[spec.name] = value.to(dtype)
    mask = sample.get("attention_mask")
    ids = sample.get("input_ids")
    if mask is not None and ids is not None and pad_token_id is not None and ids.shape == mask.shape:
        sample["input_ids"] = torch.where(mask.bool(), ids, torch.full_like(ids, int(pad_token_id)))
    positions = sample.get("position_ids")
    if positions is not None and positions.dim() == 2 and not positions.is_floating_point():
        # the model's own default: 0, 1, ... along the real tokens (after the padding mask's cumulative sum)
        if mask is not None and mask.shape == positions.shape:
            counted = mask.to(torch.int64).cumsum(-1) - 1
            sample["position_ids"] = counted.clamp(min=0).to(positions.dtype)
        else:
            sample["position_ids"] = torch.arange(positions.shape[1], dtype=positions.dtype).expand_as(positions)
    return sample


def padding_mask(batch: int, seq: int, dtype: torch.dtype = torch.int64,
                 max_padding: int | None = None) -> torch.Tensor:
    """Row 0 is full; row i > 0 keeps a shrinking prefix (right padding), never fewer than one token, and pads at
    most ``max_padding`` tokens when given."""
    mask = torch.ones(batch, seq, dtype=dtype)
    for row in range(1, batch):
        padding = max(1, (seq * row) // (batch + 1))
        if max_padding is not None:
            padding = min(padding, max(1, max_padding))
        keep = max(1, seq - padding)
        mask[row, keep:] = 0
    return mask


def position_offset(model: nn.Module, positions: int) -> int:
    """How many position embeddings come before the first token's: ``padding_idx + 1`` where the position
    table (``max_position_embeddings`` rows) has a padding index, as RoBERTa's does; else 0."""
    for name, module in model.named_modules():
        if (isinstance(module, nn.Embedding) and "position" in name.rsplit(".", 1)[-1]
                and module.num_embeddings == positions and module.padding_idx is not None):
            return int(module.padding_idx) + 1
    return 0


def _position_limits(model: nn.Module) -> dict[str, tuple[int, str]]:
    """For each generated token input, how many positions the model has for it and which config field says so."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    limits: dict[str, tuple[int, str]] = {}
    text = _text_config(config)
    for owner, label in ((config, ""), (text, "text_config.")):
        limit = getattr(owner, "max_position_embeddings", None)
        if isinstance(limit, int) and limit > 0:
            limits.setdefault("input_ids", (limit, f"{label}max_position_embeddings"))
    decoder = getattr(config, "max_target_positions", None)
    if isinstance(decoder, int) and decoder > 0:
        limits["decoder_input_ids"] = (decoder, "max_target_positions")
    elif "input_ids" in limits and getattr(config, "is_encoder_decoder", False):
        limits["decoder_input_ids"] = limits["input_ids"]
    return limits


def position_limit(model: nn.Module, name: str = "input_ids") -> tuple[int, str] | None:
    """How many tokens the generated input ``name`` may hold in ``model`` (its positions, less those before the
    first token's), and which config field says so; None where the config does not say."""
    found = _position_limits(model).get(name)
    if found is None:
        return None
    limit, source = found
    offset = position_offset(model, limit)
    return limit - offset, source


def within_positions(model: nn.Module, specs: tuple[TensorSpec, ...], dims: tuple[Dim, ...]) -> tuple[
        tuple[Dim, ...], list[str]]:
    """The dims, with the sequence dim of generated token ids narrowed to the model's position limit.

    A recipe serves many models; a transformers config says how many positions its model has
    (``max_position_embeddings``, GPT-2's ``n_positions``, a text tower's, a decoder's ``max_target_positions``).
    Past it a position-embedding lookup reads out of bounds: an error on the CPU, a device-side assert on a GPU
    that leaves the whole process unable to use it. So the dim is narrowed to the model's limit, and the report
    says so. A model whose positions start after its padding index (RoBERTa and its kind: ``padding_idx + 1``
    onwards) takes that many fewer tokens.
    """
    limits = _position_limits(model)
    narrowed = {d.name: d for d in dims}
    notes = []
    for spec in specs:
        if spec.name not in limits or len(spec.shape) < 2 or not isinstance(spec.shape[-1], str):
            continue
        limit, source = limits[spec.name]
        offset = position_offset(model, limit)
        limit -= offset
        if offset:
            source += f" less the {offset} positions before the first token's (positions start after the padding index)"
        dim = narrowed.get(spec.shape[-1])
        if dim is None or dim.max <= limit:
            continue
        new = Dim(dim.name, min(dim.size, limit), min(dim.min, limit), limit)
        notes.append(f"inputs.dims.{dim.name}: max {dim.max} narrowed to {limit}, the model's "
                     f"{source}" + (f" (size {dim.size} -> {new.size})" if new.size != dim.size else ""))
        narrowed[dim.name] = new
    return tuple(narrowed[d.name] for d in dims), notes


def sliding_window(model: nn.Module) -> tuple[int | None, str]:
    """How many tokens generated padding may take so that every padded token still has a real one in its attention
    window: half of a sliding window (``sliding_window``, ModernBERT's ``local_attention``); None without one.

    A padded token whose window holds only padding has no key to attend to: the model's own softmax is then taken
    over nothing but masked scores and its float64 output is NaN there, which no artifact can be judged against.
    """
    config = getattr(model, "config", None)
    for field_name in ("sliding_window", "local_attention"):
        window = getattr(config, field_name, None)
        if isinstance(window, int) and not isinstance(window, bool) and window > 1:
            return window // 2, f"{field_name} = {window}"
    return None, ""


def check_given_dims(specs: tuple[TensorSpec, ...], given: tuple[str, ...]) -> None:
    """A dim named with ``--dim`` that no input uses is a typo or a misunderstanding: refused before any work."""
    import difflib  # noqa: PLC0415

    used = sorted({e for s in specs for e in s.shape if isinstance(e, str)})
    for name in given:
        if name not in used:
            close = difflib.get_close_matches(name, used, n=1)
            hint = f"write --dim {close[0]}=SIZE[:MIN:MAX] (the name the inputs use)" if close else \
                f"name one of the dims the inputs use ({', '.join(used) or 'none: every size is fixed'})"
            raise InputsError(f"--dim {name} names no dim of the model's inputs (they use {', '.join(used) or 'none'})",
                              hint)


def plan_inputs(model: nn.Module, section: InputsSection, samples_file: str | Path | None = None) -> InputPlan:
    specs = infer_specs(model, section)
    check_given_dims(specs, section.given)
    dims, notes = (section.dims, []) if section.tensors else derived_dims(model, specs, section.dims)
    check_dims_declared(specs, dims)
    if not section.tensors:
        dims, position_notes = within_positions(model, specs, dims)
        notes += position_notes
    section = dataclasses.replace(section, dims=dims)
    plan = InputPlan(specs=specs, dims=dims, seed=section.seed, notes=notes)
    plan.pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    if not section.tensors and any(s.name == "attention_mask" for s in specs):
        plan.max_padding, window = sliding_window(model)
        if plan.max_padding is not None:
            plan.notes.append(f"generated padding kept to at most {plan.max_padding} tokens per row: the model's "
                              f"{window} (a padded token with only padding in its window has nothing to attend to)")
    if samples_file is not None:
        plan.samples = read_samples(Path(samples_file), specs, section.dims)
        plan.source = str(samples_file)
        plan.seed = None
        return plan
    sizes = {d.name: d.size for d in section.dims}
    plan.samples = [generate_sample(specs, sizes, section.seed + i, plan.pad_token_id, plan.max_padding)
                    for i in range(section.samples)]
    if any(s.name == "attention_mask" for s in specs) and sizes.get("batch", 1) < 2:
        plan.notes.append("batch size 1: the generated attention mask has no padding")
    return plan


# --------------------------------------------------------------------------- samples files

_INDEXED = re.compile(r"^(\d+)\.(.+)$")


def _read_named_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise InputsError(f"inputs file {path} does not exist", "check the path given to --inputs")
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as data:
                return {k: torch.from_numpy(data[k].copy()) for k in data.files}
        except Exception as exc:
            raise InputsError(f"inputs file {path} is not a readable .npz ({type(exc).__name__})",
                              "save it with numpy.savez") from None
    try:
        read_header(path)
        return load_file(str(path))
    except CheckpointError as exc:
        raise InputsError(f"inputs file {exc.message}", "save the samples with safetensors.torch.save_file") from None
    except Exception as exc:
        raise InputsError(f"inputs file {path} is not a readable safetensors file ({type(exc).__name__})",
                          "save the samples with safetensors.torch.save_file") from None


def read_samples(path: Path, specs: tuple[TensorSpec, ...], dims: tuple[Dim, ...]) -> list[dict[str, torch.Tensor]]:
    tensors = _read_named_tensors(path)
    groups: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = _INDEXED.match(key)
        index, name = (int(match.group(1)), match.group(2)) if match else (0, key)
        groups.setdefault(index, {})[name] = value
    if not groups:
        raise InputsError(f"inputs file {path} holds no tensors", "save at least one sample")
    expected = [s.name for s in specs]
    by_dim = {d.name: d for d in dims}
    samples = []
    for index in sorted(groups):
        group = groups[index]
        label = f"sample {index} of {path.name}"
        missing = [n for n in expected if n not in group]
        extra = [n for n in group if n not in expected]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(missing)}")
            if extra:
                parts.append(f"unexpected {', '.join(extra)}")
            raise InputsError(f"{label}: {'; '.join(parts)} (the model takes {', '.join(expected)})",
                              "name the tensors after the model's inputs")
        sample = {}
        for spec in specs:
            value = group[spec.name]
            want = torch_dtype(spec.dtype)
            if (value.is_floating_point() != want.is_floating_point
                    or (value.dtype == torch.bool) != (want == torch.bool)):
                raise InputsError(f"{label}: {spec.name} has dtype {str(value.dtype).replace('torch.', '')}, "
                                  f"the model takes {spec.dtype}", f"save {spec.name} as {spec.dtype}")
            if value.dim() != len(spec.shape):
                raise InputsError(f"{label}: {spec.name} has {value.dim()} dims {list(value.shape)}, "
                                  f"the model takes {len(spec.shape)} {list(spec.shape)}",
                                  f"save {spec.name} with shape {list(spec.shape)}")
            for axis, entry in enumerate(spec.shape):
                size = value.shape[axis]
                if isinstance(entry, int) and size != entry:
                    raise InputsError(f"{label}: {spec.name} has size {size} on axis {axis}, the model takes {entry}",
                                      f"save {spec.name} with shape {list(spec.shape)}")
                if isinstance(entry, str):
                    dim = by_dim[entry]
                    if not dim.min <= size <= dim.max:
                        raise InputsError(f"{label}: {spec.name} has {entry}={size} on axis {axis}, outside the "
                                          f"recipe's range {dim.min}..{dim.max}",
                                          f"widen inputs.dims.{entry} in the recipe")
            sample[spec.name] = value.to(want) if value.dtype != want else value
        samples.append(sample)
    return samples


def cast_sample(sample: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Floating inputs to ``dtype``, everything to ``device``, in sample order."""
    return [(v.to(dtype) if v.is_floating_point() else v).to(device) for v in sample.values()]
