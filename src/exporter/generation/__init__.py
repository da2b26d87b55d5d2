"""Decoders that generate: ``exporter convert --task text-generation`` and ``exporter generate``.

- ``cache``: ``DecoderStep``, one forward over a static KV cache the caller owns (the decoder contract);
- ``programs``: the prefill and decode programs per target, built and loaded back;
- ``driver``: greedy generation (free or teacher-forced) from any pair of steps;
- ``reference``: the original model generating without a cache, float64, and the eager baseline;
- ``judge``: per-step verdicts and where tokens differ; ``bench``: prefill, decode, bandwidth;
- ``session``: one target judged and timed in its own process; ``run``: the convert itself.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputsError, UsageError


def generate_tokens(out_dir: str | Path, target: str, prompts: list[list[int]], max_new_tokens: int | None = None,
                    ) -> list[list[int]]:
    """Greedy generation from a built target of a ``--task text-generation`` folder: the new tokens of each
    prompt (prompts of different lengths are left-padded into one batch)."""
    import torch  # noqa: PLC0415

    from ..inputs import TORCH_DTYPES  # noqa: PLC0415
    from .cache import CacheLayout  # noqa: PLC0415
    from .driver import Prompt, generate  # noqa: PLC0415
    from .programs import FILES, load_steps  # noqa: PLC0415
    from .session import read_setup  # noqa: PLC0415

    folder = Path(out_dir)
    if not (folder / "generation.json").is_file():
        raise UsageError(f"{folder} holds no generation programs (no generation.json)",
                         "convert with --task text-generation, and pass that output folder")
    setup, _ = read_setup(folder)
    if target not in FILES or not all((folder / name).is_file() for name in FILES[target]):
        built = [t for t, names in FILES.items() if all((folder / n).is_file() for n in names)]
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
        from ..errors import EnvironmentProblem  # noqa: PLC0415

        raise EnvironmentProblem(f"{folder} was built for {device}; this machine has no usable GPU",
                                 "run exporter generate on a machine like the one that built it")
    steps = load_steps(target, folder, layout, setup["cache_length"], TORCH_DTYPES[setup["dtype"]], device)
    picked, _ = generate(steps, Prompt(ids, mask), new_tokens, keep_logits=False)
    return picked.tolist()


__all__ = ["generate_tokens"]
