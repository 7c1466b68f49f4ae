"""Price a measured fidelity run again with other device profiles: predicted vs measured, without the hardware.

    python scripts/reprice_fidelity.py f.json --benchmark configs/benchmarks/fidelity_gpu.toml --profiles h100 gpu.toml

``f.json`` is what ``autopar fidelity --json`` wrote on the machine (its measured step
times and peaks per plan variant).  ``--profiles`` may name a folder that ``autopar fidelity
--calibrate DIR`` wrote: each case is then priced with its own ``<model>-<mesh>.toml``.
Each case's variants are planned here with each profile (``autopar.measure.fidelity.plan_variants``,
as the harness plans them) and the plan of each variant is priced against the time and peak measured for that variant.
A profile that chooses another plan for a variant than the measured run did is priced
on its own plan, against the measured plan's numbers: the table says so (``plan differs``).
Per case and over all plans it prints the fidelity harness's figures (``autopar.measure.stats``):
Spearman of predicted against measured step time, the median |time error|, and the same over the
pipelined plans alone, with their predicted bubble against the measured one; per case, how the plan
priced fastest measured against the fastest measured (what a free search over these plans would choose).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autopar.measure.benchmark import load_benchmark
from autopar.measure.fidelity import plan_variants
from autopar.measure.stats import median, spearman
from autopar.planner import Plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="autopar fidelity --json output (the measured run)")
    ap.add_argument("--benchmark", default=None, help="the benchmark TOML the run used (default the fixed one)")
    ap.add_argument(
        "--profiles", nargs="+", required=True, help="device profiles: names, TOML paths, or --calibrate folders"
    )
    a = ap.parse_args()
    with open(a.json) as fh:
        measured = json.load(fh)["cases"]
    bench = load_benchmark(a.benchmark)
    by_name = {m.name: m for m in bench.models}
    for profile in a.profiles:
        print(f"\nprofile {profile}")
        rows = [row for case, data in measured.items() for row in _repriced(case, data, bench, by_name, profile)]
        _summary("all plans", rows)
        _summary("pipelined", [r for r in rows if r[3] is not None])


def _repriced(case: str, data: dict, bench, by_name: dict, profile: str) -> list[tuple]:
    """(case, predicted s, measured s, predicted bubble or None) per measured plan of ``case``, printed."""
    name, mesh_text = case.rsplit(" ", 1)
    mesh = tuple(int(x) for x in mesh_text.split("x"))
    if Path(profile).is_dir():  # the per-case profiles of ``autopar fidelity --calibrate``
        profile = str(Path(profile) / f"{name}-{mesh_text}.toml")
    plans, _ = plan_variants(by_name[name], mesh, bench.variants, profile)
    planned = {label: Plan.from_json(text) for labels, text in plans for label in labels}
    keys = {label: labels for labels, _ in plans for label in labels}
    out = []
    for row in data["plans"]:
        label = row["variants"][0]
        plan = planned[label]
        t, m = plan.cost.total_s, plan.memory.per_device_bytes
        same = set(keys[label]) == set(row["variants"])
        bubble = plan.pipeline.bubble_fraction if plan.pipeline is not None else None
        shown = "" if bubble is None else f"  bubble {bubble:.2f}/{row.get('measured_bubble') or 0:.2f}"
        print(
            f"  {case:18s} {label:26s} predicted {t * 1e3:8.1f} ms  measured {row['measured_s'] * 1e3:8.1f} ms"
            f"  time {t / row['measured_s'] - 1:+6.1%}  memory {m / row['peak_bytes'] - 1:+6.1%}{shown}"
            + ("" if same else "  (plan differs)")
        )
        out.append((case, t, row["measured_s"], bubble))
    rho = spearman([r[1] for r in out], [r[2] for r in out]) if len(out) > 1 else float("nan")
    chosen = min(out, key=lambda r: r[1])  # the plan priced fastest, as a free search over these would pick
    over = chosen[2] / min(r[2] for r in out)
    print(f"  {case}: Spearman {rho:.2f}; the plan priced fastest measures {over:.3f}x the fastest")
    return out


def _summary(what: str, rows: list[tuple]) -> None:
    if len(rows) < 2:
        return
    errors = [abs(p / m - 1) for _, p, m, _ in rows]
    rho = spearman([r[1] for r in rows], [r[2] for r in rows])
    worst = max(errors)
    print(f"  {what} ({len(rows)}): Spearman {rho:.2f}, |time error| median {median(errors):.1%}, worst {worst:.1%}")


if __name__ == "__main__":
    main()
