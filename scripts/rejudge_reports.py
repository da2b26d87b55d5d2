"""Re-judge stored reports under the current tolerance rule, from their recorded figures (no model is run).

    python scripts/rejudge_reports.py docs/runs/*.report.json

For each candidate's worst check per output: the recorded RMSE, the bar the report was judged with, and
the bar of ``k * eager RMSE + floor * u(dtype) * rms(reference) + atol`` with the given floor and atol
(rms(reference) is recovered as rmse / rel_l2). Used for docs/numerics.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from exporter.numerics.tolerance import relative_floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("--floor", type=float, default=1.0)
    parser.add_argument("--atol", type=float, default=0.0)
    args = parser.parse_args()
    for path in args.reports:
        report = json.loads(path.read_text())
        print(f"{path.name} (judged with atol {report['tolerance'].get('atol')})")
        for variant in [report["rewritten"], *report["artifacts"]]:
            numerics = variant.get("numerics") or {}
            for check in numerics.get("outputs") or []:
                if not check["rel_l2"] > 0:
                    continue
                ref_rms = check["rmse"] / check["rel_l2"]
                bar = (numerics["k"] * check["baseline_rmse"] + relative_floor(args.floor, variant["dtype"]) * ref_rms
                       + args.atol)
                print(f"  {variant['name']:22} {variant['dtype']:9} {check['output']:10} rmse {check['rmse']:.3g}  "
                      f"bar then {check['allowed_rmse']:.3g} ({'pass' if check['passed'] else 'FAIL'})  "
                      f"bar now {bar:.3g} ({'pass' if check['rmse'] <= bar else 'FAIL'})")


if __name__ == "__main__":
    main()
