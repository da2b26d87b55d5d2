"""``exporter check``: convert's gate for artifacts another tool made (Optimum, torch.export, transformers'
``exporters``, AOTInductor, an earlier exporter run). :mod:`.artifacts` describes what was given, :mod:`.mapping`
maps it by name onto the checkpoint's model, :mod:`.run` judges it, :mod:`.locating` finds the first divergent
module from the artifact's own values, :mod:`.past` judges a decoder with past step by step."""

from .run import CheckResult, check

__all__ = ["check", "CheckResult"]
