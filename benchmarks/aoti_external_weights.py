"""Does an AOTInductor package built without its weights run with weights handed to it at load time?

    PYTHONPATH=src python3 benchmarks/aoti_external_weights.py [cpu|cuda]

Builds a small model's package with ``aot_inductor.package_constants_in_so = False`` (no weights inside), loads it
with torch's package loader, hands it the exported program's own tensors with ``load_constants`` (user-managed:
the package uses them in place), and compares its output with the model's. This is the building block for
writing an artifact's weights ourselves, in slices, instead of through Inductor's in-memory blob
(docs/convert-time-notes.md).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from exporter.targets.toolchain import aoti_preload


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    lib = aoti_preload()
    if lib and lib not in os.environ.get("LD_PRELOAD", ""):  # an AOTI package may crash on load without it
        os.environ["LD_PRELOAD"] = os.pathsep.join(p for p in (lib, os.environ.get("LD_PRELOAD")) if p)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(device).eval()
    x = torch.randn(4, 256, device=device)
    program = torch.export.export(model, (x,))
    with tempfile.TemporaryDirectory() as folder:
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=str(Path(folder) / "model.aoti.pt2"),
            inductor_configs={"aot_inductor.package_constants_in_so": False})
        size = Path(path).stat().st_size
        loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        names = loader.get_constant_fqns()
        tensors = {**program.state_dict, **program.constants}
        loader.load_constants({name: tensors[name] for name in names}, False, True, True)
        with torch.inference_mode():
            out = loader.boxed_run([x])[0]
            expected = model(x)
    print(f"torch {torch.__version__} on {device}: package {size / 1024:.0f} KiB without weights, constants "
          f"{sorted(names)}; max |difference| {float((out - expected).abs().max()):.3g}")


if __name__ == "__main__":
    main()
