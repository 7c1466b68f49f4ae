"""Pipelined plans train like one device (draft)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE, run_ranks
from test_execution import ADAMW

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5


def _model(name, batch, layers):
    from autopar.models import load_model

    key = {"gpt2-tiny": "n_layer", "t5-tiny": "num_layers"}.get(name, "num_hidden_layers")
    model, args, kwargs = load_model(name, batch=batch, seq=16, device="cpu", overrides={key: layers}, no_dropout=True)
    labels = kwargs["labels"].clone()
    labels[: batch // 2, 3:] = -100  # the first micro-batches count fewer tokens
    return model.train(), args, dict(kwargs, labels=labels)


def _train(model, step, args, kwargs):
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, grads = [], None
    for k in range(STEPS):
        losses.append(float(step(*args, **kwargs)))
        if k == 0:
            grads = (
                model.full_grads()
                if hasattr(model, "full_grads")
                else {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            )
        opt.step()
        opt.zero_grad()
    params = (
        model.full_state_dict()
        if hasattr(model, "full_state_dict")
        else {n: v.detach().clone() for n, v in model.state_dict().items()}
    )
    return losses, grads, params


def _pipeline_rank_fn(rank, world, name, layers, mesh_shape, axis_names, options, batch):
    import autopar
    from autopar.runtime import CollectiveCounter

    model, args, kwargs = _model(name, batch, layers)
    mesh = autopar.Mesh(mesh_shape, axis_names=axis_names)
    sharded = autopar.compile(
        model, mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE, **options
    )
    trained = _train(sharded, sharded.train_step, args, kwargs)
    sharded.collective_counter = CollectiveCounter()
    sharded.train_step(*args, **kwargs)
    reductions = _gradient_reductions(sharded, "dp") if "dp" in axis_names else None
    sharded.collective_counter = None
    norm = float(sharded.clip_grad_norm_(1e9))  # the whole model's gradient norm, every stage's weights once
    sharded.zero_grad()
    plan = sharded.plan
    shape = (
        plan.family,
        tuple((s.first_layer, s.stop_layer) for s in plan.pipeline.stages) if plan.pipeline else (),
        sum(1 for n in plan.nodes.values() if n.recompute),
    )
    if sharded.plan.pipeline is None:  # accumulated micro-batches: sharded(...) runs one micro-batch
        return shape, (*trained, norm), None, "sharded.train_step", reductions
    out = sharded(*args, **kwargs)  # a forward-only pipeline: the outputs on every rank
    try:
        out.loss.backward()
        refused = "no error"
    except RuntimeError as e:
        refused = str(e)
    return shape, (*trained, norm), (out.loss.detach(), out.logits.detach()), refused, reductions


def _gradient_reductions(sharded, axis: str) -> tuple[list[int], list[int]]:
    """(bytes of each backward all-reduce counted on ``axis`` in one train_step, those the plan lists for this
    rank's nodes, each as many times as the step runs it): a data-parallel gradient (a parameter's, in a bucket)
    is all-reduced once per step, after the last micro-batch; an activation's gradient once per micro-batch."""
    plan, graph = sharded.plan, sharded._graph
    index = sharded.mesh.axis_names.index(axis)
    records = sharded.collective_counter.records
    counted = [r.bytes for r in records if r.axis == index and r.phase == "backward" and r.kind == "all_reduce"]
    params = {n.name for n in graph.params()}
    ours = _nodes_of_this_rank(sharded)
    planned = [
        c.bytes
        for c in plan.collectives
        if c.axis == axis and c.phase == "backward" and c.kind == "all_reduce" and c.node in ours
        for _ in range(1 if c.tensor in params else plan.microbatches)
    ]
    return sorted(counted), sorted(planned)


def _capped(name, layers, mesh_shape, axis_names, options, batch):
    """``options`` with ``cap_share`` turned into ``mem_cap``: that share of the free plan's memory per device."""
    if "cap_share" not in options:
        return options
    import autopar

    model, args, kwargs = _model(name, batch, layers)
    options = dict(options)
    share = options.pop("cap_share")
    mesh = autopar.Mesh(mesh_shape, axis_names=axis_names)
    run = dict(example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE, compare_families=False)
    free = autopar.plan(model, mesh, **run, **options)
    return dict(options, mem_cap=int(free.memory.per_device_bytes * share))


def _reference(name, layers, batch):
    model, args, kwargs = _model(name, batch, layers)

    def step(*a, **k):
        loss = model(*a, **k).loss
        loss.backward()
        return loss.detach()

    trained = _train(model, step, args, kwargs)
    with torch.no_grad():
        out = model(*args, **kwargs)
    step(*args, **kwargs)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    return (*trained, norm), (out.loss, out.logits)


