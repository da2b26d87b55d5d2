"""exporter.backend_choice: the SDPA calls a model makes, and PyTorch's own verdict on each fused backend.

PyTorch's checks (``torch.backends.cuda.can_use_*``) answer only for CUDA tensors; on this CPU machine the
tests pin the recording, the reason parsing and the report's wording. The H200 run is docs/runs/
(h100-bf16-handwritten-gpt.report.md: cuDNN picked, flash refused with "does not support non-null attn_mask").
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from exporter.measure import backend_choice
from exporter.rewrite import rewrite_attention
from exporter.testing import attention_zoo as zoo


def test_records_each_distinct_sdpa_call_of_a_rewritten_graph():
    io = zoo.io_module(zoo.build(zoo.BY_NAME["causal_and_padding"]))
    rewritten, audit = rewrite_attention(io, zoo.inputs())
    assert audit.count("rewritten") == 2
    recorder = backend_choice._SdpaCalls()
    with torch.inference_mode(), recorder:
        rewritten(*zoo.inputs())
    (entry,) = recorder.calls.values()  # two layers, one signature
    assert entry["count"] == 2
    assert entry["args"]["attn_mask"] is not None  # causal and padding, merged into one mask


def test_records_python_level_sdpa_with_its_flags():
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    recorder = backend_choice._SdpaCalls()
    with recorder:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        F.scaled_dot_product_attention(q, q, q)
    keys = list(recorder.calls)
    assert len(keys) == 2
    assert keys[0][4:6] == (True, True) and keys[1][4:6] == (False, False)


def test_cpu_result_says_the_checks_are_cuda_only():
    result = backend_choice.explain(lambda: None, "cpu", "auto")
    assert result["calls"] == [] and "CUDA-only" in result["note"]


def test_native_warnings_become_reasons():
    """c10 writes the checks' reasons to file descriptor 2 when no Python handler is installed."""
    line = ("[W1129 22:19:10.562057345 sdp_utils_cpp.h:262] Warning: Flash Attention does not support "
            "non-null attn_mask. (function check_for_attn_mask)\n")

    def refuses(params, debug):
        os.write(2, line.encode())
        return False

    ok, reasons = backend_choice._check(refuses, None)
    assert not ok and reasons == ["Flash Attention does not support non-null attn_mask."]


def test_why_not_quotes_pytorch():
    choice = {"calls": [{"backends": {"flash": {"usable": False, "reasons": ["head dim 512 > 256"]},
                                      "cudnn": {"usable": True, "reasons": []}}}]}
    assert backend_choice.why_not(choice, "flash") == "head dim 512 > 256"
    assert backend_choice.why_not(choice, "cudnn") == ""
    assert backend_choice.why_not(None, "flash") == ""
