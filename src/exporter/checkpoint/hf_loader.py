"""Load a Hugging Face architecture through transformers' own loader.

transformers renames and converts checkpoint keys between releases (a ViT saved
by one release stores ``encoder.layer.N.attention.attention.query`` while the
module holds ``layers.N.attention.q_proj``), ties weights and rebuilds
non-persistent buffers. ``from_pretrained(None, config=..., state_dict=...)`` does
all of that on the meta device from our memory-mapped tensors, and reports
missing, unexpected and mis-shaped keys, which we turn into one error.
"""

from __future__ import annotations

import collections
import os

import torch
import torch.nn as nn

from ..errors import ArchitectureError, CheckpointError
from .architecture import Architecture, implementations
from .files import Checkpoint
from .loader import LoadReport, listing


def checkpoint_float_dtype(checkpoint: Checkpoint) -> torch.dtype:
    counts = collections.Counter(i.dtype for i in checkpoint.entries.values() if i.dtype.is_floating_point)
    return counts.most_common(1)[0][0] if counts else torch.float32


def load_transformers(arch: Architecture, checkpoint: Checkpoint) -> tuple[nn.Module, LoadReport]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers  # noqa: PLC0415 - transformers is optional, and reads HF_HUB_OFFLINE when imported

    transformers.logging.set_verbosity_error()
    cls = getattr(transformers, arch.name)
    state_dict = dict(checkpoint.tensors())
    dtype = checkpoint_float_dtype(checkpoint)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # our own progress display reports the stage
    try:
        model, info = cls.from_pretrained(None, config=arch.hf_config, state_dict=state_dict,
                                          **implementations(cls), output_loading_info=True, dtype=dtype,
                                          ignore_mismatched_sizes=True)
    except CheckpointError:
        raise
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {checkpoint.path} does not fit {arch.name}: {first}",
                              "use the config.json the checkpoint was saved with") from None
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ArchitectureError(f"transformers could not build {arch.name} from {checkpoint.path} "
                                f"({type(exc).__name__}: {first})",
                                "check that config.json matches the weights") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    problems = []
    mismatched = info.get("mismatched_keys") or set()
    if mismatched:
        # reported, not reinitialised in silence: ignore_mismatched_sizes only makes transformers list them
        shown = [m if isinstance(m, str) else f"{m[0]} (checkpoint {list(m[1])}, model {list(m[2])})"
                 for m in mismatched]
        problems.append(f"{len(shown)} mis-shaped: {listing(sorted(shown))}")
    missing = info.get("missing_keys") or set()
    if missing:
        problems.append(f"{len(missing)} missing: {listing(sorted(missing))}")
    unexpected = info.get("unexpected_keys") or set()
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {listing(sorted(unexpected))}")
    errors = info.get("error_msgs") or []
    if errors:
        problems.append(f"load errors: {'; '.join(str(e).splitlines()[0] for e in errors[:3])}")
    if problems:
        raise CheckpointError(f"checkpoint {checkpoint.path} does not fit {arch.name}; " + "; ".join(problems),
                              "use the config.json the checkpoint was saved with")
    for param in model.parameters():
        param.requires_grad_(False)
    model.eval()
    report = LoadReport(loaded=len(state_dict))
    return model, report
