"""A small language model whose weights mean something: trained here, on text that ships with Python.

    python -m exporter.testing.trained OUT_DIR [--arch gpt-neox|gpt2] [--steps N]

Random weights hide defects: their attention is near uniform and their logits near ties, so a wrong softmax
scale or a LayerNorm weight off by 1% barely moves the outputs. A model trained for a minute has peaked
attention and logits that mean something, which is what a test of the gate's power needs.

The model is byte-level (256 tokens, no tokenizer to ship), trained with a fixed seed on the source text of a
fixed list of standard-library modules. ``gpt-neox`` (the default) carries every part a planted defect can
touch: LayerNorm, exact GELU, rotary positions and a scaled attention; ``gpt2`` is GPT-2's own block.

The folder holds ``config.json`` and ``model.safetensors`` (the trained model), ``earlier/`` (the same model
halfway through training, a checkpoint of its own: a stale tensor for the weights proof to catch) and ``training.json``
(the losses). The default model ships with the package (``testing/data/trained-gpt-neox``, 1.5 MB, made by
``python -m exporter.testing.trained src/exporter/testing/data/trained-gpt-neox`` on Python 3.11), so every machine
judges the same weights and no test pays for training; :func:`trained_lm` with another architecture or step count
builds it once per machine, under a lock, in ``~/.cache/exporter/trained`` (``EXPORTER_CACHE`` moves it; another
Python's standard library gives other text, hence other weights).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

VERSION = 1  # bumped when the recipe below changes: a new cache entry
SOURCES = ("argparse", "ast", "collections/__init__", "dataclasses", "functools", "inspect", "json/decoder",
           "pathlib", "textwrap", "typing")
SEQUENCE = 64
BATCH = 16
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt-neox": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256,
                     max_position_embeddings=256, vocab_size=256, hidden_act="gelu", tie_word_embeddings=False,
                     rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default"},
                     bos_token_id=10, eos_token_id=10),
    "gpt2": dict(n_embd=64, n_layer=3, n_head=4, n_positions=256, vocab_size=256, activation_function="gelu",
                 bos_token_id=10, eos_token_id=10),
}


def corpus() -> bytes:
    """The training text: the source of :data:`SOURCES` from this Python's standard library."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return b"\n".join((lib / f"{name}.py").read_bytes() for name in SOURCES)


def build(arch: str):
    import transformers as tf  # noqa: PLC0415

    if arch == "gpt-neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**CONFIGS[arch]))
    if arch == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(**CONFIGS[arch]))
    raise ValueError(f"unknown architecture {arch!r}: one of {', '.join(CONFIGS)}")


def train(out: Path, arch: str = "gpt-neox", steps: int = 1500, seed: int = 0) -> dict:
    """Train the model (AdamW, cosine decay, fixed seed) and write the folder (see the module's docstring)."""
    from safetensors.torch import save_file  # noqa: PLC0415

    torch.manual_seed(seed)
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).to(torch.int64)
    held_out = data[-8192:]
    data = data[:-8192]
    model = build(arch)
    model.config._attn_implementation = "sdpa"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    t0 = time.perf_counter()
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / steps)) if step > 20 else 3e-3 * step / 20
        start = torch.randint(0, data.numel() - SEQUENCE - 1, (BATCH,), generator=generator)
        batch = torch.stack([data[s:s + SEQUENCE + 1] for s in start.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if step == steps // 2 - 1:
            earlier = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        windows = held_out[: (held_out.numel() // (SEQUENCE + 1)) * (SEQUENCE + 1)].view(-1, SEQUENCE + 1)
        held = float(model(input_ids=windows[:, :-1], labels=windows[:, :-1]).loss)
    out.mkdir(parents=True, exist_ok=True)
    model.config._attn_implementation = None
    model.save_pretrained(out)
    (out / "earlier").mkdir()
    save_file(earlier, str(out / "earlier" / "model.safetensors"))
    shutil.copy(out / "config.json", out / "earlier" / "config.json")
    summary = {"arch": arch, "steps": steps, "seed": seed, "version": VERSION, "python": sys.version.split()[0],
               "torch": torch.__version__, "train_s": round(time.perf_counter() - t0, 1),
               "first_loss": losses[0], "last_loss": sum(losses[-20:]) / 20, "held_out_loss": held,
               "uniform_loss": math.log(256)}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def held_out_samples(path: Path, batch: int = 4, sequence: int = 64, samples: int = 2) -> Path:
    """An inputs file (``--inputs``) of text the model never trained on: ``samples`` samples of ``batch`` windows of
    ``sequence`` bytes each from the held-out tail of :func:`corpus`, every token attended. Where a figure must mean
    something (fp8's top-1 agreement and KL), it is asked on text, not on random tokens."""
    from safetensors.torch import save_file  # noqa: PLC0415

    held_out = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).to(torch.int64)[-8192:]
    windows = held_out[: batch * sequence * samples].view(samples, batch, sequence)
    tensors = {}
    for index in range(samples):
        tensors[f"{index}.input_ids"] = windows[index].contiguous()
        tensors[f"{index}.attention_mask"] = torch.ones(batch, sequence, dtype=torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def cache_root() -> Path:
    return Path(os.environ.get("EXPORTER_CACHE", Path.home() / ".cache" / "exporter")) / "trained"


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


SHIPPED = Path(__file__).parent / "data" / "trained-gpt-neox"


def trained_lm(arch: str = "gpt-neox", steps: int = 1500) -> Path:
    """The trained model's folder: the one the package ships for the defaults, else built on first use (a minute
    on two CPU cores) and cached."""
    if arch == "gpt-neox" and steps == 1500 and (SHIPPED / "training.json").is_file():
        return SHIPPED
    key = hashlib.sha256(json.dumps([VERSION, arch, steps, CONFIGS[arch], SOURCES]).encode()
                         + hashlib.sha256(corpus()).digest()).hexdigest()[:12]
    folder = cache_root() / f"{arch}-{key}"
    if (folder / "training.json").is_file():
        return folder
    with _locked(cache_root() / f".{arch}-{key}.lock"):
        if not (folder / "training.json").is_file():
            staging = folder.with_name(folder.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            threads = torch.get_num_threads()
            try:
                train(staging, arch, steps)
            finally:
                torch.set_num_threads(threads)
            staging.rename(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", default="gpt-neox", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    print(json.dumps(train(args.out, args.arch, args.steps), indent=2))


if __name__ == "__main__":
    main()
