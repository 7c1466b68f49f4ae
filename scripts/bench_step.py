"""Time one training step of a Llama-shaped model: autopar against PyTorch's own parallelisms.

    python scripts/bench_step.py                      # defaults: a few minutes on a 2-core CPU box
    python scripts/bench_step.py --hidden 512 --layers 8 --iters 10

What it measures.  One step = forward + backward (the model's own loss, from
``labels``) + ``AdamW.step()`` + ``zero_grad()``, on ``--ranks`` CPU processes with
gloo (one thread each), for a ``transformers.LlamaForCausalLM`` built from a
``LlamaConfig`` with random weights.  Five variants train the same weights on the
same global batch inside the same processes:

    autopar auto      autopar.compile(...), the plan the search picks
    autopar TP        autopar.compile(..., family="tensor parallel")
    torch TP          parallelize_module on a 1-D DeviceMesh, Megatron's plan: ColwiseParallel for
                      q/k/v/gate/up, RowwiseParallel for o/down; embedding, norms and lm_head replicated
    autopar DP        autopar.compile(..., family="data parallel")
    torch DDP         DistributedDataParallel, each rank on its 1/ranks slice of the batch

and, only when named in ``--variants``, ``autopar DP unfused``: the same plan as
``autopar DP`` lowered without fusing the cross-entropy (``autopar/lower/fused_loss.py``), so
its ratio to ``autopar DP`` is what the fused log-softmax saves; and ``autopar DP 2-D``: the
data-parallel plan on the same ranks seen as a (2, ranks / 2) mesh, so its ratio to ``autopar DP``
is what a second mesh axis costs a data-parallel step (its gradients may ride one all-reduce over
both axes, ``Plan.flat_grad_axes``).

Every model returns only its loss (a wrapper around the HF model), so no variant
pays for gathering logits it does not need.  Measurements alternate: after
``--warmup`` steps of each variant, ``--iters`` rounds each time every variant
once (the order rotates per round), each step timed on rank 0 between two
barriers, so the slowest rank sets the time and background load hits every
variant alike.  It prints the median step time of each variant and the ratios.

How to read the ratios.  ``autopar auto / torch TP``, ``autopar auto / torch DDP``
(the plan a user gets by default against each peer), ``autopar TP / torch TP`` and
``autopar DP / torch DDP`` are median autopar time over median peer time from this
run: below 1.0 autopar is faster, above 1.0 slower (1.25 = 25 % slower).  CPU gloo
timings say how much overhead autopar's interpreter and collectives add relative
to PyTorch's, not what a GPU cluster would see; compare ratios, not seconds, and
only between runs on the same machine.  The first-step losses of all variants
should agree (same weights, same batch); if they do not, the ratio compares
different work.

``--variants "autopar DP,torch DDP"`` runs only those variants (faster; the
ratios of the pairs present are printed).  ``--phases`` also prints, per
variant, rank 0's median wall and CPU (process) time of forward, backward
(including waiting for gradient buckets) and optimizer step + zero_grad, and the
time autopar spent waiting for its bucketed gradient all-reduces at the end of
backward: where a step's time goes, not only how much there is.  Every run also
prints each variant's CPU seconds per step summed over all ranks (process time,
gloo's threads included) and its ratio: with more ranks than cores (4 on 2 here)
the ranks take turns on the cores, so the wall time follows the total CPU work and
the CPU ratio is the steadier of the two.

Notes.  With transformers >= 4.48 Llama attention reshapes with ``-1`` heads, so
the tensor-parallel peer needs no ``num_heads`` patching (older versions would:
see the PyTorch TP tutorial).  ``autopar DP`` is "parameters replicated", and the
planner may still split activations on non-batch dimensions; the table shows the
family each autopar plan was classified as and which parameters it shards.  At the
default sizes the forced tensor-parallel family may keep the layer weights replicated
(its batch split is cheaper than sharding them); ``--tp-mem-cap 80MiB`` makes it shard
them, for a tensor-parallel plan against Megatron's.  The autopar variants run with
compile's defaults: the auto plan may shard optimizer state (ZeRO-1/2,
``runtime/zero.py``) and data-parallel gradient all-reduces go in 25 MiB buckets
overlapped with backward (``runtime/buckets.py``), as DDP's do.  Printing only: no
assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

VARIANTS = ("autopar auto", "autopar TP", "torch TP", "autopar DP", "torch DDP", "autopar DP unfused", "autopar DP 2-D")
DEFAULT_VARIANTS = VARIANTS[:5]
PAIRS = (
    ("autopar auto", "torch TP"),
    ("autopar auto", "torch DDP"),
    ("autopar TP", "torch TP"),
    ("autopar DP", "torch DDP"),
    ("autopar DP unfused", "torch DDP"),
    ("autopar DP", "autopar DP unfused"),
    ("autopar DP 2-D", "autopar DP"),
)


class LossOnly(nn.Module):
    """The HF model's own loss and nothing else (no logits to return or gather)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="CPU gloo ranks (default 4)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each variant")
    p.add_argument("--iters", type=int, default=5, help="timed rounds (each runs every variant once)")
    p.add_argument(
        "--profile",
        default=None,
        help="device profile autopar plans for (default: compile's choice for gloo ranks, 'cpu'); "
        "e.g. h100 to run a GPU-shaped plan on these CPU ranks",
    )
    p.add_argument(
        "--tp-mem-cap",
        default=None,
        help="per-device memory cap for the autopar TP plan (e.g. 80MiB): at small batch the forced "
        "tensor-parallel family may keep layer weights replicated; a cap makes it shard them",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated variants to run (default: {', '.join(DEFAULT_VARIANTS)}; also 'autopar DP unfused')",
    )
    p.add_argument("--phases", action="store_true", help="also print per-phase wall and CPU times on rank 0")
    return p


