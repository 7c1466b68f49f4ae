"""Planning for a device count (issue 32 part 1): the logical meshes, the choice among them, and the entry points
that take ``devices=`` (``autopar.plan``, ``autopar.compile`` under a process group, ``autopar plan/run --devices``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from dist_utils import run_ranks

import autopar
from autopar.cli import main
from autopar.models import load_model
from autopar.planner import check_devices, logical_meshes


def test_the_meshes_are_the_factorizations_of_the_count_innermost_last():
    shapes = [m.shape for m in logical_meshes(8)]
    assert shapes == [(8,), (2, 4), (4, 2)]
    assert [m.axis_names for m in logical_meshes(8)] == [("dp",), ("dp", "tp"), ("dp", "tp")]
    assert [m.shape for m in logical_meshes(7)] == [(7,)]  # a prime: one axis
    with_pipeline = logical_meshes(16, "auto")
    three = [m.shape for m in with_pipeline if m.ndim == 3]
    assert three == [(2, 2, 4), (2, 4, 2), (4, 2, 2)]
    assert all(m.axis_names == ("pp", "dp", "tp") for m in with_pipeline if m.ndim == 3)
    assert all(m.size == 16 for m in with_pipeline)


def test_the_meshes_are_planned_one_axis_first_then_the_most_balanced():
    """``planning_order``: a search order over ``logical_meshes`` (each once, with its index there): on one node the
    one-axis mesh first, then by the largest axis, fewer axes, the largest axis carrying collectives; on several
    nodes, the meshes whose innermost axis is one node come first, each group in that order, the one-axis mesh
    among the others."""
    from autopar.planner import planning_order

    meshes = logical_meshes(64, "auto")
    order = planning_order(meshes)
    assert sorted(i for i, _ in order) == list(range(len(meshes))) and all(meshes[i] is m for i, m in order)
    shapes = [m.shape for _, m in order]
    assert shapes[0] == (64,)
    assert [max(s) for s in shapes[1:]] == sorted(max(s) for s in shapes[1:])
    # largest axis 4, then 8: two axes before three, then the pipeline's (the outermost) largest
    assert shapes[1:5] == [(4, 4, 4), (8, 8), (8, 2, 4), (8, 4, 2)]
    eights = [s for s in shapes if len(s) == 3 and max(s) == 8]
    assert [max(s[1:]) for s in eights] == sorted(max(s[1:]) for s in eights)
    assert [m.shape for _, m in planning_order(meshes, devices_per_node=64)] == shapes  # one node: as before
    on_nodes = [m.shape for _, m in planning_order(meshes, devices_per_node=4)]  # 16 nodes of 4
    inside = [s for s in shapes[1:] if s[-1] == 4]
    assert on_nodes[: len(inside)] == inside  # a node's devices innermost first
    assert on_nodes[len(inside) :] == [s for s in shapes[1:] if s[-1] != 4] + [(64,)]  # the one-axis mesh: largest
    assert on_nodes[-1] == (64,) and sorted(on_nodes) == sorted(shapes)


@pytest.mark.parametrize(
    "devices,per_node,match",
    [
        (12, 8, "12 is not a multiple of 8.*devices=8"),
        (0, 8, "expected the number of devices"),
        (True, 8, "expected the number of devices"),
        (2.0, 8, "expected the number of devices"),
    ],
)
def test_a_device_count_whole_nodes_do_not_hold_is_refused(devices, per_node, match):
    with pytest.raises(ValueError, match=match):
        check_devices(devices, per_node)
    check_devices(4, 8)  # part of one node
    check_devices(16, 8)


@pytest.fixture(scope="module")
def gpt2_small():
    return load_model("gpt2", batch=32, seq=1024)


def test_gpt2_small_on_one_node_of_eight_is_data_parallel(gpt2_small):
    """What every practitioner runs: one data-parallel axis over the node's 8 GPUs; the other meshes listed with
    why they lost; the plan's JSON keeps the list."""
    model, args, kwargs = gpt2_small
    plan = autopar.plan(
        model, devices=8, example_inputs=args, example_kwargs=kwargs, profile="h100", dtype="bf16",
        compare_families=False,
    )  # fmt: skip
    assert plan.mesh.shape == (8,) and plan.family.startswith("data parallel"), (plan.mesh, plan.family)
    assert plan.memory.cap_bytes == 80_000_000_000  # no cap given: the device's memory
    assert [c.shape for c in plan.meshes][0] == (8,) and plan.meshes[0].note == "chosen"
    assert {c.shape for c in plan.meshes} == {(8,), (2, 4), (4, 2)}
    for c in plan.meshes[1:]:
        step = c.step_s if c.step_s is not None else c.at_least_s
        assert step >= plan.cost.total_s and "slower" in c.note, c
    assert plan.meshes[0].mfu == pytest.approx(plan.throughput.mfu)
    assert autopar.Plan.from_json(plan.to_json()).meshes == plan.meshes
    assert "meshes of 8 devices, fastest first" in plan.table()
    assert plan.timings["meshes"] == 3
    assert all(c.planning_s > 0 for c in plan.meshes)
    assert sorted(c.new_captures for c in plan.meshes) == [0, 0, 1]  # captured once, shared by the other meshes


