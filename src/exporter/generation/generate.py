"""``exporter generate OUT_DIR``: greedy generation from a built target of a generation folder: a decoder's
prompts (``--task text-generation``), an encoder-decoder's source token ids (``text2text-generation``) or a
speech model's features (``automatic-speech-recognition``)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from .. import targets
from ..errors import EnvironmentProblem, InputsError, UsageError, describe
from .cache import CacheLayout
from .driver import Prompt, check_fits
from .seq2seq import TASKS as SEQ2SEQ_TASKS
from .seq2seq import Seq2SeqLayout, Source
from .seq2seq import check_fits as seq2seq_check_fits
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
    seq2seq = setup.get("task") in SEQ2SEQ_TASKS
    prompt = _source(prompts, features, setup) if seq2seq else _prompt(prompts, features, setup)
    rows = int(prompt.mask.shape[0])
    if rows > setup["batch"]:
        raise InputsError(f"{rows} {'sources' if seq2seq else 'prompts'}; the programs take at most {setup['batch']} "
                          "rows", f"pass fewer {'rows' if seq2seq else '--input-ids'}, or convert with a larger "
                          "generation.batch")
    new_tokens = max_new_tokens if max_new_tokens is not None else setup["new_tokens"]
    if new_tokens < 1:
        raise InputsError(f"--max-new-tokens {new_tokens} must be at least 1", "pass a positive count")
    if isinstance(prompt, Prompt):
        check_fits(prompt, new_tokens, setup["cache_length"])
    else:
        seq2seq_check_fits(new_tokens, setup["cache_length"])
    if setup["device"].startswith("cuda") and not torch.cuda.is_available():
        raise EnvironmentProblem(f"{folder} was built for {setup['device']}; this machine has no usable GPU",
                                 "run exporter generate on a machine like the one that built it")
    family = family_for(setup.get("task"))
    picked, _ = family.generate(family.load_steps(target, folder, setup), prompt, new_tokens, keep_logits=False)
    return picked.tolist()


def _prompt(prompts: list[list[int]], features: str | Path | None, setup: dict) -> Prompt:
    """A decoder's prompts, left-padded into one batch."""
    if features is not None:
        raise InputsError("--input-features given to a decoder's folder", "pass --input-ids; features are for a "
                          "speech model converted with --task automatic-speech-recognition")
    _check_ids(prompts, CacheLayout.from_dict(setup["layout"]).vocab, "prompt")
    length = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, tokens in enumerate(prompts):
        ids[row, length - len(tokens):] = torch.tensor(tokens)
        mask[row, length - len(tokens):] = 1
    return Prompt(ids, mask)


def _check_ids(prompts: list[list[int]], vocab: int, what: str) -> None:
    if not prompts or any(not p for p in prompts):
        raise InputsError(f"no {what} tokens given", "pass --input-ids 1,2,3 (repeat it for more rows)")
    bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab})
    if bad:
        raise InputsError(f"token id(s) {bad[:5]} outside the vocabulary (0..{vocab - 1})",
                          "pass token ids of this model's tokenizer")


def _source(prompts: list[list[int]], features: str | Path | None, setup: dict) -> Source:
    """An encoder-decoder's sources: token ids right-padded into one batch, or a speech model's features."""
    layout = Seq2SeqLayout.from_dict(setup["layout"])
    if layout.speech:
        return _features_source(features, layout, prompts)
    if features is not None:
        raise InputsError("--input-features given to a text encoder-decoder", "pass the source as --input-ids")
    return _ids_source(prompts, layout, setup)


def _ids_source(prompts: list[list[int]], layout: Seq2SeqLayout, setup: dict) -> Source:
    _check_ids(prompts, layout.vocab, "source")
    length = max(len(p) for p in prompts)
    if length < 2 or length > setup["max_source"]:
        raise InputsError(f"a {length}-token source; the programs take 2 to {setup['max_source']} tokens",
                          "pass a source of that length")
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, tokens in enumerate(prompts):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    return Source(ids, mask)


def _features_source(features: str | Path | None, layout: Seq2SeqLayout, prompts: list[list[int]]) -> Source:
    want = "x".join(map(str, layout.source_shape))
    if prompts:
        raise InputsError("--input-ids given to a speech model", f"pass --input-features FILE.safetensors with one "
                          f"tensor [batch, {want}]")
    if features is None:
        raise InputsError("no source features given", f"pass --input-features FILE.safetensors with one tensor "
                          f"[batch, {want}]")
    try:
        tensors = load_file(str(features))
    except Exception as exc:
        raise InputsError(f"--input-features {features} is not a readable safetensors file ({describe(exc, 120)})",
                          "pass a file written by safetensors.torch.save_file") from None
    if len(tensors) != 1:
        raise InputsError(f"--input-features {features} holds {len(tensors)} tensors", "save exactly one tensor")
    (values,) = tensors.values()
    if values.dim() == 2:
        values = values[None]
    if tuple(values.shape[1:]) != tuple(layout.source_shape) or not values.is_floating_point():
        raise InputsError(f"--input-features holds {values.dtype} {list(values.shape)}; the programs take float "
                          f"[batch, {want}]", f"pass log-mel features of shape [batch, {want}]")
    return Source(values.float(), torch.ones(values.shape[0], layout.source_shape[1], dtype=torch.long))


__all__ = ["generate_tokens"]
