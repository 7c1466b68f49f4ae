"""Planning time and memory over many training configurations, the slowest first.

    python scripts/sweep_search.py                       # the default sweep (48 configurations + the issue's two)
    python scripts/sweep_search.py --count 80 --seed 3   # another sample of the grid
    python scripts/sweep_search.py --budget 30 --timeout 120 --json sweep.json
    python scripts/sweep_search.py --pipeline auto       # the search may pipeline over an axis too

Each configuration is planned with ``autopar.plan`` in its own forked process (so its peak RSS is its own, and a
configuration that runs past ``--timeout`` is killed and reported as such), on a model built on the meta device
from a Hugging Face config class: GPT-2-shaped (``GPT2LMHeadModel``) or Llama-shaped (``LlamaForCausalLM``, grouped
KV heads), with the loss inside the model (``labels``) or the logits returned.  The grid (sampled with ``--seed``,
every axis covered): widths 1024-8192, 12-96 layers, batches 8-2048 sequences of 2048-8192 tokens, meshes (8,) to
(64, 8) with (32, 2), profiles a100 / h100 / cpu, caps from 16 GiB to none, recompute auto / full / none.

Columns: plan s (the whole ``autopar.plan`` call: capture, strategies, search), search s (the search part,
``plan.timings["search_s"]``), RSS GiB (the process's peak), the plan's step (ms), its memory per device, its proven
gap (``optimal`` when exact), its pipeline (``none``, or schedule, stages and micro-batches), and the status
(``ok``; ``no plan fits`` when the cap is below every plan's peak: a correct answer, timed too; ``budget`` when the
search stopped at ``search_budget_s``; ``timeout``; or the error). A summary line gives the worst and median plan
and search times and the worst RSS.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import resource
import statistics
import time
from dataclasses import asdict, dataclass

GIB = 2**30


@dataclass(frozen=True, slots=True)
class Config:
    """One planning run: the model's shape, the batch, the mesh and the planner's options."""

    family: str  # "gpt" or "llama"
    layers: int
    width: int
    batch: int
    seq: int
    mesh: tuple[int, ...]
    profile: str
    cap: str | None
    recompute: str
    labels: bool

    @property
    def label(self) -> str:
        mesh = "x".join(map(str, self.mesh))
        loss = "loss" if self.labels else "logits"
        return (
            f"{self.family}-{self.layers}L-w{self.width} b{self.batch}x{self.seq} {mesh} {self.profile} "
            f"cap={self.cap or 'none'} {self.recompute} {loss}"
        )


#: the configurations of issue 28 (a GPT-2-shaped 2.6B model and a 1.7B one, logits returned)
ISSUE_CONFIGS = (
    Config("gpt", 30, 3072, 512, 2048, (32, 2), "a100", "80GiB", "auto", False),
    Config("gpt", 24, 2304, 512, 2048, (32, 1), "a100", "80GiB", "auto", False),
)

GRID = {
    "family": ("gpt", "llama"),
    "layers": (12, 24, 32, 48, 64, 96),
    "width": (1024, 2048, 2304, 3072, 4096, 5120, 8192),
    "batch": (8, 32, 128, 512, 2048),
    "seq": (2048, 4096, 8192),
    "mesh": ((8,), (64,), (4, 2), (8, 8), (16, 4), (32, 2), (64, 8)),
    "profile": ("a100", "h100", "cpu"),
    "cap": (None, "80GiB", "40GiB", "24GiB", "16GiB"),
    "recompute": ("auto", "auto", "full", "none"),
    "labels": (True, False),
}


def sample(count: int, seed: int) -> list[Config]:
    """``count`` configurations drawn from :data:`GRID`, each axis cycled through all its values (a shuffled
    round robin per axis, so every value appears), the batch at least the data-parallel degree it is split by
    over the first mesh axis where it can be."""
    rng = random.Random(seed)
    columns = {}
    for axis, values in GRID.items():
        cycle = []
        while len(cycle) < count:
            chunk = list(values)
            rng.shuffle(chunk)
            cycle += chunk
        columns[axis] = cycle[:count]
    return [Config(**{axis: columns[axis][i] for axis in GRID}) for i in range(count)]


def build(config: Config):
    """(model, example args, example kwargs) on the meta device."""
    import torch
    import transformers

    if config.family == "gpt":
        heads = max(config.width // 128, 8)
        hf = transformers.GPT2Config(
            n_layer=config.layers,
            n_embd=config.width,
            n_head=heads,
            vocab_size=50257,
            n_positions=config.seq,
            use_cache=False,
        )
        cls = transformers.GPT2LMHeadModel
    else:
        heads = config.width // 128
        kv_heads = max(d for d in range(1, 9) if heads % d == 0)  # grouped: the most groups up to 8 that divide
        hf = transformers.LlamaConfig(
            hidden_size=config.width,
            intermediate_size=(config.width * 8 // 3 + 255) // 256 * 256,
            num_hidden_layers=config.layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            vocab_size=32000,
            max_position_embeddings=config.seq,
            use_cache=False,
        )
        cls = transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(hf)
    ids = torch.zeros(config.batch, config.seq, dtype=torch.long, device="meta")
    return model, (ids,), ({"labels": ids} if config.labels else {})


def plan_one(config: Config, options: dict, out) -> None:
    """Plan ``config`` with the planner ``options`` (``search_budget_s``, ``pipeline``) and send a result dict
    through the pipe ``out`` (run in a child process)."""
    import autopar
    from autopar.planner.errors import MemoryCapError

    row: dict = {"config": config.label}
    try:
        model, args, kwargs = build(config)
        names = ("dp", "tp")[: len(config.mesh)] if len(config.mesh) <= 2 else None
        mesh = autopar.Mesh(config.mesh, axis_names=names)
        start = time.perf_counter()
        try:
            plan = autopar.plan(
                model,
                mesh,
                example_inputs=args,
                example_kwargs=kwargs,
                mem_cap=config.cap,
                profile=config.profile,
                dtype="bf16" if config.profile != "cpu" else "fp32",
                devices_per_node=8 if config.profile != "cpu" else None,
                compare_families=False,
                recompute=config.recompute,
                **options,
            )
        except MemoryCapError as e:
            row.update(status="no plan fits", plan_s=time.perf_counter() - start, error=str(e).splitlines()[0])
        else:
            search = plan.search
            row.update(
                status="budget" if search.budget_hit else "ok",
                plan_s=time.perf_counter() - start,
                search_s=plan.timings.get("search_s"),
                step_ms=plan.cost.total_s * 1e3,
                memory_gib=plan.memory.per_device_bytes / GIB,
                gap=None if search.optimal else search.gap,
                pipeline=_pipeline_of(plan),
            )
    except Exception as e:  # noqa: BLE001 - a sweep reports every failure and goes on
        row.update(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    row["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out.send(row)


def _pipeline_of(plan) -> str:
    """``none``, or the plan's schedule, stages and micro-batches (``1f1b p4 m8``)."""
    pipe = plan.pipeline
    if pipe is None:
        return "none" if plan.microbatches == 1 else f"none m{plan.microbatches}"
    return f"{pipe.schedule} p{len(pipe.stages)} m{plan.microbatches}"


