"""A sentence-transformers folder's pipeline, exported with its model: pooling, dense layers, normalisation.

A sentence-transformers checkpoint (``modules.json`` beside ``config.json``) is a transformers model followed by
modules that turn its token embeddings into one vector per text: ``Pooling`` (mean, CLS, max, ...), optional
``Dense`` layers and ``Normalize``. ``SentenceTransformer.encode()`` runs all of them; an artifact of the bare
transformer cannot stand in for it. Here the modules are rebuilt in plain torch around the loaded model, so the
float64 reference, the attention rewrite, every export and the gate see the whole pipeline, and the outputs carry
sentence-transformers' own names: ``token_embeddings`` and ``sentence_embedding``.

The arithmetic follows sentence-transformers' padded code path (``Pooling._forward_padded``, ``Dense.forward``,
``Normalize.forward``); ``tests/checkpoint/test_sentence_pipeline.py`` pins it against ``SentenceTransformer``
itself in float64. A folder holding a module this does not rebuild is exported as the bare transformer, and the
report says which module and why. ``[model] pipeline = false`` exports the bare transformer on purpose.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

MODULES_FILE = "modules.json"
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers' pre-6 config keys, in its concatenation order
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
ACTIVATIONS = {"Tanh": nn.Tanh, "Identity": nn.Identity, "ReLU": nn.ReLU, "GELU": nn.GELU, "Sigmoid": nn.Sigmoid,
               "SiLU": nn.SiLU}


class NotRebuilt(Exception):
    """A module of the pipeline this does not rebuild: the transformer is exported alone."""


@dataclass
class PipelineInfo:
    """What the report says about a sentence-transformers folder."""

    modules: list[str] = field(default_factory=list)  # "1 Pooling (mean)", in order
    included: bool = False
    reason: str = ""  # why the pipeline was left out, when it was
    checked: str = ""  # what the run's cross-check against sentence-transformers' own modules found

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "sentence-transformers", "included": self.included, "modules": list(self.modules),
                "reason": self.reason or None, "checked": self.checked or None}


class PipelineMismatch(Exception):
    """sentence-transformers' own modules compute another sentence embedding than the rebuilt pipeline."""


class Pooling(nn.Module):
    def __init__(self, modes: tuple[str, ...]):
        super().__init__()
        self.modes = modes

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        accumulate = torch.float32 if tokens.dtype in (torch.float16, torch.bfloat16) else tokens.dtype
        out: list[torch.Tensor] = []
        for mode in self.modes:
            if mode == "cls":
                first = mask.to(torch.int32).argmax(dim=1)
                index = first.view(-1, 1, 1).expand(-1, 1, tokens.shape[-1])
                out.append(torch.gather(tokens, 1, index).squeeze(1))
            elif mode == "max":
                keep = mask.unsqueeze(-1).to(tokens.dtype)
                out.append(tokens.masked_fill(keep == 0, float("-inf")).max(dim=1).values)
            elif mode in ("mean", "mean_sqrt_len_tokens"):
                keep = mask.unsqueeze(-1).to(tokens.dtype)
                total = (tokens * keep).sum(dim=1, dtype=accumulate)
                count = torch.clamp(keep.sum(dim=1, dtype=accumulate), min=1e-9)
                out.append((total / (count if mode == "mean" else torch.sqrt(count))).to(tokens.dtype))
            elif mode == "weightedmean":
                keep = mask.unsqueeze(-1).to(accumulate)
                weights = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=accumulate).view(1, -1, 1)
                weights = weights - mask.to(torch.int32).argmax(dim=1).view(-1, 1, 1)
                weighted = keep * weights
                total = (tokens * weighted).sum(dim=1)
                out.append((total / torch.clamp(weighted.sum(dim=1), min=1e-9)).to(tokens.dtype))
            else:  # lasttoken
                seq = tokens.shape[1]
                values, last = mask.to(torch.int32).flip(1).max(1)
                last = torch.where(values == 0, seq - 1, last)
                index = (seq - last - 1).view(-1, 1, 1).expand(-1, 1, tokens.shape[-1])
                keep = mask.unsqueeze(-1).to(tokens.dtype)
                out.append(torch.gather(tokens * keep, 1, index).squeeze(1))
        return torch.cat(out, dim=-1)


class Dense(nn.Module):
    def __init__(self, linear: nn.Linear, activation: nn.Module, residual: nn.Linear | None, use_residual: bool):
        super().__init__()
        self.linear = linear
        self.activation = activation
        self.residual = residual
        self.use_residual = use_residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