CASES = [
    # four stages on 4 ranks, 8 micro-batches: GPipe and 1F1B
    ("gpt2-tiny", 4, (4,), ("pp",), dict(pipeline="pp", microbatches=8, schedule="gpipe")),
    ("gpt2-tiny", 4, (4,), ("pp",), dict(pipeline="pp", microbatches=8, schedule="1f1b")),
    ("llama-tiny", 4, (4,), ("pp",), dict(pipeline="pp", microbatches=8, schedule="gpipe")),
    ("llama-tiny", 4, (4,), ("pp",), dict(pipeline="pp", microbatches=8, schedule="1f1b")),
    ("bert-tiny", 4, (4,), ("pp",), dict(pipeline="pp", microbatches=8, schedule="gpipe")),
    ("bert-tiny", 4, (4,), ("pp",), dict(pipeline="pp", microbatches=8, schedule="1f1b")),
    ("gpt2-tiny", 3, (2,), ("pp",), dict(pipeline="pp", microbatches=4, schedule="gpipe")),
    ("gpt2-tiny", 4, (2,), ("pp",), dict(pipeline="pp", microbatches=4, schedule="interleaved")),
    ("gpt2-tiny", 6, (2,), ("pp",), dict(pipeline="pp", microbatches=4, schedule="interleaved", virtual_stages=3)),
    ("llama-tiny", 2, (2, 2), ("pp", "tp"), dict(pipeline="pp", microbatches=4, family="tensor parallel")),
    ("bert-tiny", 2, (2, 2), ("pp", "dp"), dict(pipeline="pp", microbatches=2, family="sharded parameters")),
    ("gpt2-tiny", 2, (2, 2), ("pp", "dp"), dict(pipeline="pp", microbatches=2, recompute="full")),
    # the stages' plan bounded to fit a cap the fastest one is over: layers recomputed, state sharded
    ("gpt2-tiny", 2, (2, 2), ("pp", "dp"), dict(pipeline="pp", microbatches=4, schedule="1f1b", cap_share=0.7)),
    ("t5-tiny", 2, (2,), ("pp",), dict(pipeline="pp", microbatches=2)),
    ("llama-tiny", 2, (2,), ("dp",), dict(microbatches=4)),
]


@pytest.mark.parametrize("name,layers,mesh_shape,axis_names,options", CASES)
def test_pipelined_training_matches_one_device(name, layers, mesh_shape, axis_names, options):
    batch = 8
    world = 1
    for s in mesh_shape:
        world *= s
    options = _capped(name, layers, mesh_shape, axis_names, options, batch)
    results = run_ranks(_pipeline_rank_fn, world, name, layers, mesh_shape, axis_names, options, batch, timeout_s=300)
    (want_losses, want_grads, want_params, want_norm), (want_loss, want_logits) = _reference(name, layers, batch)
    for rank, (shape, (losses, grads, params, norm), evaluated, refused, reductions) in enumerate(results):
        family, bounds, recomputed = shape
        assert norm == pytest.approx(want_norm, rel=RTOL), (rank, "clip_grad_norm_", norm, want_norm)
        if reductions is not None:  # data-parallel gradients reduced once per step, not once per micro-batch
            counted, planned = reductions
            missing, extra = Counter(planned) - Counter(counted), Counter(counted) - Counter(planned)
            assert not missing and not extra, (rank, "planned, not counted:", missing, "counted:", extra)
            assert planned or options.get("family") == "sharded parameters", "no data-parallel all-reduce to count"
        if "family" in options:
            assert family.startswith(options["family"]), family
        if options.get("recompute") == "full" or "mem_cap" in options:
            assert recomputed > 0, "the plan recomputes nothing"
        if "pipeline" in options:  # every layer on one stage, in order (T5: both stacks, one chain)
            chain = 2 * layers if name.startswith("t5") else layers
            assert bounds[0][0] == 0 and bounds[-1][1] == chain, bounds
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:])), bounds
        if "virtual_stages" in options:
            assert len(bounds) == mesh_shape[0] * options["virtual_stages"], bounds
        if evaluated is not None:
            loss, logits = evaluated
            torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=ATOL, msg=f"rank {rank}: eval loss")
            torch.testing.assert_close(logits, want_logits, rtol=RTOL, atol=ATOL, msg=f"rank {rank}: eval logits")
        assert "sharded.train_step" in refused, refused
        assert losses == pytest.approx(want_losses, rel=RTOL, abs=ATOL), (rank, losses, want_losses)
        for k, g in want_grads.items():
            torch.testing.assert_close(grads[k], g, rtol=RTOL, atol=ATOL, msg=f"rank {rank} grad {k}")
        for k, v in want_params.items():
            torch.testing.assert_close(params[k], v, rtol=RTOL, atol=ATOL, msg=f"rank {rank} param {k}")


def _no_loss_rank_fn(rank, world):
    import autopar

    model, args, _ = _model("gpt2-tiny", 8, 2)  # no labels: the model returns logits, no loss
    mesh = autopar.Mesh((world,), axis_names=("pp",))
    try:
        autopar.compile(model, mesh, example_inputs=args, profile="cpu", pipeline="pp", microbatches=2)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_pipeline_needs_a_loss_and_says_so():
    for message in run_ranks(_no_loss_rank_fn, 2, timeout_s=120):
        assert "a pipelined training step needs a loss" in message and "pass the labels" in message, message


def _nodes_of_this_rank(sharded) -> set[str]:
    """The nodes whose collectives this rank runs: every node without a pipeline; with one, the ops of this
    rank's stages and the parameters they read."""
    from autopar.planner import stage_of_nodes

    graph, pipe = sharded._graph, sharded.plan.pipeline
    if pipe is None:
        return {n.name for n in graph.nodes}
    axis = sharded.mesh.axis_names.index(pipe.axis)
    p, mine = sharded.mesh.shape[axis], sharded.coordinate[axis]
    stage_of = stage_of_nodes(graph, pipe)
    ops = {name for name, j in stage_of.items() if j % p == mine}
    by_index = {n.index: n.name for n in graph.nodes}
    params = {by_index[u] for n in graph.nodes if n.name in ops for u, _ in n.inputs if graph.nodes[u].kind == "param"}
    return ops | params
