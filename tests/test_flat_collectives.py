"""One collective over several mesh axes (issue 32, part 6): a gradient bucket partial on two axes is all-reduced
over their groups flattened into one where that is cheaper (``cost.Coster.flattens``), listed so in the plan
(``Plan.flat_grad_axes``, collectives on ``dp+tp``), and run so (``runtime.buckets``, ``MeshGroups.flat_group``):
the ranks train like one device and count the collectives the plan lists."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE, run_ranks

import autopar
from autopar.models import load_model
from costmodel import collective_time_s, load_profile

H100 = pathlib.Path(__file__).resolve().parent.parent / "configs" / "devices" / "h100.toml"
BUCKET = 25 * 2**20


def _coster(mesh_shape, profile):
    from autopar.planner import prepare

    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16)
    mesh = autopar.Mesh(mesh_shape)
    return prepare(model, mesh, example_inputs=args, example_kwargs=kwargs, profile=profile).coster


def _per_device_fabric(tmp_path) -> str:
    """The h100 profile with its inter-node link given per device (no NICs shared by the node)."""
    head, inter = H100.read_text().split("[inter_node]")
    inter = "\n".join(line for line in inter.splitlines() if not line.startswith("nics_per_node"))
    path = tmp_path / "h100-per-device.toml"
    path.write_text(head.replace('name = "h100"', 'name = "h100-per-device"') + "[inter_node]" + inter)
    return str(path)


def test_a_bucket_over_two_axes_takes_the_cheaper_of_one_flattened_ring_and_one_per_axis(tmp_path):
    """A 25 MiB bucket on 2 nodes x 8 GPUs (axis 0 across the nodes).  On the h100 profile a ring over all 16 ranks
    spreads over the node's 8 NICs, 2 (15 / 16) B / 400 GB/s, where reducing per axis sends the whole bucket over
    one NIC per rank (2 (1 / 2) B / 50 GB/s) after NVLink's: flattened.  With the fabric given per device (each
    rank its own 50 GB/s, no NICs shared) the flattened ring crosses the slow link with 15/16 of the bucket, per
    axis only 1/2: once per axis."""
    shape = (2, 8)
    for profile, flat in (("h100", True), (_per_device_fabric(tmp_path), False)):
        coster = _coster(shape, profile)
        link = load_profile(profile).link_for_axis(shape, (0, 1))
        overhead = load_profile(profile).op_overhead_s()
        one = collective_time_s("all_reduce", BUCKET, 16, link) + overhead
        per_axis = sum(coster.comm_time_s("all_reduce", BUCKET, a) for a in (0, 1))
        assert coster.comm_time_s("all_reduce", BUCKET, (0, 1)) == pytest.approx(one, rel=1e-12)
        assert coster.flattens((0, 1)) is flat and (one < per_axis) is flat


def test_a_flattened_group_is_every_rank_differing_on_those_axes():
    mesh = autopar.Mesh((2, 2, 2), axis_names=("a", "b", "c"))
    assert mesh.axis_groups((0, 2)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert mesh.axis_groups(("a", "b")) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.axis_label((0, 2)) == "a+c" and mesh.axis_label(1) == "b"
    h100 = load_profile("h100")
    assert h100.link_for_axis((2, 4), (0, 1)) == h100.intra_node  # 8 ranks: one node
    assert h100.link_for_axis((4, 8), (0, 1)).name.endswith("(8 per node on 4 nodes)")


def _model():
    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, device="cpu")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model, args, kwargs


def _flat_rank_fn(rank, world, flatten: bool):
    """One data-parallel step on (2, 2): the plan's flattened sets, the collectives counted and planned, and the
    largest gradient difference from one device over every parameter."""
    from autopar.runtime import CollectiveCounter

    torch.manual_seed(0)
    model, args, kwargs = _model()
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"))
    options = dict(example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE)
    plan = autopar.plan(model, mesh, family="data parallel", compare_families=False, **options)
    if not flatten:  # the same plan reduced once per axis
        plan = dataclasses.replace(plan, flat_grad_axes=())
    sharded = autopar.compile(model, mesh, plan=plan, **options)
    sharded.collective_counter = CollectiveCounter()
    sharded(*args, **kwargs)[0].backward()
    counted = sorted((r.kind, mesh.axis_label(r.axis), r.phase, r.bytes) for r in sharded.collective_counter.records)
    planned = sorted((c.kind, c.axis, c.phase, c.bytes) for c in plan.collectives)
    grads = {k: p.grad.detach().clone() for k, p in sharded.named_parameters()}
    model.load_state_dict(reference)
    model(*args, **kwargs)[0].backward()
    want = dict(model.named_parameters())
    worst = max(float((grads[k] - want[k].grad).abs().max()) for k in grads)
    return plan.flat_grad_axes, counted, planned, worst, len(grads) == len(want)


def test_data_parallel_over_two_axes_reduces_each_bucket_once_over_both():
    """On 4 gloo ranks as (2, 2), a data-parallel plan's gradients are partial on both axes: the plan reduces each
    bucket by one all-reduce over dp+tp, the ranks count exactly the plan's collectives, and every gradient is
    one device's.  The same plan run once per axis (``flat_grad_axes`` emptied) gives the same gradients."""
    flat, per_axis = (run_ranks(_flat_rank_fn, 4, flatten, timeout_s=300) for flatten in (True, False))
    for rank, (axes, counted, planned, worst, every) in enumerate(flat):
        assert axes == (("dp", "tp"),), axes
        assert any(c[:3] == ("all_reduce", "dp+tp", "backward") for c in planned), planned
        assert counted == planned, f"rank {rank}: counted != planned"
        assert every and worst < 1e-5, (rank, worst)
    for rank, (axes, counted, _, worst, every) in enumerate(per_axis):
        assert axes == () and not any("+" in c[1] for c in counted), counted
        assert every and worst < 1e-5, (rank, worst)