class SentencePipeline(nn.Module):
    """forward(input_ids, attention_mask, token_type_ids) -> {token_embeddings, sentence_embedding}: the
    transformer, then the folder's modules in order, as ``SentenceTransformer.forward`` runs them."""

    def __init__(self, transformer: nn.Module, steps: list[tuple[str, nn.Module]]):
        super().__init__()
        self.transformer = transformer
        self.steps = nn.ModuleList(m for _, m in steps)
        self.kinds = [k for k, _ in steps]

    @property
    def wrapped_transformer(self) -> nn.Module:
        """The transformers model inside (its config, its attention implementation)."""
        return self.transformer

    @property
    def config(self) -> Any:
        return self.transformer.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        tokens = self.transformer(input_ids=input_ids, attention_mask=attention_mask, return_dict=True,
                                  **extra).last_hidden_state
        features = {"token_embeddings": tokens}
        for kind, step in zip(self.kinds, self.steps):
            if kind == "pooling":
                features["sentence_embedding"] = step(features["token_embeddings"], attention_mask)
            elif kind == "dense":
                features["sentence_embedding"] = step(features["sentence_embedding"])
            else:  # normalize
                features["sentence_embedding"] = F.normalize(features["sentence_embedding"], p=2, dim=-1)
        return features


def _read(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotRebuilt(f"{path.name} cannot be read ({type(exc).__name__})") from None
    if not isinstance(value, dict):
        raise NotRebuilt(f"{path.name} does not hold a JSON object")
    return value


def _pooling(folder: Path) -> tuple[str, nn.Module]:
    config = _read(folder / "config.json")
    modes: Any = config.get("pooling_mode")
    if modes is None:
        modes = tuple(mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key)) or ("mean",)
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown:
        raise NotRebuilt(f"pooling mode {unknown[0]!r} is not one of {', '.join(POOLING_MODES)}")
    if config.get("include_prompt") is False:
        raise NotRebuilt("pooling with include_prompt = false depends on the prompt length, not on the tensors")
    return "+".join(modes), Pooling(modes)


def _dense(folder: Path) -> tuple[str, nn.Module]:
    from safetensors.torch import load_file  # noqa: PLC0415

    config = _read(folder / "config.json")
    name = str(config.get("activation_function") or "torch.nn.modules.activation.Tanh").rsplit(".", 1)[-1]
    if name not in ACTIVATIONS:
        raise NotRebuilt(f"Dense activation {config.get('activation_function')!r} is not one of "
                         f"{', '.join(ACTIVATIONS)}")
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, "sentence_embedding") != "sentence_embedding":
            raise NotRebuilt(f"Dense {key} = {config[key]!r} (only sentence_embedding is rebuilt)")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise NotRebuilt(f"{folder.name} holds no model.safetensors (pickled Dense weights are not read)")
    state = load_file(str(weights))
    try:
        inputs, outputs = int(config["in_features"]), int(config["out_features"])
    except (KeyError, TypeError, ValueError):
        raise NotRebuilt(f"{folder.name}/config.json has no in_features and out_features") from None
    linear = nn.Linear(inputs, outputs, bias=bool(config.get("bias", True)))
    use_residual = bool(config.get("use_residual", False))
    residual = nn.Linear(inputs, outputs, bias=False) if use_residual and inputs != outputs else None
    dense = Dense(linear, ACTIVATIONS[name](), residual, use_residual)
    try:
        dense.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise NotRebuilt(f"{folder.name} weights do not fit a Dense {inputs} -> {outputs} "
                         f"({str(exc).splitlines()[0]})") from None
    return f"{inputs}->{outputs}, {name}", dense


