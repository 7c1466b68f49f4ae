"""Plan a fixed set of configurations and compare the plans with a saved run: a refactor must not move them.

    python scripts/compare_plans.py -o before.json              # on the old code (a git worktree)
    python scripts/compare_plans.py -o after.json --against before.json

The set covers what the planner decides: tiny models planned for real and full-size models on the meta
device, 1-D and 2-D meshes, every recomputation mode, a hint, memory caps that bind, several profiles and
dtypes.  ``--against`` prints every difference between the two runs' plan JSON (ignoring the schema version,
and reading the memory parts of schema 1, ``params`` etc., as schema 2's ``params_bytes``) and exits 1 when
any plan differs.  Run it from another folder with ``PYTHONPATH=<old worktree>`` to plan with older code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import autopar

try:
    from autopar.models import load_model
except ImportError:  # code before autopar.models existed
    from autopar.launch.models import load_model

CHEAP = str(Path(__file__).resolve().parents[1] / "tests" / "profiles" / "cheap_comm.toml")
#: (model, load_model keywords, mesh shape, plan keywords)
CASES: list[tuple[str, dict, tuple[int, ...], dict]] = [
    ("gpt2-tiny", {"batch": 4, "seq": 32}, (2,), {"profile": "h100"}),
    ("gpt2-tiny", {"batch": 8, "seq": 64}, (2, 2), {"profile": CHEAP, "recompute": "auto"}),
    ("gpt2-tiny", {"batch": 8, "seq": 64}, (2, 2), {"profile": CHEAP, "hints": {"*.mlp.c_fc.weight": "R,S(1)"}}),
    ("llama-tiny", {"batch": 8, "seq": 64}, (4,), {"profile": CHEAP, "recompute": "full"}),
    ("bert-tiny", {"batch": 8, "seq": 64}, (2, 2), {"profile": "cpu"}),
    (
        "gpt2",
        {"batch": 8, "seq": 1024, "device": "meta"},
        (4, 2),
        {"profile": "h100", "mem_cap": "8GiB", "dtype": "bf16"},
    ),
    (
        "llama-7b-shaped",
        {"batch": 16, "seq": 2048, "device": "meta"},
        (8,),
        {"profile": "a100", "mem_cap": "40GiB", "dtype": "bf16"},
    ),
    (
        "gpt2-xl",
        {"batch": 32, "seq": 1024, "device": "meta"},
        (8, 2),
        {"profile": "h100", "mem_cap": "24GiB", "dtype": "bf16", "recompute": "auto"},
    ),
]
_V1_MEMORY = {"params": "params_bytes", "grads": "grads_bytes", "optimizer": "optimizer_bytes"}
_V1_MEMORY["activations"] = "activations_bytes"


def plan_all() -> dict[str, Any]:
    """Case label -> the plan's JSON dict."""
    out = {}
    for name, load, mesh, options in CASES:
        model, args, kwargs = load_model(name, **load)
        t0 = time.perf_counter()
        plan = autopar.plan(model, autopar.Mesh(mesh), example_inputs=args, example_kwargs=kwargs, **options)
        label = f"{name} {mesh} {sorted(options)}"
        out[label] = json.loads(plan.to_json())
        print(f"{label}: {time.perf_counter() - t0:.1f} s, {plan!r}", flush=True)
    return out


def _normal(plan: dict) -> dict:
    plan = {k: v for k, v in plan.items() if k != "schema_version"}
    plan["memory"] = {_V1_MEMORY.get(k, k): v for k, v in plan.get("memory", {}).items()}
    return plan


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place two JSON values differ (a key absent on one side and empty or false on the other is equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if key in a and key in b:
                out += differences(a[key], b[key], f"{path}/{key}")
            elif (a.get(key) if key in a else b.get(key)) not in (None, False, [], {}, ""):
                out.append(f"{path}/{key}: only {'before' if key in a else 'after'}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} entries before, {len(b)} after"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:60]} before, {str(b)[:60]} after"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", required=True, help="write the plans' JSON here")
    parser.add_argument("--against", help="a run of this script to compare with")
    args = parser.parse_args()
    plans = plan_all()
    Path(args.out).write_text(json.dumps(plans, indent=1, sort_keys=True))
    if not args.against:
        return 0
    before = json.loads(Path(args.against).read_text())
    moved = 0
    for label in sorted(set(before) | set(plans)):
        if label not in before or label not in plans:
            print(f"{label}: only in {'the saved run' if label in before else 'this run'}")
            continue
        found = differences(_normal(before[label]), _normal(plans[label]))
        moved += bool(found)
        print(f"{label}: {'the same plan' if not found else f'{len(found)} differences'}")
        for line in found[:20]:
            print(f"  {line}")
    print(f"{len(plans) - moved} of {len(plans)} plans the same")
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
