"""The AOTInductor target's decoder programs: two packages without weights and one copy of them, on disk and in
memory."""

from __future__ import annotations

import json

import torch


def test_the_aoti_programs_share_one_copy_of_the_weights(llama_generation):
    from pathlib import Path

    from exporter import targets
    from exporter.generation.cache import CacheLayout
    from exporter.generation.driver import load_steps
    from exporter.targets.aoti import DECODER_WEIGHTS as WEIGHTS
    from exporter.targets.aoti_loader import weights_beside

    out = llama_generation.out
    packages = list(targets.get("aoti").decoder_files(out))
    assert not any(Path(weights_beside(str(p))).exists() for p in packages)  # no weights file per program
    with open(out / WEIGHTS, "rb") as handle:  # the shared file holds every weight of the model once
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    params = {k for k in header if k != "__metadata__"}
    assert any(name.endswith("embed_tokens.weight") for name in params)
    setup = json.loads((out / "generation.json").read_text())
    steps = load_steps("aoti", out, CacheLayout.from_dict(setup["layout"]), setup["cache_length"], torch.float32,
                       "cpu")
    prefill, decode, fresh = steps.prefill.constants, steps.decode.constants, steps.fresh_decode().constants
    shared = set(prefill) & set(decode)
    assert shared and set(prefill) | set(decode) <= params
    assert sum(n.endswith("fused.weight") for n in shared) == 4  # the fused weights are shared too
    # the decode programs use the prefill's tensors themselves: one copy of the weights in memory
    assert all(decode[n].data_ptr() == prefill[n].data_ptr() == fresh[n].data_ptr() for n in shared)