def wrap(model: nn.Module, root: Path) -> tuple[nn.Module, PipelineInfo | None]:
    """``model`` inside its sentence-transformers pipeline when ``root`` holds one that can be rebuilt;
    else ``model`` itself, with why (``None`` when ``root`` is no sentence-transformers folder)."""
    path = root / MODULES_FILE
    if not path.is_file():
        return model, None
    info = PipelineInfo()
    try:
        try:
            listed = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise NotRebuilt(f"{MODULES_FILE} cannot be read ({type(exc).__name__})") from None
        if not isinstance(listed, list) or not all(isinstance(e, dict) and isinstance(e.get("idx", 0), int)
                                                   for e in listed):
            raise NotRebuilt(f"{MODULES_FILE} is not a list of modules")
        steps: list[tuple[str, nn.Module]] = []
        for entry in sorted(listed, key=lambda e: e.get("idx", 0)):
            if not str(entry.get("type", "")).startswith("sentence_transformers."):
                raise NotRebuilt(f"module {entry.get('idx')} is a custom module ({entry.get('type')})")
            kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
            folder = root / str(entry.get("path", ""))
            label = f"{entry.get('idx', len(info.modules))} {kind}"
            if kind == "Transformer":
                if steps or entry.get("path", "") not in ("", "."):
                    raise NotRebuilt(f"the Transformer module is not the first one at the folder's root ({label})")
                info.modules.append(label)
            elif kind == "Pooling":
                detail, module = _pooling(folder)
                steps.append(("pooling", module))
                info.modules.append(f"{label} ({detail})")
            elif kind == "Dense":
                if not steps:
                    raise NotRebuilt("a Dense module before Pooling works on tokens, which is not rebuilt")
                detail, module = _dense(folder)
                steps.append(("dense", module))
                info.modules.append(f"{label} ({detail})")
            elif kind == "Normalize":
                for key in ("module_input_name", "module_output_name"):
                    value = _read(folder / "config.json").get(key) if (folder / "config.json").is_file() else None
                    if value not in (None, "sentence_embedding"):
                        raise NotRebuilt(f"Normalize {key} = {value!r} (only sentence_embedding is rebuilt)")
                if not steps:
                    raise NotRebuilt("Normalize before Pooling works on tokens, which is not rebuilt")
                steps.append(("normalize", nn.Identity()))
                info.modules.append(label)
            elif kind == "Dropout":
                info.modules.append(f"{label} (identity at inference)")
            else:
                raise NotRebuilt(f"module {label} ({entry.get('type')}) is not rebuilt")
        if not steps or steps[0][0] != "pooling":
            raise NotRebuilt("the pipeline has no Pooling module after the Transformer")
    except NotRebuilt as exc:
        info.reason = f"{exc}; the transformer's own outputs are exported"
        return model, info
    info.included = True
    return SentencePipeline(model, steps), info


def cross_check(root: Path, tokens: torch.Tensor, mask: torch.Tensor, expected: torch.Tensor) -> str:
    """Run sentence-transformers' own modules (every one after the Transformer, loaded from ``root``) on the
    float64 reference's ``tokens`` and compare their sentence embedding with the rebuilt pipeline's
    ``expected``: what was rebuilt is then proven on this run's own inputs, not only in the tests. Raises
    :class:`PipelineMismatch` when they differ beyond float64 rounding; says why when it cannot run."""
    try:
        import sentence_transformers  # noqa: PLC0415 - optional: the check runs where it is installed
        from sentence_transformers.util import import_from_string  # noqa: PLC0415
    except ImportError:
        return "not run: sentence-transformers is not installed here (the rebuild is pinned against it by the tests)"
    listed = sorted(json.loads((root / MODULES_FILE).read_text(encoding="utf-8")), key=lambda e: e.get("idx", 0))
    features: dict[str, Any] = {"token_embeddings": tokens.to("cpu", torch.float64),
                                "attention_mask": mask.to("cpu")}
    try:
        with torch.inference_mode():
            for entry in listed[1:]:
                kind: Any = import_from_string(entry["type"])  # a sentence-transformers module class
                module = kind.load(str(root), subfolder=entry.get("path", ""), local_files_only=True)
                features = module.to(torch.float64).eval()(features)
    except Exception as exc:  # a module sentence-transformers itself cannot load or run here: said, not fatal
        return f"not run: sentence-transformers {sentence_transformers.__version__} could not run the folder's " \
               f"modules ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"
    theirs = features["sentence_embedding"]
    ours = expected.to("cpu", torch.float64)
    if theirs.shape != ours.shape:
        raise PipelineMismatch(f"shape {list(theirs.shape)} against the rebuilt {list(ours.shape)}")
    difference = float((theirs - ours).abs().max())
    scale = max(1.0, float(ours.abs().max()))
    if not difference <= 1e-9 * scale:
        raise PipelineMismatch(f"max |difference| {difference:.3g} on sample 0")
    return (f"sentence-transformers {sentence_transformers.__version__}'s own modules on the float64 reference's "
            f"token embeddings of sample 0: max |difference| {difference:.2g}")