def _variants(a) -> tuple[str, ...]:
    chosen = tuple(v.strip() for v in a.variants.split(",") if v.strip())
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown or not chosen:
        raise SystemExit(f"bench_step: unknown --variants {unknown or a.variants!r}; choose from {', '.join(VARIANTS)}")
    return tuple(v for v in VARIANTS if v in chosen)


def _config(a):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads or a.heads,
        intermediate_size=a.ffn,
        vocab_size=a.vocab,
        max_position_embeddings=max(a.seq, 128),
        use_cache=False,
        attention_dropout=0.0,
    )


def _torch_tp(model: LossOnly, ranks: int) -> LossOnly:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


class _Phases:
    """Wall and CPU seconds per phase of the timed steps (``--phases``), and autopar's bucket waits."""

    NAMES = ("forward", "backward", "optimizer", "bucket wait")

    def __init__(self) -> None:
        self.on = False
        self.wall: dict[str, dict[str, list[float]]] = {}
        self.cpu: dict[str, dict[str, list[float]]] = {}
        self._wait_s = 0.0
        from autopar.runtime import buckets

        finish = buckets._Round.finish

        def timed(rnd) -> None:
            t0 = time.perf_counter()
            finish(rnd)
            self._wait_s += time.perf_counter() - t0

        buckets._Round.finish = timed

    def step(self, name: str, module, inputs, opt) -> float:
        from autopar.measure.step_phases import timed_step

        self._wait_s = 0.0
        loss, phases = timed_step(module, inputs, {}, opt)
        if self.on:
            wall = self.wall.setdefault(name, {n: [] for n in self.NAMES})
            cpu = self.cpu.setdefault(name, {n: [] for n in self.NAMES})
            for phase, (w, c) in zip(self.NAMES, phases):
                wall[phase].append(w)
                cpu[phase].append(c)
            wall["bucket wait"].append(self._wait_s)
            cpu["bucket wait"].append(0.0)
        return float(loss.detach())


