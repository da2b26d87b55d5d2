"""``exporter generate OUT_DIR``: greedy generation from a built target of a generation folder: a decoder's
prompts (``--task text-generation``), an encoder-decoder's source token ids (``text2text-generation``) or a
speech model's features (``automatic-speech-recognition``)."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import targets
from ..errors import EnvironmentProblem, InputsError, UsageError
from .session import check_setup, family_for, read_setup


def generate_tokens(out_dir: str | Path, target: str, prompts: list[list[int]], max_new_tokens: int | None = None,
                    features: str | Path | None = None) -> list[list[int]]:
    """Greedy generation from a built target of a generation folder: the new tokens of each prompt (prompts of
    different lengths are left-padded into one batch; an encoder-decoder's sources right-padded), or of each row
    of a speech model's ``features`` file."""
    folder = Path(out_dir)
    if not (folder / "generation.json").is_file():
        raise UsageError(f"{folder} holds no generation programs (no generation.json)",
                         "convert with --task text-generation (or text2text-generation, automatic-speech-recognition), "
                         "and pass that output folder")
    check_setup(folder)
    setup, _ = read_setup(folder)
    if target not in targets.NAMES or not targets.get(target).decoder_built(folder):
        built = [t.name for t in targets.TARGETS if t.decoder_built(folder)]
        raise UsageError(f"target {target!r} has no decode program in {folder}",
                         f"choose one of the targets built there: {', '.join(built) or 'none'}")
    family = family_for(setup.get("task"))
    prompt = family.user_prompt(prompts, features, setup)
    if prompt.batch > setup["batch"]:
        raise InputsError(f"{prompt.batch} {family.rows}; the programs take at most {setup['batch']} rows",
                          f"pass fewer {family.rows}, or convert with a larger generation.batch")
    new_tokens = max_new_tokens if max_new_tokens is not None else setup["new_tokens"]
    if new_tokens < 1:
        raise InputsError(f"--max-new-tokens {new_tokens} must be at least 1", "pass a positive count")
    prompt.check_fits(new_tokens, setup["cache_length"])
    if setup["device"].startswith("cuda") and not torch.cuda.is_available():
        raise EnvironmentProblem(f"{folder} was built for {setup['device']}; this machine has no usable GPU",
                                 "run exporter generate on a machine like the one that built it")
    picked, _ = family.generate(family.load_steps(target, folder, setup), prompt, new_tokens, keep_logits=False)
    return picked.tolist()


__all__ = ["generate_tokens"]
