"""Silence third-party chatter (deprecation warnings, exporter log lines) unless EXPORTER_DEBUG=1."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

NOISY_LOGGERS = ("torch.onnx", "torch._inductor", "torch._dynamo", "torch.export", "onnxscript", "transformers")


@contextlib.contextmanager
def quiet_libraries():
    if os.environ.get("EXPORTER_DEBUG") == "1":
        yield
        return
    saved = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        try:
            yield
        finally:
            for name, level in saved.items():
                logging.getLogger(name).setLevel(level)