def test_no_mesh_fitting_the_cap_names_what_each_needs():
    model, args, kwargs = load_model("gpt2-tiny", batch=4, seq=16)
    with pytest.raises(autopar.MemoryCapError, match=r"no mesh of 4 devices fits .* 4: .*; 2x2: ") as e:
        autopar.plan(
            model, devices=4, example_inputs=args, example_kwargs=kwargs, profile="cpu", mem_cap="64KiB",
            recompute="none", compare_families=False,
        )  # fmt: skip
    assert e.value.min_mem_bytes > 64 * 2**10


def test_a_pipeline_mesh_with_more_stages_than_layers_is_listed_as_unable_to_run():
    """``pipeline="auto"`` over a device count enumerates meshes whose pipeline axis outnumbers the model's layers:
    those are listed with why they cannot run, not raised (as a pipeline the user forced would be), and the plan is
    chosen among the rest."""
    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, overrides={"n_layer": 1})
    plan = autopar.plan(
        model, devices=8, example_inputs=args, example_kwargs=kwargs, pipeline="auto", profile="h100",
        devices_per_node=8, compare_families=False,
    )  # fmt: skip
    listed = {c.shape: c for c in plan.meshes}
    assert set(listed) == {(8,), (2, 4), (4, 2), (2, 2, 2)}
    unable = listed[(2, 2, 2)]
    assert unable.step_s is None and unable.at_least_s is None
    assert unable.note.startswith("cannot run") and unable.note.count("layers to split over 2 stages along 'pp'") == 1
    assert unable.new_captures == 0  # the layers are known from the capture before it: no size captured for it
    assert plan.mesh.shape != (2, 2, 2) and plan.meshes[0].note == "chosen"
    assert autopar.Plan.from_json(plan.to_json()).meshes == plan.meshes
    assert "cannot run" in plan.table()
    with pytest.raises(
        ValueError, match="has no layers .* to split into stages"
    ):  # the same pipeline asked for by the user
        autopar.plan(
            model, autopar.Mesh((2, 2, 2), axis_names=("pp", "dp", "tp")), example_inputs=args,
            example_kwargs=kwargs, pipeline="pp", profile="h100", compare_families=False,
        )  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mesh": autopar.Mesh((2,)), "devices": 2}, "not both"),
        ({}, "not neither"),
        ({"devices": 2, "hints": {"*.c_fc.weight": ["S(1)"]}}, "hints name placements on a mesh"),
        ({"devices": 4, "pipeline": "pp"}, "pipeline='auto'"),
    ],
)
def test_devices_with_what_names_a_mesh_is_refused(kwargs, match):
    model, args, kw = load_model("gpt2-tiny", batch=4, seq=16)
    with pytest.raises(ValueError, match=match):
        autopar.plan(model, example_inputs=args, example_kwargs=kw, profile="cpu", **kwargs)


