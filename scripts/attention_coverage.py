"""The attention rewrite's coverage table: every family and spelling, what the rewrite made of it, and the error.

    python scripts/attention_coverage.py                  # writes docs/attention-coverage.md
    python scripts/attention_coverage.py --out -          # prints it instead
    python scripts/attention_coverage.py --no-onnx        # skip the ONNX column (faster)

Exits 1 (after writing the table) when a row is not as src/exporter/testing/attention_zoo.py expects: a listed spelling
not rewritten, an unsafe one rewritten, SDPA missing from the program, or an error above 1e-4.

For each case of src/exporter/testing/attention_zoo.py (hand-written attention, nn.MultiheadAttention,
nn.TransformerEncoderLayer/DecoderLayer) and for tiny transformers models built from
configs (random weights), on the CPU in float32:

1. ``exporter.rewrite.rewrite_attention`` on sample 0 (batch 2 × seq 32): sites found,
   rewritten, already SDPA, skipped; the max abs error of the rewritten eager model;
2. the rewritten model exported with named dynamic dims (batch 1..8, sequence 2..64) and
   decomposed as the exported_program target does: SDPA and softmax nodes left, and the
   max abs error at batch 3 × seq 17 against the original eager model;
3. the kernels that ran in that program (``exporter.kernels``);
4. the program converted to ONNX (opset 23, masks expanded for onnxruntime by
   ``exporter.rewrite.onnx_attention_masks``) and run with onnxruntime at 3 × 17:
   ``Attention`` and ``Softmax`` ops, max abs error.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from exporter.measure.kernels import profile  # noqa: E402
from exporter.modelio import Signature, discover_outputs, make_io_module  # noqa: E402
from exporter.rewrite import rewrite_attention  # noqa: E402
from exporter.rewrite.graph_facts import count_graph_ops  # noqa: E402
from exporter.rewrite.onnx_attention_masks import expand_attention_masks  # noqa: E402
from exporter.testing import attention_zoo as zoo  # noqa: E402

TIMM_REASON = ("not run here: timm needs torchvision, and PyPI's torchvision wheel does not load beside "
               "torch 2.13.0+cpu (its C++ ops fail to register)")


def max_error(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def zoo_entries():
    for case in zoo.CASES:
        model = zoo.build(case)
        yield case.family, case.spelling, case.name, model, ("x", "mask"), zoo.inputs(), zoo.inputs(3, 17, seed=1)


def problems(rows: list[dict]) -> list[str]:
    """Rows that do not show what they must: every listed spelling rewritten (or already SDPA) with a small
    error, every unsafe one left alone."""
    found = []
    for r in rows:
        if "missing" in r:
            continue
        case = zoo.BY_NAME.get(r["name"])
        expect, sites = (case.expect, case.sites) if case else ("rewritten", 2)
        counts = {"rewritten": r["rewritten"], "already_sdpa": r["already_sdpa"], "skipped": r["skipped"],
                  "none": r["found"]}
        if expect == "none" and r["found"] != 0 or expect != "none" and counts[expect] != sites:
            found.append(f"{r['name']}: expected {sites} {expect}, got {counts}")
        errors = [r["err_program"]] + ([r["err_onnx"]] if "err_onnx" in r else [])
        if expect in ("rewritten", "already_sdpa") and max(errors) > 1e-4:
            found.append(f"{r['name']}: max error {max(errors):.2e}")
        if expect in ("rewritten", "already_sdpa") and (r["sdpa_nodes"] != sites or r["softmax_nodes"]):
            found.append(f"{r['name']}: {r['sdpa_nodes']} SDPA and {r['softmax_nodes']} softmax nodes in the program")
    return found


def transformers_entries():
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000)
    configs = [
        ("padding mask (BertModel)", "bert", transformers.BertModel(transformers.BertConfig(**small))),
        ("causal (GPT2Model)", "gpt2", transformers.GPT2Model(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=1000))),
        ("causal, grouped-query (LlamaModel)", "llama", transformers.LlamaModel(transformers.LlamaConfig(
            num_key_value_heads=2, max_position_embeddings=128, **small))),
    ]

    def tokens(batch, seq, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 1000, (batch, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[-1, seq - 3:] = 0
        return [ids, mask]

    for spelling, name, model in configs:
        yield "transformers (eager attention)", spelling, name, model.eval(), ("input_ids", "attention_mask"), \
            tokens(2, 32, 0), tokens(3, 17, 1)
    for spelling, name, model in configs:  # the same models through the graph rule alone
        yield GRAPH_ONLY, spelling, name + "_graph", model.eval(), ("input_ids", "attention_mask"), \
            tokens(2, 32, 0), tokens(3, 17, 1)


GRAPH_ONLY = "transformers eager, graph rule alone"


def graph_rule_only(io, example):
    from exporter.rewrite import graph_rule
    from exporter.rewrite.audit import AttentionAudit

    audit = AttentionAudit()
    return graph_rule.rewrite(io, example, audit), audit


def measure(family, spelling, name, model, names, example, other, onnx: bool) -> dict:
    from exporter.modelio import is_transformers_model

    row = {"family": family, "spelling": spelling, "name": name}
    outputs = discover_outputs(model, dict(zip(names, example)))
    outputs = outputs[:1] if is_transformers_model(model) else outputs
    io = make_io_module(model, Signature(names, outputs), "eager" if is_transformers_model(model) else None)
    t0 = time.perf_counter()
    rewritten, audit = (graph_rule_only if family == GRAPH_ONLY else rewrite_attention)(io, example)
    row["rewrite_s"] = time.perf_counter() - t0
    counts = audit.to_dict()
    row.update({k: counts[k] for k in ("found", "rewritten", "already_sdpa", "skipped")})
    row["sites"] = counts["sites"]
    with torch.inference_mode():
        row["err_eager"] = max_error(io(*example), rewritten(*example))
    program = zoo.export_named(rewritten, example, names)
    ops = count_graph_ops(program.graph)
    row["sdpa_nodes"], row["softmax_nodes"] = ops["sdpa"], ops["softmax"]
    with torch.inference_mode():
        expected = io(*other)
        row["err_program"] = max_error(expected, program.module()(*other))
        module = program.module()
        row["kernels"] = profile(lambda: module(*other))
    if onnx:
        import numpy as np
        import onnx as onnx_lib
        import onnxruntime as ort

        expand_attention_masks(program)
        with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io_sink()):
            path = os.path.join(folder, "model.onnx")
            torch.onnx.export(program, (), dynamo=True, opset_version=23, input_names=list(names),
                              output_names=list(outputs), optimize=False, verbose=False).save(path)
            op_types = collections.Counter(n.op_type for n in onnx_lib.load(path).graph.node)
            session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            got = session.run(None, {n: t.numpy() for n, t in zip(names, other)})
        row["onnx_attention"], row["onnx_softmax"] = op_types.get("Attention", 0), op_types.get("Softmax", 0)
        row["err_onnx"] = max(float(np.abs(g.astype(np.float64) - e.double().numpy()).max())
                              for g, e in zip(got, expected))
    return row


def io_sink():
    return io.StringIO()


def properties(sites) -> str:
    flags = []
    for key, label in (("causal", "causal"), ("masked", "masked"), ("grouped_query", "GQA")):
        if any(s[key] for s in sites):
            flags.append(label)
    dims = sorted({s["head_dim"] for s in sites if s["head_dim"]})
    return ", ".join(flags + ([f"d={'/'.join(map(str, dims))}"] if dims else [])) or "—"


def kernel_text(k: dict) -> str:
    backends = ", ".join(f"{b} ×{n}" for b, n in k["backends"].items()) or "no SDPA"
    return backends + (f"; softmax ×{k['softmax_kernels']}" if k["softmax_kernels"] else "")


def render(rows: list[dict], onnx: bool, seconds: float) -> str:
    import transformers

    ort_version = ""
    with contextlib.suppress(ImportError):
        import onnxruntime

        ort_version = f", onnxruntime {onnxruntime.__version__}"
    lines = [
        "# Attention rewrite coverage",
        "",
        "Generated by `python scripts/attention_coverage.py` (do not edit by hand) on "
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}{ort_version}; "
        f"{seconds:.0f} s. CPU, float32.",
        "",
        "Each row is a two-layer model (the cases are in `src/exporter/testing/attention_zoo.py`; the transformers "
        "rows are tiny models built from configs with random weights, loaded with eager attention). Columns: "
        "attention sites "
        "found by `rewrite_attention` on batch 2 × seq 32, and how many were rewritten to SDPA, were SDPA "
        "already, or were skipped; SDPA and softmax nodes in the rewritten model's exported program "
        "(named dynamic dims batch 1–8, sequence 2–64, decomposed as the `exported_program` target does); the "
        "kernels that ran in that program (`exporter.kernels`, CPU); ONNX `Attention`/`Softmax` ops at opset 23; "
        "max abs error against the original eager model: the rewritten eager model on the 2 × 32 sample, the "
        "exported program and onnxruntime on a new batch 3 × seq 17 sample.",
        "",
    ]
    header = ["family", "spelling", "found", "rewritten", "already SDPA", "skipped", "properties",
              "SDPA / softmax nodes", "CPU kernels (program)"]
    header += ["ONNX Attention / Softmax"] if onnx else []
    header += ["max err eager 2×32", "max err program 3×17"] + (["max err ONNX 3×17"] if onnx else [])

    def table(selected: list[dict]) -> list[str]:
        out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        for r in selected:
            if "missing" in r:
                out.append(f"| {r['family']} | {r['spelling']} | " + " | ".join(["—"] * (len(header) - 3))
                           + f" | {r['missing']} |")
                continue
            cells = [r["family"], r["spelling"], str(r["found"]), str(r["rewritten"]), str(r["already_sdpa"]),
                     str(r["skipped"]), properties(r["sites"]), f"{r['sdpa_nodes']} / {r['softmax_nodes']}",
                     kernel_text(r["kernels"])]
            if onnx:
                cells.append(f"{r['onnx_attention']} / {r['onnx_softmax']}")
            cells += [f"{r['err_eager']:.1e}", f"{r['err_program']:.1e}"] + ([f"{r['err_onnx']:.1e}"] if onnx else [])
            out.append("| " + " | ".join(cells) + " |")
        return out

    positive = [r for r in rows if r.get("family") != "unsafe"]
    negative = [r for r in rows if r.get("family") == "unsafe"]
    lines += ["## Rewritten or already SDPA", ""] + table(positive)
    lines += ["", "## Left alone, with the reason", "",
              "Attention the rewrite must not touch; each site is reported as skipped with this reason, and the "
              "program keeps its softmax.", ""]
    lines += table(negative)
    lines += ["", "| case | reason reported |", "| --- | --- |"]
    for r in negative:
        reasons = sorted({s["reason"] for s in r["sites"]}) or ["(no attention site: nothing reported)"]
        lines.append(f"| {r['spelling']} | {'; '.join(reasons)} |")
    lines += ["", "## Notes", "",
              f"- \"{GRAPH_ONLY}\": the transformers models again, their eager attention rewritten by "
              "`softmax_attention_graph` alone (what happens to a model whose attention does not go through "
              "transformers' attention interface): BERT's additive mask, GPT-2's, Llama's `repeat_kv` and softmax "
              "in float32. Their masks mix causal and padding and come from the input, so they stay masks.",
              "- nn.MultiheadAttention, nn.TransformerEncoderLayer and DecoderLayer build `(batch, 1, 1, key)` "
              "padding masks; onnxruntime's CPU `Attention` kernel rejects masks that broadcast over the query "
              "length, so the ONNX column uses programs passed through "
              "`exporter.rewrite.onnx_attention_masks.expand_attention_masks` (the masks the graph rule writes are "
              "already full).",
              f"- timm `Attention` with `fused_attn=False`: {TIMM_REASON}. The rule "
              "(`timm_fused_attention`) uses timm's real class and its tests skip with this reason; timm's unfused "
              "spelling (pre-scaled q, `@ k.transpose(-2, -1)`, additive mask, softmax, dropout) is covered by the "
              "hand-written rows.",
              ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "attention-coverage.md"), help="file to write, or -")
    parser.add_argument("--no-onnx", action="store_true", help="skip the ONNX export and run")
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t0 = time.perf_counter()
    rows = []
    for entry in list(zoo_entries()) + list(transformers_entries()):
        if args.only and entry[2] not in args.only:
            continue
        print(f"{entry[2]} ...", file=sys.stderr, flush=True)
        rows.append(measure(*entry, onnx=not args.no_onnx))
    if not args.only:
        rows.append({"family": "timm", "spelling": "Attention, fused_attn=False", "missing": TIMM_REASON})
    text = render(rows, not args.no_onnx, time.perf_counter() - t0)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    wrong = problems(rows)
    for line in wrong:
        print(f"NOT AS EXPECTED: {line}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
