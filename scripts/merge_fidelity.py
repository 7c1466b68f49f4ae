"""Merge the cases of several ``autopar fidelity --json`` files into one report, as one run would have written it.

    python scripts/merge_fidelity.py OUT.json A.json B.json [...]

For a benchmark measured in parts (``--models``, ``--mesh``: a run stopped partway and its remaining cases run
again, or cases measured while the machine was busy measured again on a quiet one).  Each case is calibrated,
planned and timed on its own (``autopar fidelity --calibrate``), so cases from different runs of the same code
combine; a case in several files is taken from the last.  The figures over all plans (Spearman, median errors,
memory) are recomputed by ``autopar.measure.fidelity.summarize``; ``wall_s`` is the files' sum.
"""

from __future__ import annotations

import argparse
import json

from autopar.measure.fidelity import CaseResult, FidelityRun, PlanResult, summarize


def _cases(report: dict) -> list[CaseResult]:
    out = []
    for key, case in report["cases"].items():
        model, mesh = key.rsplit(" ", 1)
        plans = tuple(
            PlanResult(
                tuple(p["variants"]),
                p["family"],
                p["predicted_s"],
                p["predicted_compute_s"],
                p["predicted_comm_s"],
                p["predicted_bytes"],
                tuple(p["round_s"]),
                tuple(p["peak_steps"]),
                p["held_bytes"],
                p["predicted_bubble"],
                p["measured_bubble"],
            )
            for p in case["plans"]
        )
        slowdown = case.get("machine_slowdown")  # kept as the probe's ratio: before 1.0, during the slowdown
        probe = (1.0, (slowdown,)) if slowdown is not None else (None, ())
        shape = tuple(int(x) for x in mesh.split("x"))
        out.append(CaseResult(model, shape, plans, case["infeasible"], case.get("profile", ""), *probe))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the merged report to write")
    ap.add_argument("parts", nargs="+", help="autopar fidelity --json files, in the order cases override")
    a = ap.parse_args()
    reports = [json.load(open(path)) for path in a.parts]
    cases: dict[str, CaseResult] = {}
    for report in reports:
        for case in _cases(report):
            cases[case.key] = case
    first = reports[0]
    run = FidelityRun(
        tuple(cases.values()),
        first["profile"],
        first["ranks"],
        first["benchmark"],
        sum(r["wall_s"] for r in reports),
        len(cases),
    )
    merged = summarize(run)
    with open(a.out, "w") as fh:
        json.dump(merged, fh, indent=2)
    print(
        f"{len(cases)} cases: Spearman {merged['spearman']:.2f}, median time error "
        f"{merged['median_abs_error']:.1%}, memory median {merged['memory_median_abs_error']:.1%} "
        f"worst {merged['memory_max_error']:.1%}"
    )


if __name__ == "__main__":
    main()
