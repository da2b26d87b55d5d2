"""``exporter convert --task text-generation``: a decoder's prefill and decode programs, judged and timed.

    load -> prompts -> reference generation (float64, no cache) -> eager baseline (teacher-forced)
         -> attention to SDPA -> export prefill + decode -> build targets -> judge and time each -> report

Everything a target is judged on is computed here once and stored in the output folder
(``generation.json``: cache layout, sizes and each step's bar; ``reference/generation.safetensors``: the
prompts, the reference's tokens and its float64 logits per step), so ``exporter verify`` re-judges a target
with the same bars. Each target is judged and timed in a process of its own (``generation.session``).
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..checkpoint import load_model
from ..environment import device_info, versions
from ..errors import EXIT_NUMERICS, EXIT_OK, EXIT_TARGET, ArchitectureError, describe
from ..inputs import TORCH_DTYPES
from ..modelio import attention_implementation
from ..numerics.tolerance import RULE, relative_floor
from ..outdir import file_entry, model_name, public_path, sha256_file, write_json
from ..progress import Progress
from ..recipe import Recipe, public_source
from ..rewrite.audit import REWRITTEN, AttentionAudit, Site
from ..runners import child_env
from ..targets.toolchain import aoti_preload
from . import bench
from .cache import DecoderStep, probe_layout
from .driver import Prompt, Steps, generate
from .judge import judge_steps, step_bars
from .onnx_programs import refusal as onnx_refusal
from .programs import BUILT, FILES, NOT_BUILT, build, export_steps, target_attention
from .reference import forced_logits, reference_generation
from .session import MANIFEST, REFERENCE, finite

SESSION_TIMEOUT_S = 3600
SCHEMA_FILE = Path(__file__).with_name("schema.json")  # shipped in the wheel beside this module


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a ``--task text-generation`` run's ``report.json``."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def make_prompt(vocab: int, batch: int, length: int, seed: int) -> Prompt:
    """Random token ids (seeded); odd rows left-padded by a quarter of the length (at least one token)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    pad = max(1, length // 4)
    mask[1::2, :pad] = 0
    ids[mask == 0] = 0
    return Prompt(ids, mask)


def audit_sites(model: torch.nn.Module, device: str, transformers: bool) -> AttentionAudit:
    """The attention sites one decode step dispatched through transformers' SDPA entry (transformers models);
    a factory model's attention is read from the exported programs' graphs (``attention_ops``)."""
    audit = AttentionAudit()
    if not transformers:
        audit.notes.append("factory decoder: its attention runs as written; the programs' SDPA and softmax nodes "
                           "are counted below")
        return audit
    from ..rewrite.transformers_interface import KIND, _recording  # noqa: PLC0415
    from ..rewrite.transformers_interface import RULE as SITE_RULE  # noqa: PLC0415

    names = {id(m): n for n, m in model.named_modules()}
    calls: list[dict[str, Any]] = []
    with _recording(calls):  # one step of the model, each attention's SDPA call recorded
        probe_layout(model, True, device)
    seen: set[int] = set()
    for call in calls:
        if id(call["module"]) in seen:
            continue
        seen.add(id(call["module"]))
        q, k = call["query"], call["key"]
        audit.sites.append(Site(location=names.get(id(call["module"]), "attention"), kind=KIND, status=REWRITTEN,
                                rule=SITE_RULE, causal=True, masked=True,
                                grouped_query=len(q) == 4 and len(k) == 4 and q[1] != k[1],
                                heads=q[1] if len(q) == 4 else None, kv_heads=k[1] if len(k) == 4 else None,
                                head_dim=q[-1] if q else None))
    return audit


def check_window(config: Any, cache_length: int) -> None:
    """A sliding-window attention narrower than the cache would see keys the step's mask shows it: refused."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    uses = getattr(config, "use_sliding_window", True) and (not layer_types or "sliding_attention" in layer_types)
    if isinstance(window, int) and uses and window < cache_length:
        raise ArchitectureError(f"the model's attention looks back at most {window} tokens (sliding_window) but the "
                                f"cache holds {cache_length}: the static cache does not implement sliding windows",
                                f"convert with --set generation.max_cache_len={window} or less")


def run_session(folder: Path, target: str, log: Path, time_it: bool, steps: int | None = None,
                timeout_s: float = SESSION_TIMEOUT_S, scratch: Path | None = None) -> dict[str, Any]:
    """``generation.session`` for one target in a child process (the AOTI preload where it is needed); its
    request and answer files go to ``scratch`` (default: the folder itself)."""
    request = (scratch or folder) / f".session-{target}.json"
    answer = (scratch or folder) / f".session-{target}.result.json"
    request.write_text(json.dumps({"folder": str(folder), "target": target, "time": time_it, "steps": steps}))
    env = child_env(aoti_preload() if target == "aoti" else None)
    try:
        with open(log, "ab") as out:
            subprocess.run([sys.executable, "-m", "exporter.generation.session", str(request), str(answer)],
                           env=env, stdout=out, stderr=out, timeout=timeout_s, check=False)
        if not answer.is_file():
            return {"target": target, "error": f"the session process ended without a result (see {log.name})"}
        return json.loads(answer.read_text(encoding="utf-8"))
    except subprocess.TimeoutExpired:
        return {"target": target, "error": f"the session did not finish in {timeout_s:.0f} s"}
    finally:
        request.unlink(missing_ok=True)
        answer.unlink(missing_ok=True)


def convert_generation(checkpoint: Path, recipe: Recipe, staging: Path, allow_drift: bool, allow_pickle: bool,
                       progress: Progress) -> tuple[dict[str, Any], list[Path]]:
    t_start = time.perf_counter()
    gen, device = recipe.generation, recipe.runtime.device
    dtype_name = recipe.runtime.dtype
    dtype = TORCH_DTYPES[dtype_name]
    warnings: list[str] = []
    logs = staging / "logs"
    logs.mkdir(exist_ok=True)

    with progress.stage("load", str(checkpoint)):
        loaded = load_model(checkpoint, recipe.model.factory, allow_pickle)
        model = loaded.model.eval()
        transformers = loaded.architecture.is_transformers
        check_window(getattr(model, "config", None), gen.max_cache_len)
    if device != "cpu":
        with progress.stage("to device", device):
            model.to(device)
            gc.collect()

    with progress.stage("reference", f"original model, float64, greedy {gen.new_tokens} tokens, no cache"):
        with attention_implementation(model, "eager"):
            model.to(torch.float64)
            vocab = probe_layout(model, transformers, device).vocab
            prompt = make_prompt(vocab, gen.batch, gen.prompt_length, recipe.inputs.seed)
            ref_tokens, ref_logits = reference_generation(model, prompt, gen.new_tokens, device, transformers)
            model.to(dtype)
            baseline = forced_logits(model, prompt, ref_tokens, device, transformers)
    k = recipe.numerics.multiplier(dtype_name)
    bars = step_bars(ref_logits, baseline, k, relative_floor(recipe.numerics.floor, dtype_name), recipe.numerics.atol)
    eager_picks = baseline.argmax(-1).T
    eager_verdict = judge_steps("eager", ref_logits, ref_tokens, list(baseline.float()), None, bars, k,
                                recipe.numerics.atol)

    implementation = "sdpa" if recipe.runtime.rewrite_attention else "eager"
    with attention_implementation(model, implementation):  # the rewrite: transformers' SDPA attention
        with progress.stage("rewrite attention"):
            step = DecoderStep(model, transformers)
            layout = probe_layout(model, transformers, device)
            audit = audit_sites(model, device, transformers) if recipe.runtime.rewrite_attention else \
                AttentionAudit(notes=["rewrite off (--no-rewrite): attention runs as written"])
            progress.info(f"attention sites: {audit.found} found, {audit.count('rewritten')} rewritten")

        setup: dict[str, Any] = {
            "task": "text-generation", "device": device, "dtype": dtype_name,
            "attention_backend": recipe.runtime.attention_backend, "cache_length": gen.max_cache_len,
            "batch": gen.batch, "prompt_length": gen.prompt_length, "new_tokens": gen.new_tokens,
            "layout": layout.to_dict(),
            "numerics": {"k": k, "atol": recipe.numerics.atol, "floor": recipe.numerics.floor, "bars": bars},
            "timing": {"tokens": gen.bench_tokens, "warmup": recipe.bench.warmup, "rounds": recipe.bench.rounds,
                       "cuda_graph": gen.cuda_graph, "weight_bytes": bench.weight_bytes(model),
                       "copy_bytes_per_s": bench.copy_bandwidth(device)},
        }
        (staging / "reference").mkdir(exist_ok=True)
        save_file({"prompt_ids": prompt.input_ids.contiguous(), "prompt_mask": prompt.mask.contiguous(),
                   "tokens": ref_tokens.contiguous(), "logits": ref_logits.double().contiguous()},
                  str(staging / REFERENCE))
        write_json(staging / MANIFEST, setup)

        steps_local = Steps(step, step, layout, gen.max_cache_len, dtype, device)
        with progress.stage("validate rewritten", "the rewritten model on the static cache, not exported"):
            _, logits = generate(steps_local, prompt, gen.new_tokens, forced=ref_tokens)
            free, _ = generate(steps_local, prompt, gen.new_tokens, keep_logits=False)
            verdict = judge_steps("rewritten", ref_logits, ref_tokens, logits, free, bars, k, recipe.numerics.atol)
            rewritten: dict[str, Any] = {"name": "rewritten", "status": "ok", "numerics": verdict}

        exported = None
        artifacts: list[dict[str, Any]] = []
        onnx_why = onnx_refusal(device, dtype_name)
        wanted = [t for t in recipe.targets.build if t in BUILT and not (t == "onnx" and onnx_why)]
        if wanted:
            with progress.stage("export", "prefill and decode programs"):
                try:
                    exported = export_steps(step, layout, gen.batch, gen.prompt_length, gen.max_cache_len, dtype,
                                            device, fuse=gen.fuse_projections, past="onnx" in wanted)
                except Exception as exc:
                    warnings.append(f"export failed: {describe(exc)}")
                    (logs / "export.log").write_text(repr(exc), encoding="utf-8")
        for target in recipe.targets.build:
            entry: dict[str, Any] = {"target": target, "name": target, "status": "skipped", "error": None, "path": None,
                                     "sha256": None, "size_bytes": None, "files": [], "device": device,
                                     "dtype": dtype_name, "build_s": None, "load_s": None, "notes": [],
                                     "numerics": {"passed": None}, "bench": None, "programs": None}
            artifacts.append(entry)
            if target not in wanted:
                entry["error"] = onnx_why if target == "onnx" and onnx_why else \
                    NOT_BUILT.get(target, "not available for text-generation")
                continue
            if exported is None:
                entry.update(status="failed",
                             error="the prefill and decode programs could not be exported (logs/export.log)")
                continue
            with progress.stage(f"build {target}"):
                t0 = time.perf_counter()
                try:
                    files = build(target, exported, staging, device, recipe.runtime.attention_backend,
                                  recipe.targets.onnx_opset)
                except Exception as exc:
                    entry.update(status="failed", error=f"build failed: {describe(exc)}")
                    continue
                entry["build_s"] = time.perf_counter() - t0 + exported.export_s
                entry["files"] = [file_entry(f, staging) for f in files]
                main = staging / FILES[target][1]
                entry.update(path=FILES[target][1], sha256=sha256_file(main),
                             size_bytes=sum(f.stat().st_size for f in files), notes=list(exported.notes))
                entry["programs"] = target_attention(target, exported, staging)
                entry["fused_projections"] = exported.fused
            with progress.stage(f"validate and time {target}"):
                result = run_session(staging, target, logs / f"{target}.log", time_it=True)
            if "error" in result:
                entry.update(status="failed", error=result["error"])
                continue
            entry.update(load_s=result["load_s"], numerics=result["numerics"], bench=result.get("bench"))
            entry["status"] = "ok" if result["numerics"]["passed"] else "numerics_failed"
            if not result["numerics"]["passed"]:
                entry["error"] = "; ".join(result["numerics"]["failures"][:2]) or "NaN/Inf in the logits"

    with progress.stage("benchmark eager"):
        eager_bench: dict[str, Any] = {}
        first = prompt.row(0)
        if transformers:
            for label, which in (("batch_1", first), ("batch", prompt)):
                eager_bench[label] = bench.time_eager_generate(model, which, gen.bench_tokens, device,
                                                               recipe.bench.rounds)
        with attention_implementation(model, implementation):
            from .session import time_target  # noqa: PLC0415

            rewritten["bench"] = time_target(steps_local, prompt, setup["timing"])
    for timing in [*eager_bench.values()]:
        timing["bandwidth"] = bench.bandwidth(timing, setup["timing"]["weight_bytes"],
                                              setup["timing"]["copy_bytes_per_s"])
    for entry in artifacts:
        speedups = {}
        for label in ("batch_1", "batch"):
            eager_ms = (eager_bench.get(label) or {}).get("decode_best_ms")
            mine = ((entry.get("bench") or {}).get(label) or {}).get("decode_best_ms")
            if eager_ms and mine:
                speedups[label] = eager_ms / mine
        if entry.get("bench"):
            entry["bench"]["decode_speedup_vs_eager_generate"] = speedups

    problems = [f"{a['name']}: {a['error']}" for a in artifacts if a["status"] in ("failed", "numerics_failed")]
    failed_numerics = any(a["status"] == "numerics_failed" for a in artifacts) or not rewritten["numerics"]["passed"]
    if not rewritten["numerics"]["passed"]:
        rewritten["status"] = "numerics_failed"
        problems.insert(0, "rewritten: numerics failed: " + "; ".join(rewritten["numerics"]["failures"][:2]))
    if failed_numerics and not allow_drift:
        exit_code = EXIT_NUMERICS
    elif any(a["status"] == "failed" for a in artifacts):
        exit_code = EXIT_TARGET
    else:
        exit_code = EXIT_OK
    passed = not failed_numerics and not any(a["status"] == "failed" for a in artifacts)
    params = sum(p.numel() for p in model.parameters())
    dtypes: dict[str, int] = {}
    for info in loaded.checkpoint.entries.values():
        key = str(info.dtype).replace("torch.", "")
        dtypes[key] = dtypes.get(key, 0) + 1
    report = {
        "schema_version": 1,
        "task": "text-generation",
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "passed": passed, "exit_code": exit_code, "problems": problems, "allow_drift": allow_drift,
        "warnings": warnings,
        "model": {"name": model_name(Path(checkpoint)), "checkpoint": public_path(checkpoint),
                  "format": loaded.checkpoint.format, "architecture": loaded.architecture.name,
                  "architecture_source": loaded.architecture.source, "parameters": params,
                  "checkpoint_bytes": loaded.checkpoint.nbytes, "checkpoint_dtypes": dtypes},
        "recipe": {"name": recipe.name, "source": public_source(recipe), "device": device, "dtype": dtype_name,
                   "attention_backend": recipe.runtime.attention_backend,
                   "rewrite_attention": recipe.runtime.rewrite_attention, "targets": list(recipe.targets.build)},
        "generation": {
            "batch": gen.batch, "prompt_length": gen.prompt_length, "cache_length": gen.max_cache_len,
            "new_tokens": gen.new_tokens, "bench_tokens": gen.bench_tokens, "layout": layout.to_dict(),
            "padded_rows": [r for r in range(gen.batch) if r % 2 == 1], "pad_tokens": max(1, gen.prompt_length // 4),
            "reference_tokens": ref_tokens.tolist(),
            "eager": {"tokens_identical": bool(torch.equal(eager_picks, ref_tokens)), "numerics": eager_verdict},
            "copy_bytes_per_s": setup["timing"]["copy_bytes_per_s"],
            "weight_bytes": setup["timing"]["weight_bytes"],
        },
        "reference": {"device": device, "dtype": "float64", "model": "original (eager attention), no KV cache: "
                      "the whole sequence re-read at every step"},
        "tolerance": {"rule": RULE, "k": k, "atol": recipe.numerics.atol, "floor": recipe.numerics.floor,
                      "per_step": "each step's logits, teacher-forced on the reference's tokens"},
        "attention": {**audit.to_dict()},
        "baseline": {"name": "eager generate", "bench": eager_bench or None,
                     "note": "transformers generate(), greedy, its default cache and attention" if transformers
                     else "a factory model has no generate(); the rewritten row is the eager reference for timing"},
        "rewritten": rewritten,
        "artifacts": artifacts,
        "timings_s": {**{k2: round(v, 3) for k2, v in progress.timings.items()},
                      "total": round(time.perf_counter() - t_start, 3)},
        "environment": {"versions": versions(), "device": device_info(device, host=recipe.report.host)},
    }
    return finite(report), list(loaded.checkpoint.files)
