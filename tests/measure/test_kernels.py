"""exporter.kernels: which attention kernels ran, read from the profiler, for real artifacts on the CPU and through
the child runner's "kernels" hook."""

from __future__ import annotations

import pytest
import torch

from exporter.child import Session
from exporter.measure import kernels
from exporter.rewrite import rewrite_attention
from exporter.runners import RemoteRunner
from exporter.targets.spec import RunnerSpec
from exporter.testing import attention_zoo as zoo


def test_names_are_classified_per_backend():
    cpu = kernels.classify([("aten::scaled_dot_product_attention", False),
                            ("aten::_scaled_dot_product_flash_attention_for_cpu", False), ("aten::addmm", False)])
    assert (cpu["source"], cpu["backends"], cpu["softmax_kernels"]) == ("aten ops", {"flash": 1}, 0)
    math = kernels.classify([("aten::_scaled_dot_product_attention_math", False), ("aten::softmax", False),
                             ("aten::_softmax", False)])
    assert math["backends"] == {"math": 1} and math["softmax_kernels"] == 1  # aten::softmax wraps _softmax
    cuda = kernels.classify([("aten::_scaled_dot_product_efficient_attention", False),
                             ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", True)], "cuda")
    assert cuda["backends"] == {"efficient": 1} and cuda["source"] == "aten ops"  # the op, not also its kernel
    shim = kernels.classify([("aoti_torch_cuda__scaled_dot_product_cudnn_attention", False)], "cuda")
    assert shim["backends"] == {"cudnn": 1} and shim["source"] == "aoti shims"
    gpu_only = kernels.classify([("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", True),
                                 ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64", True),
                                 ("void (anonymous namespace)::cunn_SoftMaxForward<4, float>", True)], "cuda")
    assert gpu_only["backends"] == {"flash": 1, "cudnn": 1} and gpu_only["softmax_kernels"] == 1
    assert gpu_only["source"] == "device kernels" and "kernel names" in gpu_only["note"]
    # as recorded on an H200 (docs/runs/h100-bf16-handwritten-gpt.report.json): an eager softmax is an ATen op
    # plus the kernel it launches, one softmax; the cuDNN SDPA kernel of an AOTInductor package
    eager_gpu = kernels.classify([("aten::softmax", False), ("aten::_softmax", False),
                                  ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10>", True)],
                                 "cuda")
    assert eager_gpu["softmax_kernels"] == 1 and eager_gpu["backends"] == {}
    aoti_gpu = kernels.classify([("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64", True),
                                 ("triton_red_fused__softmax__to_copy_add_4", True)], "cuda")
    assert aoti_gpu["backends"] == {"cudnn": 1} and aoti_gpu["softmax_kernels"] == 1
    # a ViT's AOTInductor package on an H200: cuDNN's patch convolution is "...cudnn...fprop..." too, and the
    # attention that ran decomposed is a softmax kernel, not a fused one
    vit_gpu = kernels.classify([("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16_"
                                 "64x64_64x5_nhwc_align8>(cutlass_tensorop_bf16_s16816fprop_optimized_bf16_64x64_"
                                 "64x5_nhwc_align8::Params)", True),
                                ("triton_per_fused__safe_softmax_add_arange_exp_expand_ge_prepare_softmax_online_"
                                 "scalar_tensor_sub_unsqueeze_view_where_5", True)], "cuda")
    assert vit_gpu["backends"] == {} and vit_gpu["softmax_kernels"] == 1 and "unfused" in vit_gpu["note"]
    nothing = kernels.classify([("graph_0_cpp_fused__softmax_0", False), ("aten::bmm", False)])
    assert nothing["backends"] == {} and nothing["softmax_kernels"] == 1 and "unfused" in nothing["note"]


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """The hand-written causal model saved as an exported program, before and after the rewrite."""
    folder = tmp_path_factory.mktemp("kernels")
    model = zoo.build(zoo.BY_NAME["causal_and_padding"])
    io = zoo.io_module(model)
    rewritten, _ = rewrite_attention(io, zoo.inputs())
    paths = {}
    for name, module in (("original", io), ("rewritten", rewritten)):
        paths[name] = folder / f"{name}.pt2"
        torch.export.save(zoo.export_named(module, zoo.inputs()), str(paths[name]))
    return paths


def spec(target, path, **options):
    return RunnerSpec(target, target, "cpu", "float32", path=str(path), options=tuple(options.items()))


def load(target, path, **options):
    from exporter.targets import load_runner

    return Session(load_runner(spec(target, path, **options)))


def test_exported_program_runs_the_cpu_flash_kernel(programs):
    session = load("exported_program", programs["rewritten"])
    result = session.loaded.hooks["kernels"](session, zoo.inputs())
    assert result["backends"] == {"flash": 2} and result["softmax_kernels"] == 0, result


def test_math_backend_is_told_apart():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 16, 8)
    with sdpa_kernel([SDPBackend.MATH]):
        forced = kernels.profile(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert forced["backends"] == {"math": 1} and forced["softmax_kernels"] == 1
    default = kernels.profile(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert default["backends"] == {"flash": 1} and default["softmax_kernels"] == 0


def test_unrewritten_program_shows_explicit_softmax(programs):
    session = load("exported_program", programs["original"])
    session.set_bench_input(zoo.inputs())
    result = session.loaded.hooks["kernels"](session)  # on the benchmark input
    assert result["backends"] == {} and result["softmax_kernels"] == 2 and result["source"] == "none"


def test_child_runner_answers_the_kernels_hook(programs):
    runner = RemoteRunner(spec("exported_program", programs["rewritten"]))
    try:
        result = runner.call("kernels", zoo.inputs())
    finally:
        runner.close()
    assert result["backends"] == {"flash": 2}


def test_onnx_model_reports_onnxruntime_attention_ops(programs, tmp_path):
    path = tmp_path / "model.onnx"
    program = torch.export.load(str(programs["rewritten"]))
    torch.onnx.export(program, (), dynamo=True, opset_version=23, input_names=["x", "mask"], optimize=False,
                      verbose=False).save(str(path))
    session = load("onnx", path, provider="CPUExecutionProvider")
    result = session.loaded.hooks["kernels"](session, zoo.inputs())
    assert result["backends"] == {"onnxruntime Attention": 2} and result["softmax_kernels"] == 0, result
    assert result["source"] == "onnxruntime profile"


@pytest.mark.slow
@pytest.mark.parametrize("profiled", [True, False])
def test_aoti_package_kernels(programs, tmp_path, profiled):
    """With cpp.enable_kernel_profile the package records its SDPA shim call; without, it records none, and
    the result says so instead of guessing."""
    program = torch.export.load(str(programs["rewritten"]))
    configs = {"cpp.enable_kernel_profile": True} if profiled else {}
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "model.aoti.pt2"),
                                                    inductor_configs=configs)
    session = load("aoti", path)
    result = session.loaded.hooks["kernels"](session, zoo.inputs())
    if profiled:
        assert result["backends"] == {"flash": 2} and result["source"] == "aoti shims", result
    else:
        assert result["source"] == "none" and "cpp.enable_kernel_profile" in result["note"], result
    assert result["softmax_kernels"] == 0
