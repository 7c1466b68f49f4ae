"""Activation recomputation at run time (``lower/recompute.py``): a plan's recompute regions train exactly as saved.

The plan marks each op of the repeated blocks with its block (``nodes[...].recompute``);
lowering runs every such block under ``torch.utils.checkpoint`` and backward runs its
forward again.  With dropout on, on 2 and 4 gloo ranks, under data-parallel,
tensor-parallel and sharded-parameter plans, training with the blocks recomputed
must equal training with everything saved, bit for bit (the dropout masks replayed,
the collectives re-run): losses, gradients and parameters after three AdamW steps.
The block's forward collectives run again in backward and are counted.

The first test marks the regions in the plan itself; the others let the planner choose
(``planner/recompute_tables.py``): only where it pays, priced (forward time added, activations
removed, the moves and collectives run again listed), and run as planned.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE, run_ranks

STEPS = 3
#: (model, mesh, family): each model on 2 ranks under a family that moves tensors inside the layers, one 2x2 auto
#: plan and one 4-rank plan
CASES = [
    ("gpt2-tiny", (2,), "tensor parallel"),
    ("llama-tiny", (2,), "sharded parameters"),
    ("bert-tiny", (2,), "data parallel"),
    ("gpt2-tiny", (2, 2), None),
    ("llama-tiny", (4,), "tensor parallel"),
]


def _fresh(name: str):
    from autopar.models import load_model

    torch.manual_seed(0)
    return load_model(name, batch=4, seq=16, device="cpu")  # dropout as configured: on


def _with_blocks_recomputed(sharded):
    """The compiled module's plan with every op of its repeated blocks in its block's recompute region."""
    from autopar.capture import find_blocks

    graph = sharded._graph
    blocks = find_blocks(graph, min_count=2)
    region = {
        graph.nodes[i].name: f"{blocks.prefix}.{blocks.indices[b]}"
        for b, nodes in enumerate(blocks.nodes)
        for i in nodes
        if graph.nodes[i].kind == "op"
    }
    plan = sharded.plan
    nodes = {k: dataclasses.replace(v, recompute=region[k]) if k in region else v for k, v in plan.nodes.items()}
    return dataclasses.replace(plan, nodes=nodes), len(blocks.nodes)


def _train(sharded, args, kwargs):
    from autopar.runtime import CollectiveCounter

    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3, eps=1e-6)
    losses, grads, counter = [], None, CollectiveCounter()
    for step in range(STEPS):
        sharded.collective_counter = counter if step == 0 else None
        loss = sharded(*args, **kwargs)[0]
        loss.backward()
        if step == 0:
            grads = sharded.full_grads()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, grads, sharded.full_state_dict(), counter.summary()


def _rank_fn(rank, world, name, mesh_shape, family):
    import autopar

    mesh = autopar.Mesh(mesh_shape, axis_names=("x", "y")[: len(mesh_shape)])
    model, args, kwargs = _fresh(name)
    probe = autopar.compile(
        model, mesh, example_inputs=args, example_kwargs=kwargs, family=family, profile=PARTITIONING_PROFILE
    )
    probe(*args, **kwargs)  # compiles: the graph and plan exist from here
    recomputed, count = _with_blocks_recomputed(probe)
    out = {"blocks": count}
    for label, plan in (("saved", probe.plan), ("recomputed", recomputed)):
        model, args, kwargs = _fresh(name)
        sharded = autopar.compile(model, mesh, example_inputs=args, example_kwargs=kwargs, plan=plan)
        out[label] = _train(sharded, args, kwargs)
        out[f"{label}_code"] = sharded.local_graph.code.count("recompute_")
    return out


@pytest.mark.parametrize("name, mesh_shape, family", CASES[:4])
def test_recomputed_blocks_train_exactly_as_saved(name, mesh_shape, family):
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    results = run_ranks(_rank_fn, world, name, mesh_shape, family, timeout_s=600)
    for rank, out in enumerate(results):
        assert out["blocks"] >= 2 and out["saved_code"] == 0
        assert out["recomputed_code"] >= out["blocks"], f"rank {rank}: the blocks were not outlined"
        (l0, g0, p0, c0), (l1, g1, p1, c1) = out["saved"], out["recomputed"]
        assert [float(x) for x in l0] == [float(x) for x in l1], f"rank {rank}: losses differ"
        assert g0.keys() == g1.keys() and p0.keys() == p1.keys()
        for k in g0:
            assert (g0[k] is None) == (g1[k] is None), k
            if g0[k] is not None:
                assert torch.equal(g0[k], g1[k]), f"rank {rank}: gradient of {k} differs"
        for k in p0:
            assert torch.equal(p0[k], p1[k]), f"rank {rank}: {k} after {STEPS} steps differs"
        # the recomputed blocks' forward collectives run again in backward (counted as forward steps); a
        # gathered parameter a recomputed op reads is gathered by the recomputation instead of re-gathered (FSDP)
        forward0 = sum(v for k, v in c0.items() if k[2] == "forward")
        forward1 = sum(v for k, v in c1.items() if k[2] == "forward")
        assert forward1 >= forward0
        gathers0 = sum(v for k, v in c0.items() if k[0] == "all_gather")
        gathers1 = sum(v for k, v in c1.items() if k[0] == "all_gather")
        assert {k: v for k, v in c1.items() if k[0] != "all_gather" and k[2] == "backward"} == {
            k: v for k, v in c0.items() if k[0] != "all_gather" and k[2] == "backward"
        }
        if family == "tensor parallel":  # the blocks' all-reduces are repeated by the recomputation
            assert forward1 > forward0, f"rank {rank}: no forward collective ran again ({c0} vs {c1})"
        if family == "sharded parameters":
            assert gathers1 == gathers0, f"rank {rank}: {c0} vs {c1}"


def _selective_rank_fn(rank, world, name, mesh_shape, family):
    import autopar

    mesh = autopar.Mesh(mesh_shape, axis_names=("x", "y")[: len(mesh_shape)])
    model, args, kwargs = _fresh(name)
    probe = _compile_recomputed(model, args, kwargs, mesh, family, "selective")
    probe(*args, **kwargs)
    selective = probe.plan
    nodes = {k: dataclasses.replace(v, recompute=None) for k, v in selective.nodes.items()}
    saved = dataclasses.replace(selective, nodes=nodes)
    out = {"regions": _recomputed_blocks(selective)}
    for label, plan in (("saved", saved), ("recomputed", selective)):
        model, args, kwargs = _fresh(name)
        sharded = autopar.compile(model, mesh, example_inputs=args, example_kwargs=kwargs, plan=plan)
        out[label] = _train(sharded, args, kwargs)
        out[f"{label}_code"] = sharded.local_graph.code.count("recompute_")
    return out


@pytest.mark.parametrize("name, mesh_shape, family", CASES)
def test_selectively_recomputed_regions_train_exactly_as_saved(name, mesh_shape, family):
    """``recompute="selective"``: inside each layer the weightless runs that pay (the attention core, the MLP's
    activation) are recomputed; with dropout on, training equals the same placements with everything saved."""
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    for rank, out in enumerate(run_ranks(_selective_rank_fn, world, name, mesh_shape, family, timeout_s=600)):
        regions = out["regions"]
        assert len(regions) >= 2 and all(".0" in r or ".1" in r for r in regions), regions
        assert out["saved_code"] == 0 and out["recomputed_code"] >= len(regions)
        (l0, g0, p0, _), (l1, g1, p1, _) = out["saved"], out["recomputed"]
        assert [float(x) for x in l0] == [float(x) for x in l1], f"rank {rank}: losses differ"
        for k in g0:
            if g0[k] is not None:
                assert torch.equal(g0[k], g1[k]), f"rank {rank}: gradient of {k} differs"
        for k in p0:
            assert torch.equal(p0[k], p1[k]), f"rank {rank}: {k} after {STEPS} steps differs"


# ---- the planner's choice (planner/recompute_tables.py) -------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_context():
    """GPT-2 (12 layers) at batch 8, seq 512 on 4 devices of the h100 profile, on the meta device."""
    import autopar
    from autopar.models import load_model

    model, args, kwargs = load_model("gpt2", batch=8, seq=512, device="meta")
    mesh = autopar.Mesh((4,), axis_names=("x",))
    return autopar.prepare(model, mesh, example_inputs=args, example_kwargs=kwargs, profile="h100")


def _recomputed_blocks(plan) -> set[str]:
    return {e.recompute for e in plan.nodes.values() if e.recompute}


def test_the_search_recomputes_only_where_it_pays(gpt2_context):
    import autopar

    ctx = gpt2_context
    saved = autopar.plan_from_context(ctx, compare_families=False)
    full = autopar.plan_from_context(ctx, compare_families=False, recompute="full")
    assert _recomputed_blocks(saved) == set() and saved.settings.recompute == "auto"
    assert _recomputed_blocks(full) == {f"transformer.h.{i}" for i in range(12)}
    # recomputing costs a forward of each block and keeps only the blocks' inputs
    assert full.cost.total_s > saved.cost.total_s
    assert full.memory.activations_bytes < 0.5 * saved.memory.activations_bytes
    assert full.memory.per_device_bytes < saved.memory.per_device_bytes
    assert "recompute: 12 blocks" in full.table()
    # a cap the saved plan meets: auto keeps everything (recomputing only adds time)
    roomy = autopar.plan_from_context(ctx, compare_families=False, mem_cap=saved.memory.per_device_bytes)
    assert _recomputed_blocks(roomy) == set() and "recompute: none" in roomy.table()
    # under caps between the full plan's memory and the least any plan saving everything reaches, each layer
    # chooses (saved, selective or whole) in one search; the plan fits, is as fast as the best plan recomputing
    # every layer alike (selective or whole) within the peak search's tolerance (2^-8: solving.plan_under),
    # and faster than recomputing them all whole
    with pytest.raises(autopar.MemoryCapError) as err:
        autopar.plan_from_context(ctx, compare_families=False, mem_cap=1, recompute="none")
    least_saving = err.value.min_mem_bytes
    assert full.memory.per_device_bytes < least_saving <= saved.memory.per_device_bytes
    mixed = 0
    for fraction in (0.9, 0.6, 0.3):
        cap = int(full.memory.per_device_bytes + fraction * (least_saving - full.memory.per_device_bytes))
        with pytest.raises(autopar.MemoryCapError, match="recompute 'auto' tries it"):
            autopar.plan_from_context(ctx, compare_families=False, mem_cap=cap, recompute="none")
        capped = autopar.plan_from_context(ctx, compare_families=False, mem_cap=cap)
        where = f"cap {cap} B: {capped.search.recompute_layers}"
        assert _recomputed_blocks(capped) and capped.memory.per_device_bytes <= cap, where
        layers = capped.search.recompute_layers
        assert layers.none + layers.selective + layers.full == 12, where
        uniform = {}
        for mode in ("selective", "full"):
            try:
                uniform[mode] = autopar.plan_from_context(ctx, compare_families=False, mem_cap=cap, recompute=mode)
            except autopar.MemoryCapError:
                continue
        assert "full" in uniform and capped.cost.total_s < uniform["full"].cost.total_s, where
        assert all(capped.cost.total_s <= p.cost.total_s * (1 + 2**-8) for p in uniform.values()), where
        if capped.search.recompute_mode == "per layer":
            mixed += 1
            line = next(x for x in capped.table().splitlines() if x.startswith("recompute:"))
            assert line.startswith(f"recompute: per layer, {layers.full} whole, {layers.selective} selectively")
    assert mixed >= 2  # the caps between the modes' memory really mix them
    # a cap nothing meets: the least memory named is that of recomputing every layer whole, priced as such
    least = {}
    for mode in ("auto", "full"):
        with pytest.raises(autopar.MemoryCapError) as err:
            autopar.plan_from_context(ctx, compare_families=False, mem_cap=1, recompute=mode)
        least[mode] = err.value.min_mem_bytes
    assert least["auto"] <= least["full"] < full.memory.per_device_bytes


def test_layers_that_do_not_chain_search_one_mode_for_all(gpt2_context):
    """A recompute hint on one layer makes the layers differ (no chained search): auto then searches each mode
    for every layer alike and keeps the fastest, and the table lists what each mode found."""
    import autopar

    ctx = gpt2_context
    hints = {"transformer.h.5": "recompute"}  # a middle layer: the layers differ, they do not chain
    free = autopar.plan_from_context(ctx, compare_families=False, hints=hints)
    full = autopar.plan_from_context(ctx, compare_families=False, recompute="full")
    cap = (free.memory.per_device_bytes + full.memory.per_device_bytes) // 2
    capped = autopar.plan_from_context(ctx, compare_families=False, mem_cap=cap, hints=hints)
    modes = {m.recompute: m for m in capped.search.recompute_modes}
    assert not modes["none"].feasible and modes["none"].min_per_device_bytes > cap
    chosen = capped.search.recompute_mode
    assert chosen in ("selective", "full") and modes[chosen].total_s == capped.cost.total_s
    others = [m for k, m in modes.items() if k not in ("none", chosen)]
    for m in others:  # feasible and slower, or proven slower by a bound without the exact pass
        assert (m.feasible and m.total_s >= capped.cost.total_s) or (
            m.feasible is None and m.at_least_s > capped.cost.total_s
        )
    assert "transformer.h.5" in _recomputed_blocks(capped) and capped.search.recompute_layers is not None
    assert "searched under the cap: none no plan" in " ".join(capped.table().split())


def test_recompute_option_is_checked(gpt2_context):
    import autopar

    with pytest.raises(ValueError, match="recompute 'some'"):
        autopar.plan_from_context(gpt2_context, recompute="some")


def _compile_recomputed(model, args, kwargs, mesh, family, mode="full"):
    """``autopar.compile`` with every layer recomputed (``mode``: or selectively), on the partitioning profile."""
    import autopar

    return autopar.compile(
        model,
        mesh,
        example_inputs=args,
        example_kwargs=kwargs,
        family=family,
        profile=PARTITIONING_PROFILE,
        recompute=mode,
    )


def _planned_rank_fn(rank, world, name, mesh_shape, family, mode="full"):
    from test_execution import ADAMW, _model, _train

    import autopar
    from autopar.runtime import CollectiveCounter

    model, args, kwargs = _model(name)  # dropout off: compared with one device
    mesh = autopar.Mesh(mesh_shape, axis_names=("dp", "tp")[: len(mesh_shape)])
    sharded = _compile_recomputed(model, args, kwargs, mesh, family, mode)
    result = _train((sharded, sharded), args, kwargs)
    model, args, kwargs = _model(name)
    counted = autopar.compile(
        model, mesh, example_inputs=args, example_kwargs=kwargs, plan=sharded.plan, profile=PARTITIONING_PROFILE
    )
    opt = torch.optim.AdamW(counted.parameters(), **ADAMW)
    counted.collective_counter = CollectiveCounter()
    counted(*args, **kwargs)[0].backward()
    opt.step()
    records = sorted((r.kind, mesh.axis_label(r.axis), r.phase, r.bytes) for r in counted.collective_counter.records)
    planned = sorted((c.kind, c.axis, c.phase, c.bytes) for c in sharded.plan.collectives)
    return (
        result,
        _recomputed_blocks(sharded.plan),
        records,
        planned,
        sum(1 for c in sharded.plan.collectives if c.recompute),
    )


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name, mesh_shape, family", CASES)
def test_planned_recomputation_trains_like_one_device_and_sends_what_the_plan_lists(name, mesh_shape, family, mode):
    from test_execution import _assert_trains_alike, _reference

    want = _reference(name)
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    for rank, (got, blocks, records, planned, again) in enumerate(
        run_ranks(_planned_rank_fn, world, name, mesh_shape, family, mode, timeout_s=600)
    ):
        where = f"{name} on {mesh_shape}, plan {family or 'auto'} recomputed ({mode}), rank {rank}"
        assert len(blocks) == 2 if mode == "full" else len(blocks) >= 2, blocks
        _assert_trains_alike(got, want, where)
        if mode == "full" and family in ("tensor parallel", "sharded parameters"):  # the blocks move tensors
            assert again > 0, f"{where}: the plan lists no collective run again by the recomputation"
        assert records == planned, f"{where}: the collectives run differ from the plan's"


def _saved_rank_fn(rank, world, cases):
    import autopar
    from autopar.models import load_model

    out = []
    for name, family, mode in cases:
        torch.manual_seed(0)
        model, args, kwargs = load_model(name, batch=4, seq=16, device="cpu")  # dropout on
        mesh = autopar.Mesh((world,), axis_names=("x",))
        sharded = _compile_recomputed(model, args, kwargs, mesh, family, mode)
        sharded.measure_saved = True  # the instrumented program: each region counts what its checkpoint keeps
        loss = sharded(*args, **kwargs)[0]
        saved = sharded.saved_bytes.total_bytes
        loss.backward()
        regions = _recomputed_blocks(sharded.plan)
        out.append((name, family, mode, saved, sharded.plan.memory.activations_bytes, regions))
    return out


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_saved_bytes_of_recomputed_plans_within_ten_percent_of_the_plan(mode):
    """What one forward keeps for backward with the blocks (or selectively their regions) recomputed (the
    checkpoints' inputs and the rest), measured by the saved-tensor hook, against the plan's activation bytes."""
    cases = [
        (n, f, mode)
        for n in ("gpt2-tiny", "llama-tiny", "bert-tiny")
        for f in ("tensor parallel", "sharded parameters")
    ]
    for rank, results in enumerate(run_ranks(_saved_rank_fn, 2, cases, timeout_s=600)):
        for name, family, mode_, saved, planned, regions in results:
            where = f"{name} {family} {mode_}, rank {rank}: saved {saved} B, planned {planned} B"
            assert len(regions) == 2 if mode_ == "full" else len(regions) >= 2, where
            assert abs(saved - planned) <= 0.10 * planned, where


def test_a_recompute_hint_forces_the_layers_it_names(gpt2_context):
    import autopar

    ctx = gpt2_context
    hinted = autopar.plan_from_context(ctx, compare_families=False, hints={"transformer.h.1?": "recompute"})
    assert _recomputed_blocks(hinted) == {"transformer.h.10", "transformer.h.11"}  # no cap: nothing else
    assert hinted.hints.recompute == ("transformer.h.1?",)
    # by a module inside the layers, and kept under recompute="none"
    by_module = autopar.plan_from_context(
        ctx, compare_families=False, hints={"transformer.h.0.mlp": "recompute"}, recompute="none"
    )
    assert _recomputed_blocks(by_module) == {"transformer.h.0"}
    with pytest.raises(ValueError, match="recompute hint 'lm_head' matches no repeated block"):
        autopar.plan_from_context(ctx, compare_families=False, hints={"lm_head": "recompute"})


def _per_layer_plan(name: str, world: int):
    """A plan of ``name`` on ``world`` devices whose first layer is recomputed whole and second selectively
    (priced and listed by the planner as the per-layer search would hand them over), as JSON."""
    from test_execution import _model

    import autopar
    from autopar.planner.regions import block_regions, selective_regions
    from autopar.planner.solving import Recomputed, SearchRun, plan_under

    model, args, kwargs = _model(name)
    mesh = autopar.Mesh((world,), axis_names=("x",))
    ctx = autopar.prepare(model, mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE)
    blocks = block_regions(ctx)
    first = min(blocks.values())
    mixed = {i: r for i, r in blocks.items() if r == first}
    mixed.update(selective_regions(ctx, {i: r for i, r in blocks.items() if r != first}))
    resolved = ctx.hints or autopar.planner.hints.resolve_hints(ctx.graph, ctx.mesh)
    plan = plan_under(ctx, resolved, Recomputed(mixed), autopar.planner.PlanOptions(), SearchRun())
    return plan.to_json(), first


def _per_layer_rank_fn(rank, world, name, text):
    from test_execution import ADAMW, _model, _train

    import autopar
    from autopar.planner import Plan
    from autopar.runtime import CollectiveCounter

    plan = Plan.from_json(text)
    mesh = autopar.Mesh((world,), axis_names=("x",))
    model, args, kwargs = _model(name)
    sharded = autopar.compile(model, mesh, example_inputs=args, example_kwargs=kwargs, plan=plan)
    result = _train((sharded, sharded), args, kwargs)
    model, args, kwargs = _model(name)
    counted = autopar.compile(model, mesh, example_inputs=args, example_kwargs=kwargs, plan=plan)
    counted.measure_saved = True
    counted.collective_counter = CollectiveCounter()
    opt = torch.optim.AdamW(counted.parameters(), **ADAMW)
    loss = counted(*args, **kwargs)[0]
    saved = counted.saved_bytes.total_bytes
    loss.backward()
    opt.step()
    records = sorted((r.kind, "x", r.phase, r.bytes) for r in counted.collective_counter.records)
    return result, records, saved


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_a_plan_recomputing_per_layer_trains_like_one_device(name):
    """Layers of one plan recomputed differently (one saved, one selective or whole): training equals one device,
    the ranks send the plan's collectives, and what one forward keeps is the plan's activations within 10%."""
    from autopar.planner import Plan

    text, first = _per_layer_plan(name, 2)
    regions = _recomputed_blocks(Plan.from_json(text))
    assert first in regions and any(not r.startswith(first) for r in regions), regions  # whole; selective
    _assert_runs_as_planned(name, text, f"{name} per layer {sorted(regions)}")


def _assert_runs_as_planned(name: str, text: str, label: str) -> None:
    """The plan (JSON) on 2 ranks trains like one device, sends the plan's collectives, and what one forward keeps
    is the plan's activations within 10%."""
    from test_execution import _assert_trains_alike, _reference

    from autopar.planner import Plan

    plan = Plan.from_json(text)
    planned = sorted((c.kind, c.axis, c.phase, c.bytes) for c in plan.collectives)
    want = _reference(name)
    for rank, (got, records, saved) in enumerate(run_ranks(_per_layer_rank_fn, 2, name, text, timeout_s=600)):
        where = f"{label}, rank {rank}"
        _assert_trains_alike(got, want, where)
        assert records == planned, f"{where}: the collectives run differ from the plan's"
        activations = plan.memory.activations_bytes
        assert abs(saved - activations) <= 0.10 * activations, f"{where}: saved {saved} B, planned {activations} B"


# ---- the rest of the graph (planner/regions.py: rest_regions) --------------------------------------------------


def test_the_rest_of_the_graph_is_a_choice_of_the_same_search(gpt2_context):
    """Outside the layers, the part before them (embeddings) and the part after (final norm, head, loss) may be
    recomputed too, chosen with the first layer in the same chained search, so the least memory "auto" reaches
    is at most that of recomputing every layer whole, and at that cap its plan is as fast (within the peak
    search's tolerance).

    For GPT-2 recomputing the rest does not lower the least *peak*: the part after the layers is the first
    that backward reaches, so what it saves comes back at the step's peak, with the tied embedding its head
    gathers again (``cost.peak``: a recomputed op keeps what the recomputation gathered).  Plans that recompute
    the rest are run and checked on ranks by the tests below (``_rest_plan``)."""
    import autopar

    ctx = gpt2_context
    least = {}
    for mode in ("auto", "full"):
        with pytest.raises(autopar.MemoryCapError) as err:
            autopar.plan_from_context(ctx, compare_families=False, mem_cap=1, recompute=mode)
        least[mode] = err.value.min_mem_bytes
    assert least["auto"] <= least["full"], least
    full = autopar.plan_from_context(ctx, compare_families=False, mem_cap=least["full"], recompute="full")
    chosen = autopar.plan_from_context(ctx, compare_families=False, mem_cap=least["full"])
    assert chosen.memory.per_device_bytes <= least["full"]
    assert chosen.cost.total_s <= full.cost.total_s * (1 + 2**-8), (chosen.search, full.search)
    for plan in (full, chosen):  # what the table says is recomputed outside the layers is what the plan marks
        rest = plan.search.recompute_rest
        assert set(rest) <= {"before transformer.h", "after transformer.h"}
        outside = {n for n, e in plan.nodes.items() if e.recompute in rest}
        assert all(not n.startswith("transformer_h_") for n in outside)  # no op of a layer
        assert bool(outside) == bool(rest)


def _rest_plan(name: str, world: int):
    """A plan of ``name`` on ``world`` devices recomputing every layer whole and the rest of the graph (each part
    that pays: before the layers, after them), priced and listed by the planner, as JSON; and the rest's regions."""
    from test_execution import _model

    import autopar
    from autopar.planner.regions import block_regions, rest_regions
    from autopar.planner.solving import Recomputed, SearchRun, plan_under

    model, args, kwargs = _model(name)
    mesh = autopar.Mesh((world,), axis_names=("x",))
    ctx = autopar.prepare(model, mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE)
    blocks = block_regions(ctx)
    rest = {i: r for part in rest_regions(ctx, blocks) for i, r in part.items()}
    resolved = ctx.hints or autopar.planner.hints.resolve_hints(ctx.graph, ctx.mesh)
    plan = plan_under(ctx, resolved, Recomputed({**blocks, **rest}), autopar.planner.PlanOptions(), SearchRun())
    return plan.to_json(), set(rest.values())


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_a_plan_recomputing_the_rest_of_the_graph_trains_like_one_device(name):
    """The embeddings and the head run under their own checkpoints: training equals one device, the ranks send
    the plan's collectives (the recomputed rest's forward moves again), and what one forward keeps is the plan's
    activations within 10%."""
    from autopar.planner import Plan

    text, rest = _rest_plan(name, 2)
    regions = _recomputed_blocks(Plan.from_json(text))
    assert rest and rest <= regions and any(r.startswith("after") for r in rest), regions
    _assert_runs_as_planned(name, text, f"{name} with {sorted(rest)} recomputed")


def test_a_layer_whose_value_comes_back_through_an_op_outside_it_is_not_convex():
    """``planner.regions.convex_layers``: layer ``a`` (nodes 0, 2) makes node 0, an op outside every layer (1)
    reads it and feeds node 2 of ``a`` again, so ``a`` cannot be one checkpoint; ``b`` (3, 4) only reads ``a``."""
    from types import SimpleNamespace

    from autopar.planner.regions import convex_layers

    inputs = {0: [], 1: [(0, 0)], 2: [(1, 0)], 3: [(2, 0)], 4: [(3, 0), (1, 0)]}
    graph = SimpleNamespace(nodes=[SimpleNamespace(index=i, inputs=ins) for i, ins in inputs.items()])
    assert convex_layers(graph, {"a": (0, 2), "b": (3, 4)}) == {"b"}
    assert convex_layers(graph, {"a": (0, 1, 2), "b": (3, 4)}) == {"a", "b"}