_COMPILE_DEVICES = """
import pathlib, sys, torch, torch.distributed as dist, autopar
from autopar.models import load_model
from autopar.runtime import init_distributed

init_distributed()
model, args, kwargs = load_model("gpt2-tiny", batch=4, seq=16, device="cpu", no_dropout=True)
sharded = autopar.compile(model, devices=dist.get_world_size(), example_inputs=args, example_kwargs=kwargs)
opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
losses = []
for _ in range(2):
    losses.append(float(sharded.train_step(*args, **kwargs)))
    opt.step()
    opt.zero_grad()
line = f"{sharded.plan.mesh.shape} {sharded.plan.mesh.axis_names} {losses}"
pathlib.Path(sys.argv[1], f"rank{dist.get_rank()}.txt").write_text(line)  # one file each: stdout interleaves
dist.destroy_process_group()
"""


def test_compile_with_the_world_size_builds_one_mesh_on_every_torchrun_rank(tmp_path):
    """``compile(model, devices=dist.get_world_size())`` under torchrun on 4 gloo ranks: rank 0 chooses, every
    rank builds that mesh (the one ``autopar.plan(devices=4)`` chooses), and it trains like one device."""
    script = tmp_path / "train.py"
    script.write_text(_COMPILE_DEVICES)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script)]
    cmd.append(str(tmp_path))
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(4) if (tmp_path / f"rank{r}.txt").exists()]
    assert len(lines) == 4 and len({line.rsplit(" [", 1)[0] for line in lines}) == 1, done.stdout
    model, args, kwargs = load_model("gpt2-tiny", batch=4, seq=16, device="cpu", no_dropout=True)
    chosen = autopar.plan(model, devices=4, example_inputs=args, example_kwargs=kwargs, profile="cpu")
    assert lines[0].startswith(f"{chosen.mesh.shape} {chosen.mesh.axis_names}"), (lines[0], chosen.mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want = []
    for _ in range(2):
        loss = model(*args, **kwargs).loss
        loss.backward()
        want.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    for line in lines:
        losses = [float(x) for x in line.rsplit("[", 1)[1].rstrip("]").split(",")]
        assert losses == pytest.approx(want, rel=1e-4, abs=1e-5), line


def _compile_refused_rank(rank, world):
    import autopar
    from autopar.models import load_model

    model, args, kwargs = load_model("gpt2-tiny", batch=4, seq=16)
    out = []
    for kw in ({"devices": world + 1}, {"devices": world}, {"devices": world, "plan": "p.json"}):
        example = {} if kw == {"devices": world} else {"example_inputs": args, "example_kwargs": kwargs}
        try:
            autopar.compile(model, profile="cpu", **kw, **example)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


def test_compile_with_devices_says_what_it_needs():
    wrong_world, lazy, with_plan = run_ranks(_compile_refused_rank, 2, timeout_s=120)[0]
    assert "the process group has 2 ranks" in wrong_world and "devices=dist.get_world_size()" in wrong_world
    assert "pass example_inputs=" in lazy
    assert "plan= names one too" in with_plan


def test_cli_plan_and_run_take_a_device_count(capsys):
    assert main(["plan", "gpt2-tiny", "--devices", "4", "--profile", "cpu", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "meshes of 4 devices, fastest first" in out
    with pytest.raises(SystemExit):
        main(["plan", "gpt2-tiny", "--devices", "4", "--mesh", "2x2"])
    assert "not allowed with argument --devices" in capsys.readouterr().err
    code = main(["run", "gpt2-tiny", "--devices", "4", "--steps", "2", "--check", "--batch", "4", "--seq", "16"])
    out = capsys.readouterr().out
    assert code == 0 and "check: PASS" in out, out
    assert "(chosen for 4 devices), 4 ranks" in out


def test_a_pipeline_mesh_whose_schedule_cannot_run_says_so_not_too_few_layers():
    """Where the layers fill the stages but the schedule asked for does not run (1F1B needs at least ``p``
    micro-batches), the mesh's row says that, not that the layers are too few."""
    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, overrides={"n_layer": 2})
    plan = autopar.plan(
        model, devices=8, example_inputs=args, example_kwargs=kwargs, pipeline="auto", schedule="1f1b",
        microbatches=1, profile="h100", devices_per_node=8, compare_families=False,
    )  # fmt: skip
    note = {c.shape: c.note for c in plan.meshes}[(2, 2, 2)]
    assert note == "cannot run: no schedule of 1f1b runs 2 stages along 'pp' with 1 micro-batches", note
