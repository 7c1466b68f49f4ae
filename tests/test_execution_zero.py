"""ZeRO-1/2 plans at run time: gradient and optimizer state sharded beyond the parameter.

The planner may keep a parameter replicated on ``dp`` and shard its gradient and
AdamW state there (``runtime/zero.py``).  Each case trains GPT-2 tiny (tied
embeddings, vocab 1001: uneven shards) for 3 AdamW steps on gloo ranks under a
plan that does so, and checks against the single-device model: loss, logits,
every gradient, every parameter after the steps; the collectives of a whole
training step (forward, backward, optimizer step) against the plan's list; the
bytes of parameters, gradients and optimizer state held against the plan's.

The plans come from the planner under a memory cap below the uncapped plan's
(the uncapped plan's footprint times a factor), found in this process with
compile's settings; on (4,) compile plans by itself with that cap, on (2, 2) it
runs the plan passed as ``plan=``.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE, run_ranks
from test_execution import ADAMW, ATOL, RTOL, STEPS, _model, _reference

import autopar

CASES = [((4,), ("dp",), 1.0, "mem_cap"), ((2, 2), ("dp", "tp"), 0.75, "plan")]


def _zero_plan(mesh_shape, axis_names, factor):
    """(cap bytes, plan) of the auto search with state sharding, as compile's rank 0 makes it."""
    from autopar.planner.driver import plan_from_context, prepare

    model, args, kwargs = _model("gpt2-tiny")
    mesh = autopar.Mesh(mesh_shape, axis_names=axis_names)
    ctx = prepare(model, mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE, dtype="fp32")
    plain = plan_from_context(ctx, compare_families=False, allow_state_sharding=False)
    cap = int(plain.memory.per_device_bytes * factor)
    return cap, plan_from_context(ctx, compare_families=False, mem_cap=cap)


def _records(counter, axis_names):
    label = autopar.Mesh((1,) * len(axis_names), axis_names=axis_names).axis_label  # dp+tp: a flattened group
    return sorted((r.kind, label(r.axis), r.phase, r.bytes) for r in counter.records)


def _zero_rank_fn(rank, world, mesh_shape, axis_names, cap, plan_json):
    from autopar.pieces import shard_tensor
    from autopar.placement import parse_placements
    from autopar.runtime import CollectiveCounter
    from autopar.spec import local_shape

    model, args, kwargs = _model("gpt2-tiny")
    mesh = autopar.Mesh(mesh_shape, axis_names=axis_names)
    sharded = autopar.compile(
        model,
        mesh,
        example_inputs=args,
        example_kwargs=kwargs,
        mem_cap=cap,
        plan=plan_json,
        profile=PARTITIONING_PROFILE,
    )
    opt = torch.optim.AdamW(sharded.parameters(), **ADAMW)
    out = {"coord": mesh.coordinate(rank), "plan": sharded.plan.to_dict(), "losses": [], "counted": []}
    for step in range(STEPS):
        sharded.collective_counter = CollectiveCounter()
        loss, logits = sharded(*args, **kwargs)[:2]
        loss.backward()
        if step == 0:
            out["logits"], out["grads"] = logits.detach(), sharded.full_grads()
        opt.step()
        out["counted"].append(_records(sharded.collective_counter, axis_names))
        if step == 0:
            out["held"] = sharded.model_state_bytes(opt)
        opt.zero_grad()
        out["losses"].append(loss.detach())
    out["params"] = sharded.full_state_dict()
    out["state_keys"] = list(model.state_dict().keys())
    # the optimizer sees the state shard: parameter and AdamW state have its local shape
    params = dict(sharded.named_parameters())
    out["shapes"] = {}
    for fqn, entry in sharded.plan.params.items():
        if entry.state_placements != entry.placements:
            want = local_shape(
                tuple(entry.shape), parse_placements(entry.state_placements), mesh.shape, mesh.coordinate(rank)
            )
            p = params[fqn]
            out["shapes"][fqn] = (want, tuple(p.shape), tuple(opt.state[p]["exp_avg"].shape))
    # an update outside the optimizer (a manual edit) is gathered at the next forward
    sharded.collective_counter = CollectiveCounter()
    with torch.no_grad():
        for fqn in out["shapes"]:
            params[fqn].fill_(float(rank + 1))
    with torch.no_grad():
        sharded(*args, **kwargs)
    out["manual"] = [r for r in _records(sharded.collective_counter, axis_names) if r[2] == "optimizer"]
    full = sharded.full_state_dict()
    out["manual_buffer"] = {}
    for fqn in out["shapes"]:  # what forward reads == the edited shards, laid out under the parameter's placement
        want = shard_tensor(
            full[fqn], parse_placements(sharded.plan.params[fqn].placements), mesh.shape, mesh.coordinate(rank)
        )
        out["manual_buffer"][fqn] = (sharded._zero.buffer(fqn), want, full[fqn].unique().tolist())
    return out


