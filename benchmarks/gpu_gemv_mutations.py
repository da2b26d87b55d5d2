"""Which arguments of ``exporter::gemv``'s kernel Inductor takes as written (its analysis of the kernel's TTIR): only
the output should be, or every weight is copied back out of the package as an output of its own.

Run on the GPU machine: ``PYTHONPATH=src python3 benchmarks/gpu_gemv_mutations.py``.
"""

from __future__ import annotations

import torch
from torch._higher_order_ops.triton_kernel_wrap import identify_mutated_tensors

from exporter.kernels import gemv as G


def main() -> int:
    k, n = 2048, 3072
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * n, k, device="cuda", dtype=torch.bfloat16)
    out, res, norm = (torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for flags in ({"NORM": True, "GLU": False, "RESIDUAL": False}, {"NORM": True, "GLU": True, "RESIDUAL": False},
                  {"NORM": False, "GLU": False, "RESIDUAL": True}):
        kwargs = dict(x_ptr=x, w_ptr=w, out_ptr=out, norm_ptr=norm, res_ptr=res, b_ptr=x, N=n, K=k, eps=1e-6,
                      BLOCK_N=2, BLOCK_K=1024, HAS_BIAS=False, EVEN_K=True, ROUND=True, **flags)
        try:
            written = identify_mutated_tensors(G._gemv_kernel, kwargs, {})
        except TypeError:  # an older signature
            written = identify_mutated_tensors(G._gemv_kernel, kwargs)
        print(flags, "written:", written, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
