"""``exporter generate OUT_DIR``: greedy generation from a built target of a ``--task text-generation`` folder."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import targets
from ..dtypes import torch_dtype
from ..errors import EnvironmentProblem, InputsError, UsageError
from .cache import CacheLayout
from .driver import Prompt, generate, load_steps
from .session import read_setup


def generate_tokens(out_dir: str | Path, target: str, prompts: list[list[int]], max_new_tokens: int | None = None,
                    ) -> list[list[int]]:
    """Greedy generation from a built target of a ``--task text-generation`` folder: the new tokens of each
    prompt (prompts of different lengths are left-padded into one batch)."""
    folder = Path(out_dir)
    if not (folder / "generation.json").is_file():
        raise UsageError(f"{folder} holds no generation programs (no generation.json)",
                         "convert with --task text-generation, and pass that output folder")
    setup, _ = read_setup(folder)
    if target not in targets.NAMES or not targets.get(target).decoder_built(folder):
        built = [t.name for t in targets.TARGETS if t.decoder_built(folder)]
        raise UsageError(f"target {target!r} has no decode program in {folder}",
                         f"choose one of the targets built there: {', '.join(built) or 'none'}")
    if not prompts or any(not p for p in prompts):
        raise InputsError("no prompt tokens given", "pass --input-ids 1,2,3 (repeat it for more rows)")
    layout = CacheLayout.from_dict(setup["layout"])
    bad = sorted({t for p in prompts for t in p if not 0 <= t < layout.vocab})
    if bad:
        raise InputsError(f"token id(s) {bad[:5]} outside the vocabulary (0..{layout.vocab - 1})",
                          "pass token ids of this model's tokenizer")
    if len(prompts) > setup["batch"]:
        raise InputsError(f"{len(prompts)} prompts; the programs take at most {setup['batch']} rows",
                          "pass fewer --input-ids, or convert with a larger generation.batch")
    new_tokens = max_new_tokens if max_new_tokens is not None else setup["new_tokens"]
    if new_tokens < 1:
        raise InputsError(f"--max-new-tokens {new_tokens} must be at least 1", "pass a positive count")
    length = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, tokens in enumerate(prompts):
        ids[row, length - len(tokens):] = torch.tensor(tokens)
        mask[row, length - len(tokens):] = 1
    device = setup["device"]
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EnvironmentProblem(f"{folder} was built for {device}; this machine has no usable GPU",
                                 "run exporter generate on a machine like the one that built it")
    steps = load_steps(target, folder, layout, setup["cache_length"], torch_dtype(setup["dtype"]), device)
    picked, _ = generate(steps, Prompt(ids, mask), new_tokens, keep_logits=False)
    return picked.tolist()


__all__ = ["generate_tokens"]