@pytest.mark.parametrize("mesh_shape,axis_names,factor,how", CASES, ids=["4-auto-mem_cap", "2x2-plan"])
def test_zero_plans_train_like_one_device(mesh_shape, axis_names, factor, how):
    cap, plan = _zero_plan(mesh_shape, axis_names, factor)
    zero = {k for k, v in plan.params.items() if v.state_placements != v.placements}
    assert zero, f"the planner shards no state under cap {cap} on {mesh_shape}: this test needs a ZeRO plan"
    assert any(c.phase == "optimizer" for c in plan.collectives)
    ref_losses, ref_logits, ref_grads, ref_params = _reference("gpt2-tiny")
    args = (cap, None) if how == "mem_cap" else (None, plan.to_json())
    results = run_ranks(_zero_rank_fn, math.prod(mesh_shape), mesh_shape, axis_names, *args, timeout_s=600)
    planned = sorted((c.kind, c.axis, c.phase, c.bytes) for c in plan.collectives)
    for out in results:
        where = f"{mesh_shape} at {out['coord']}"
        same = out["plan"]["params"] == plan.to_dict()["params"]
        assert same, f"{where}: compile's plan differs from the one planned here"
        for step, (a, b) in enumerate(zip(out["losses"], ref_losses, strict=True)):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=f"{where}: loss {step}")
        torch.testing.assert_close(out["logits"], ref_logits, rtol=RTOL, atol=ATOL)
        assert out["grads"].keys() == ref_grads.keys()
        for k in ref_grads:
            torch.testing.assert_close(out["grads"][k], ref_grads[k], rtol=RTOL, atol=ATOL, msg=f"{where}: grad {k}")
        assert list(out["params"]) == out["state_keys"]
        for k in ref_params:
            torch.testing.assert_close(out["params"][k], ref_params[k], rtol=RTOL, atol=ATOL, msg=f"{where}: {k}")
        # every whole step (forward, backward, optimizer step) issues exactly the plan's list
        for step, counted in enumerate(out["counted"]):
            assert counted == planned, f"{where}, step {step}: counted != planned"
        # model state held after a step == the plan's figures (largest piece at coordinate 0)
        for key in ("params", "grads", "optimizer"):
            held, want = out["held"][key], getattr(plan.memory, f"{key}_bytes")
            assert held == want if not any(out["coord"]) else held <= want, f"{where}: {key} {held} vs {want}"
        assert set(out["shapes"]) == zero
        for fqn, (want, param, exp_avg) in out["shapes"].items():
            assert param == exp_avg == want, f"{where}: {fqn} shard {param}, exp_avg {exp_avg}, expected {want}"
        # a manual edit of the shards: gathered once at the next forward, each rank's value in its piece
        assert len(out["manual"]) == sum(1 for c in plan.collectives if c.phase == "optimizer")
        for fqn, (buffer, want, values) in out["manual_buffer"].items():
            assert torch.equal(buffer, want), f"{where}: {fqn}: the buffer forward reads is stale"
            assert len(values) > 1, f"{where}: {fqn}: the ranks' edits did not all land ({values})"