def _build(a, rank: int, world: int, variants: tuple[str, ...], phases: _Phases):
    """{variant: step function} and each autopar plan's description."""
    from transformers import LlamaForCausalLM

    import autopar

    torch.manual_seed(0)
    base = LossOnly(LlamaForCausalLM(_config(a)))
    base.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
    labels = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen)
    per = a.batch // world
    local = (ids[rank * per : (rank + 1) * per], labels[rank * per : (rank + 1) * per])
    mesh = autopar.Mesh((world,), axis_names=("x",))
    square = autopar.Mesh((2, world // 2), axis_names=("x", "y")) if "autopar DP 2-D" in variants else None

    models: dict[str, tuple[nn.Module, tuple]] = {}
    for name, family, cap in (
        ("autopar auto", None, None),
        ("autopar TP", "tensor parallel", a.tp_mem_cap),
        ("autopar DP", "data parallel", None),
        ("autopar DP unfused", "data parallel", None),
        ("autopar DP 2-D", "data parallel", None),
    ):
        if name not in variants:
            continue
        with _unfused_loss(name.endswith("unfused")):
            models[name] = (
                autopar.compile(
                    copy.deepcopy(base),
                    square if name.endswith("2-D") else mesh,
                    example_inputs=(ids, labels),
                    family=family,
                    profile=a.profile,
                    mem_cap=cap,
                ),
                (ids, labels),
            )
    if "torch TP" in variants:
        models["torch TP"] = (_torch_tp(copy.deepcopy(base), world), (ids, labels))
    if "torch DDP" in variants:
        models["torch DDP"] = (nn.parallel.DistributedDataParallel(copy.deepcopy(base)), local)

    steps = {}
    for name, (module, inputs) in models.items():
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

        def step(name=name, module=module, inputs=inputs, opt=opt) -> float:
            return phases.step(name, module, inputs, opt)

        steps[name] = step
    plans = {n: _describe(m.plan) for n, (m, _) in models.items() if hasattr(m, "plan")}
    return steps, plans


@contextlib.contextmanager
def _unfused_loss(on: bool):
    """While ``on``: lowering runs the decomposed cross-entropy as planned, never fused (``lower/fused_loss.py``)."""
    from autopar.lower import rewrite as executor

    fusable = executor.fusable_groups
    if on:
        executor.fusable_groups = lambda *args: {}
    try:
        yield
    finally:
        executor.fusable_groups = fusable


def _describe(plan) -> str:
    """The plan's family and which parameters it stores sharded (the family name alone hides that)."""
    from autopar.placement import Shard

    sharded = [k for k, v in plan.params.items() if any(isinstance(p, Shard) for p in v.placements)]
    groups = sorted({re.sub(r"^(model\.)+", "", re.sub(r"\.\d+\.", ".*.", k)).removesuffix(".weight") for k in sharded})
    shown = ", ".join(groups[:4]) + (", ..." if len(groups) > 4 else "")
    return f"{plan.family}; {len(sharded)}/{len(plan.params)} params sharded" + (f" ({shown})" if shown else "")


def _rank(rank: int, world: int, port: int, a) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=a.timeout),
    )
    try:
        t0 = time.perf_counter()
        variants = _variants(a)
        phases = _Phases()
        steps, plans = _build(a, rank, world, variants, phases)
        build_s = time.perf_counter() - t0
        first_loss = {}
        for name in variants:
            for i in range(a.warmup):
                loss = steps[name]()
                if i == 0:
                    if name == "torch DDP":  # each rank saw its slice: the mean is the global loss
                        t = torch.tensor(loss)
                        dist.all_reduce(t)
                        loss = float(t) / world
                    first_loss[name] = loss
        times: dict[str, list[float]] = {n: [] for n in variants}
        cpu: dict[str, list[float]] = {n: [] for n in variants}
        phases.on = True
        for it in range(a.iters):
            order = variants[it % len(variants) :] + variants[: it % len(variants)]
            for name in order:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                steps[name]()
                c1 = time.process_time()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)
        for name in variants:  # every rank's CPU seconds of each step, summed over the ranks
            total = torch.tensor(cpu[name], dtype=torch.float64)
            dist.all_reduce(total)
            cpu[name] = total.tolist()
        if rank == 0:
            _report(a, world, times, cpu, first_loss, plans, build_s, phases if a.phases else None)
    finally:
        dist.destroy_process_group()