def run(config: Config, options: dict, timeout: float) -> dict:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=plan_one, args=(config, options, child))
    start = time.perf_counter()
    proc.start()
    row = parent.recv() if parent.poll(timeout) else None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if row is None:
        row = {"config": config.label, "status": f"timeout ({timeout:.0f} s)", "plan_s": time.perf_counter() - start}
    return row


def table(rows: list[dict]) -> str:
    head = "| configuration | plan s | search s | RSS GiB | step ms | memory GiB | gap | pipeline | status |"
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in sorted(rows, key=lambda r: -(r.get("plan_s") or 0)):
        gap = r.get("gap")
        lines.append(
            f"| {r['config']} | {num(r.get('plan_s'), '.2f')} | {num(r.get('search_s'), '.2f')} | "
            f"{num(r.get('rss_gib'), '.2f')} | {num(r.get('step_ms'), '.1f')} | {num(r.get('memory_gib'), '.2f')} | "
            f"{'exact' if gap is None and r.get('status') == 'ok' else num(gap, '.1e')} | {r.get('pipeline', '-')} | "
            f"{r['status']} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    plan_s = [r["plan_s"] for r in rows if r.get("plan_s") is not None]
    search_s = [r["search_s"] for r in rows if r.get("search_s") is not None]
    rss = [r["rss_gib"] for r in rows if r.get("rss_gib") is not None]
    bad = [r for r in rows if r["status"] not in ("ok", "no plan fits")]
    return (
        f"{len(rows)} configurations: plan s worst {max(plan_s):.2f}, median {statistics.median(plan_s):.2f}; "
        f"search s worst {max(search_s):.2f}, median {statistics.median(search_s):.2f}; "
        f"RSS worst {max(rss):.2f} GiB; not ok: {len(bad)}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=48, help="configurations drawn from the grid (besides the issue's)")
    ap.add_argument("--seed", type=int, default=28)
    ap.add_argument("--budget", type=float, default=None, help="search_budget_s (default: the planner's)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds before a configuration is killed")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", type=int, nargs="*", help="run only these indices of the list (0, 1: the issue's)")
    ap.add_argument("--pipeline", default=None, help="pipeline= for every plan (default: the planner's)")
    args = ap.parse_args()
    options = {"search_budget_s": args.budget, "pipeline": args.pipeline}
    options = {k: v for k, v in options.items() if v is not None}
    configs = [*ISSUE_CONFIGS, *sample(args.count, args.seed)]
    if args.only:
        configs = [configs[i] for i in args.only]
    rows = []
    for i, config in enumerate(configs):
        row = run(config, options, args.timeout)
        rows.append(row)
        print(
            f"[{i + 1}/{len(configs)}] {row['config']}: {row.get('plan_s', 0):.2f} s, "
            f"{row.get('rss_gib') or 0:.2f} GiB, {row['status']}",
            flush=True,
        )
    print()
    print(table(rows))
    print()
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"configs": [asdict(c) for c in configs], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