@pytest.mark.parametrize(
    "shape,placement,state,coord,expect",
    [
        # state adds S(0) on dp to a tp-sharded weight: rows 501.. of this rank's tp columns (1001 rows: 501/500)
        ((1001, 64), "R,S(1)", "S(0),S(1)", (1, 1), ((500, 32), 501 * 32)),
        ((6, 4), "S(0),R", "S(0),S(1)", (1, 1), ((3, 2), 2)),
        ((1001, 64), "R,S(1)", "S(1),S(1)", (0, 1), None),
        ((8,), "R,R", "S(0),R", (1, 0), ((4,), 4)),
        # both axes on one dim: axis 1 splits axis 0's half, which is not inside this rank's tp half
        ((8,), "R,S(0)", "S(0),S(0)", (0, 1), None),
    ],
)
def test_state_shard_is_a_view_of_the_parameter_piece(shape, placement, state, coord, expect):
    """The ZeRO shard aliases the buffer forward reads, so parameters are held once (the plan's params bytes)."""
    from autopar.pieces import shard_tensor
    from autopar.placement import parse_placements
    from autopar.runtime.zero import shard_view

    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    pl, st = parse_placements(placement), parse_placements(state)
    buffer = shard_tensor(full, pl, (2, 2), coord)
    view = shard_view(buffer, shape, pl, st, (2, 2), coord)
    if expect is None:
        assert view is None
        return
    want_shape, offset = expect
    assert tuple(view.shape) == want_shape and view.storage_offset() == offset
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert torch.equal(view, shard_tensor(full, st, (2, 2), coord))


def _bucket_rank_fn(rank, world, batch):
    import torch.distributed as dist

    from autopar.models import load_model
    from autopar.runtime import CollectiveCounter

    calls = []
    issue = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return issue(tensor, *args, **kwargs)

    dist.all_reduce = counting  # the runtime calls torch.distributed.all_reduce: count the physical collectives
    out = {}
    for bucket_bytes in (None, 2**20):
        model, args, kwargs = load_model("llama-tiny", batch=batch, seq=16, device="cpu")
        mesh = autopar.Mesh((world,), axis_names=("dp",))
        sharded = autopar.compile(
            model,
            mesh,
            example_inputs=args,
            example_kwargs=kwargs,
            family="data parallel",
            grad_bucket_bytes=bucket_bytes,
            profile=PARTITIONING_PROFILE,
        )
        opt = torch.optim.AdamW(sharded.parameters(), **ADAMW)
        sharded.collective_counter = CollectiveCounter()
        calls.clear()
        for _ in range(2):  # two backwards accumulate into .grad before the step
            loss = sharded(*args, **kwargs)[0]
            loss.backward()
        physical = len(calls)
        grads = sharded.full_grads()
        opt.step()
        counted = sorted((r.kind, r.phase, r.bytes) for r in sharded.collective_counter.records)
        planned = sorted((c.kind, c.phase, c.bytes) for c in sharded.plan.collectives for _ in range(2))
        out[bucket_bytes] = (physical, counted == planned, planned, grads, sharded.full_state_dict())
    return out


def test_data_parallel_gradients_are_reduced_in_buckets():
    """Bucketed gradient all-reduces: fewer collectives, same gradients, the plan's logical list counted."""
    for out in run_ranks(_bucket_rank_fn, 2, 32, timeout_s=600):
        physical, same, planned, grads, params = out[None]
        b_physical, b_same, _, b_grads, b_params = out[2**20]
        assert same and b_same, "counted != planned"
        per_edge = sum(1 for kind, phase, _ in planned if kind == "all_reduce" and phase == "backward")
        assert per_edge >= 10, f"the data-parallel plan reduces only {per_edge} gradients: nothing to bucket"
        assert physical == sum(1 for kind, _, _ in planned if kind == "all_reduce")
        assert b_physical <= physical - per_edge + 2 * 2, (b_physical, physical)  # <= 2 buckets per backward
        for k in grads:
            torch.testing.assert_close(b_grads[k], grads[k], rtol=RTOL, atol=ATOL, msg=f"grad {k}")
            torch.testing.assert_close(b_params[k], params[k], rtol=RTOL, atol=ATOL, msg=f"param {k}")
