"""Facts about the machine and the software, for the manifest, and checks that fail before any work."""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import torch

from .disk import check_temp_folder
from .errors import EnvironmentProblem
from .recipe import Recipe


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {
        "exporter": package_version("exporter"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnx": package_version("onnx"),
        "onnxscript": package_version("onnxscript"),
        "onnxruntime": package_version("onnxruntime"),
        "transformers": package_version("transformers"),
        "safetensors": package_version("safetensors"),
        "torch_tensorrt": package_version("torch-tensorrt") or package_version("torch_tensorrt"),
    }


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: str, host: bool = False) -> dict[str, object]:
    """The machine a run used; its host name only when asked (``[report] host = true``): reports get published."""
    info: dict[str, object] = {"type": device, "kernel": platform.release(), "platform": sys.platform,
                               "cpu": cpu_name()}
    if host:
        info["host"] = platform.node()
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update({"name": props.name, "capability": f"{props.major}.{props.minor}",
                     "multiprocessors": props.multi_processor_count, "memory_bytes": props.total_memory,
                     "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()})
    else:
        info["name"] = cpu_name()
    return info


def check_machine(recipe: Recipe) -> None:
    """Fail before loading anything when the recipe asks for what this machine lacks (a GPU, bfloat16, a usable
    temporary folder)."""
    check_temp_folder()
    if recipe.runtime.device == "cuda" and not torch.cuda.is_available():
        raise EnvironmentProblem(f"recipe {recipe.name} runs on CUDA, but this machine has no usable GPU "
                                 f"(torch {torch.__version__}, cuda {torch.version.cuda})",
                                 "run it on a GPU machine, or choose a CPU recipe such as cpu-fp32")
    if recipe.runtime.device == "cuda" and recipe.runtime.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise EnvironmentProblem(f"recipe {recipe.name} uses bfloat16, which this GPU does not support",
                                 "choose a float16 or float32 recipe")