def _report(a, world: int, times, cpu, first_loss, plans, build_s: float, phases: _Phases | None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=160)
    kv = a.kv_heads or a.heads
    con.print(
        f"Llama: hidden {a.hidden}, {a.layers} layers, {a.heads} heads ({kv} kv), ffn {a.ffn}, vocab {a.vocab}; "
        f"batch {a.batch} x seq {a.seq}; {world} CPU gloo ranks, 1 thread each; torch {torch.__version__}; "
        f"autopar profile {a.profile or 'cpu (default)'}; autopar TP cap {a.tp_mem_cap or 'none'}"
    )
    con.print(f"warmup {a.warmup} steps each, then {a.iters} interleaved rounds; setup {build_s:.1f} s")
    t = Table(title="one training step (forward + backward + AdamW), median over rounds", title_justify="left")
    for col in ("variant", "median", "min", "max", "CPU, all ranks", "first loss", "autopar plan"):
        t.add_column(col, justify="left" if col in ("variant", "autopar plan") else "right")
    med = {n: statistics.median(v) for n, v in times.items()}
    med_cpu = {n: statistics.median(v) for n, v in cpu.items()}
    for name in times:
        v = times[name]
        t.add_row(
            name,
            f"{med[name] * 1e3:.1f} ms",
            f"{min(v) * 1e3:.1f} ms",
            f"{max(v) * 1e3:.1f} ms",
            f"{med_cpu[name] * 1e3:.0f} ms",
            f"{first_loss[name]:.5f}",
            plans.get(name, "-"),
        )
    con.print(t)
    con.print(
        "ratios: median autopar step / median peer step (< 1: autopar faster); CPU: the same for the CPU "
        "seconds all ranks spent in a step (on a box with fewer cores than ranks the wall time follows it)"
    )
    r = Table()
    for col in ("pair", "ratio", "CPU ratio"):
        r.add_column(col, justify="left" if col == "pair" else "right")
    for mine, peer in PAIRS:
        if mine in med and peer in med:
            r.add_row(f"{mine} / {peer}", f"{med[mine] / med[peer]:.2f}", f"{med_cpu[mine] / med_cpu[peer]:.2f}")
    con.print(r)
    if phases is not None:
        p = Table(title="rank 0 per phase, median ms: wall (CPU of this process)", title_justify="left")
        p.add_column("variant", justify="left")
        for col in _Phases.NAMES:
            p.add_column(col, justify="right")
        for name in times:
            cells = []
            for phase in _Phases.NAMES:
                wall = statistics.median(phases.wall[name][phase]) * 1e3
                cpu = statistics.median(phases.cpu[name][phase]) * 1e3
                cells.append(f"{wall:.1f} ({cpu:.1f})" if phase != "bucket wait" else f"{wall:.1f}")
            p.add_row(name, *cells)
        con.print(p)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    kv = a.kv_heads or a.heads
    problems = [
        f"--{k} {v} is not divisible by --ranks {a.ranks}"
        for k, v in (("heads", a.heads), ("kv-heads", kv), ("ffn", a.ffn), ("batch", a.batch))
        if v % a.ranks
    ]
    if a.hidden % a.heads:
        problems.append(f"--hidden {a.hidden} is not divisible by --heads {a.heads}")
    if "autopar DP 2-D" in _variants(a) and (a.ranks % 2 or a.ranks < 4):
        problems.append(f"variant 'autopar DP 2-D' needs an even --ranks >= 4 (a (2, ranks / 2) mesh), got {a.ranks}")
    if problems:
        print("bench_step: " + "; ".join(problems), file=sys.stderr)
        return 2
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(a.ranks, port, a), nprocs=a.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
