"""``autopar.compile``'s contract around the run: lazy compilation and bad input that must fail fast.

Issue 3: ``example_inputs=None`` compiles on the first call; a world size that is
not the mesh size, no process group, inputs of other shapes than the compiled
ones and a plan whose mesh or parameters do not match the model each raise a
clear error on every rank instead of leaving a rank waiting in a collective.
The checks that need no process group run in the test process; the others share
one spawn of 2 gloo ranks.
"""

from __future__ import annotations

import time

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE, run_ranks
from test_execution import _model, _reference, _train

import autopar
from autopar.runtime.spawn import RankSettings, spawn_ranks


class _MLP(torch.nn.Module):
    def __init__(self, hidden: int, name: str = "up") -> None:
        super().__init__()
        self.add_module(name, torch.nn.Linear(8, hidden))
        self.down = torch.nn.Linear(hidden, 8)
        self._name = name

    def forward(self, x):
        return self.down(torch.relu(getattr(self, self._name)(x)))


def _mlp_plan(mesh):
    torch.manual_seed(0)
    return autopar.plan(_MLP(16), mesh, example_inputs=(torch.randn(4, 8),))


def test_compile_without_a_process_group_is_a_clear_error():
    model = _MLP(16)
    with pytest.raises(ValueError, match="no default process group") as e:
        autopar.compile(model, autopar.Mesh((2,)), example_inputs=(torch.randn(4, 8),))
    assert "init_process_group" in str(e.value) and "torchrun" in str(e.value)


def test_plan_for_another_model_is_caught_before_anything_runs(tmp_path):
    mesh = autopar.Mesh((2,), axis_names=("dp",))
    plan = _mlp_plan(mesh)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    other = _MLP(12, name="proj")  # up.* renamed to proj.*, hidden 16 -> 12
    with pytest.raises(ValueError) as e:
        autopar.compile(other, mesh, example_inputs=(torch.randn(4, 8),), plan=path)
    msg = str(e.value)
    assert "does not match the model _MLP: 5 parameters differ" in msg, msg
    assert "down.weight: shape (8, 12) in the model, (8, 16) in the plan" in msg, msg
    assert "proj.weight: in the model (12, 8), not in the plan" in msg, msg
    assert "up.weight: in the plan (16, 8), not in the model" in msg and "Fix:" in msg, msg
    with pytest.raises(ValueError, match=r"plan is for mesh .* \(shape \(2,\)\) but compile got .* \(shape \(4,\)\)"):
        autopar.compile(_MLP(16), autopar.Mesh((4,)), example_inputs=(torch.randn(4, 8),), plan=plan)
    with pytest.raises(TypeError, match="expected an autopar Plan or the path"):
        autopar.compile(_MLP(16), mesh, example_inputs=(torch.randn(4, 8),), plan=plan.to_dict())


def _errors(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


_SIZED = ("view.default", "_unsafe_view.default", "reshape.default", "expand.default")


def _local_graph_facts(sharded, args, kwargs) -> dict:
    """What ``sharded.local_graph`` calls, its moves that move nothing, and its size arguments vs traced shapes."""
    from autopar.lower.steps import MoveStep, OpStep
    from autopar.runtime.deferred import DeferredLossStep

    sharded.trace = {}
    sharded(*args, **kwargs)
    trace, sharded.trace = sharded.trace, None
    captured = {n.name: n for n in sharded._graph.gm.graph.nodes}
    kinds, idle, sizes = set(), [], []
    for n in sharded.local_graph.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        if isinstance(t, MoveStep):
            kinds.add("move")
            if not (t.move.moves_value or t.move.moves_grad or t.shard is not None):
                idle.append(n.name)
        elif isinstance(t, OpStep):
            kinds.add("step")
        elif isinstance(t, DeferredLossStep):  # the loss's last collective, started without waiting
            kinds.add("deferred")
        elif isinstance(t, torch._ops.OpOverload):
            kinds.add("aten")
            if t._overloadpacket.__name__ + "." + t._overloadname in _SIZED:
                sizes.append((n.name, list(n.args[1]), list(trace[n.name][0].shape), list(captured[n.name].args[1])))
        else:
            kinds.add(getattr(t, "__name__", str(t)))
    return {"kinds": kinds, "idle_moves": idle, "sizes": sizes, "printed": "move_" in sharded.local_graph.code}


def _local_mode(rank, mesh, args, kwargs) -> dict:
    """input_mode='local' (each rank passes its own batch slice) against the global mode, same plan and weights."""
    from autopar.pieces import shard_tensor
    from autopar.placement import parse_placements

    given = {"input_ids": args[0], **kwargs}
    local = autopar.compile(
        _model("gpt2-tiny")[0],
        mesh,
        example_inputs=args,
        example_kwargs=kwargs,
        input_mode="local",
        input_placements=dict.fromkeys(given, ["S(0)"]),  # the batch split at the inputs
        profile=PARTITIONING_PROFILE,
    )
    plan = local.plan
    pieces = {
        k: shard_tensor(v, parse_placements(plan.inputs[k].placements), mesh.shape, mesh.coordinate(rank))
        for k, v in given.items()
    }
    whole = autopar.compile(_model("gpt2-tiny")[0], mesh, example_inputs=args, example_kwargs=kwargs, plan=plan)
    return {
        "shapes": {k: tuple(v.shape) for k, v in pieces.items()} == local.local_input_shapes,
        "split": all(tuple(v.shape) != tuple(given[k].shape) for k, v in pieces.items()),
        "loss": (float(local(**pieces)[0].detach()), float(whole(**given)[0].detach())),
        "global_given": _errors(lambda: local(**given)),
    }


def _lazy_rank_fn(rank, world):
    from autopar.compiled import NotCompiledError

    mesh = autopar.Mesh((world,), axis_names=("dp",))
    out = {}
    model, args, kwargs = _model("gpt2-tiny")
    out["wrong_world"] = _errors(lambda: autopar.compile(model, autopar.Mesh((2 * world,)), example_inputs=args))
    # a state_dict whose tensors do not fit the model fails up front, naming each key (not later inside aten)
    full = dict(model.state_dict())
    bad_sd = {**full, "transformer.wte.weight": torch.zeros(3, 3)}
    del bad_sd["transformer.ln_f.bias"]
    out["bad_state_dict"] = _errors(lambda: autopar.compile(model, mesh, example_inputs=args, state_dict=bad_sd))
    sharded = autopar.compile(model, mesh, profile=PARTITIONING_PROFILE)  # lazy: plans on the first call
    try:
        _ = sharded.plan
        out["plan_before"] = "no error"
    except NotCompiledError as e:
        out["plan_before"] = str(e)
    out["params_before"] = {k: tuple(p.shape) for k, p in sharded.named_parameters()}
    out["train"] = _train((sharded, sharded), args, kwargs)  # the optimizer is built before the first call
    out["params_after"] = {k: tuple(p.shape) for k, p in sharded.named_parameters()}
    out["local_graph"] = _local_graph_facts(sharded, args, kwargs)
    out["plan_local"] = {k: tuple(v.local_shape) for k, v in sharded.plan.params.items()}
    out["state_local"] = {
        k: tuple(
            autopar.spec.local_shape(
                tuple(v.shape),
                autopar.placement.parse_placements(v.state_placements),
                mesh.shape,
                mesh.coordinate(rank),
            )
        )
        for k, v in sharded.plan.params.items()
    }
    half = {k: v[: v.shape[0] // 2] if torch.is_tensor(v) else v for k, v in kwargs.items()}
    out["other_shape"] = _errors(lambda: sharded(args[0][:2], **half))
    plan = sharded.plan
    out["plan_other_inputs"] = _errors(
        lambda: autopar.compile(
            _model("gpt2-tiny")[0], mesh, example_inputs=(args[0][:2],), example_kwargs=half, plan=plan
        )
    )
    out["local_mode"] = _local_mode(rank, mesh, args, kwargs)
    # a plan made on the meta device, where Llama's graph has other ops than on the CPU, is refused up front
    from autopar.models import load_model

    meta_model, margs, mkwargs = load_model("llama-tiny", batch=4, seq=16, device="meta")
    meta_plan = autopar.plan(meta_model, mesh, example_inputs=margs, example_kwargs=mkwargs, compare_families=False)
    cpu_model, cargs, ckwargs = _model("llama-tiny")
    out["plan_other_graph"] = _errors(
        lambda: autopar.compile(cpu_model, mesh, example_inputs=cargs, example_kwargs=ckwargs, plan=meta_plan)
    )
    # a torch DeviceMesh, as DTensor users hold one, is taken as the autopar.Mesh it describes
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    via = autopar.compile(
        _model("gpt2-tiny")[0], device_mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE
    )
    out["device_mesh"] = (via.mesh, float(via(*args, **kwargs)[0]))
    # ranks that disagree on the input shapes of a lazy compile: every rank raises, none waits
    uneven = autopar.compile(_model("gpt2-tiny")[0], mesh)
    mine = {k: v[: v.shape[0] - rank] if torch.is_tensor(v) else v for k, v in kwargs.items()}
    out["ranks_disagree"] = _errors(lambda: uneven(args[0][: args[0].shape[0] - rank], **mine))
    return out


def test_lazy_compile_and_bad_inputs_on_two_ranks():
    ref_losses, ref_logits, ref_grads, ref_params = _reference("gpt2-tiny")
    for rank, out in enumerate(run_ranks(_lazy_rank_fn, 2, timeout_s=600)):
        assert "world size 2 != mesh size 4" in out["wrong_world"], out["wrong_world"]
        assert "not been compiled yet" in out["plan_before"] and "example_inputs=" in out["plan_before"]
        bad_sd = out["bad_state_dict"]
        assert "state_dict does not fit the model: 2 parameters differ" in bad_sd, bad_sd
        assert "transformer.ln_f.bias: missing" in bad_sd, bad_sd
        assert "transformer.wte.weight: shape (3, 3) float32, the model's parameter is (1001, 64) float32" in bad_sd
        assert "Fix: pass the full (unsharded) state dict" in bad_sd
        # before the first call the parameters are whole; after it, each is this rank's piece under the plan
        assert out["params_before"]["transformer.wte.weight"] == (1001, 64)
        sharded_any = False
        for name, shape in out["params_after"].items():
            assert shape == out["state_local"][name], (rank, name, shape)
            sharded_any |= shape != out["params_before"][name]
        assert sharded_any, "no parameter was sharded: the test does not exercise re-pointing"
        # the lowered graph: local aten ops, moves that move something, size arguments already local
        facts = out["local_graph"]
        assert facts["kinds"] <= {"aten", "move", "step", "deferred", "getitem"}, facts["kinds"]
        assert "move" in facts["kinds"] and "deferred" in facts["kinds"], facts["kinds"]
        assert facts["printed"] and not facts["idle_moves"], facts["idle_moves"]
        assert all(size == traced for _, size, traced, _ in facts["sizes"]), facts["sizes"]
        assert any(size != captured for _, size, _, captured in facts["sizes"]), "no size argument was localized"
        losses, logits, grads, params = out["train"]
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-5, msg=f"grad {k}")
        for k in ref_params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=1e-4, atol=1e-5, msg=f"param {k}")
        assert "input_ids: shape (2, 16) given, expected (4, 16)" in out["other_shape"], out
        assert "compile again with example inputs" in out["other_shape"]
        assert "input_ids: shape (2, 16) given, (4, 16) in the plan" in out["plan_other_inputs"], out
        assert "the ranks got inputs of different shapes" in out["ranks_disagree"], out["ranks_disagree"]
        other = out["plan_other_graph"]
        assert "describes another graph than LlamaForCausalLM traces here" in other, other
        assert "in the plan, not in the traced graph" in other and "Fix: plan on the device" in other, other
        dm_mesh, dm_loss = out["device_mesh"]
        assert dm_mesh == autopar.Mesh((2,), axis_names=("tp",)), dm_mesh
        torch.testing.assert_close(torch.tensor(dm_loss), ref_losses[0], rtol=1e-4, atol=1e-5)
        # input_mode='local': each rank's own pieces give the global mode's loss; a global batch is refused
        local = out["local_mode"]
        assert local["shapes"] and local["split"], local
        assert local["loss"][0] == pytest.approx(local["loss"][1], rel=1e-6), local
        assert "input_mode='local' each rank passes its piece" in local["global_given"], local
        assert "rank 0: (4, 16) int64" in out["ranks_disagree"] and "rank 1: (3, 16) int64" in out["ranks_disagree"]


def _one_rank_bad_input_fn(rank, world):
    """Bad input on every rank (all raise, the module stays usable), then on rank 1 only (all raise, quickly)."""
    from autopar.pieces import shard_tensor
    from autopar.placement import parse_placements

    mesh = autopar.Mesh((world,), axis_names=("dp",))
    model, args, kwargs = _model("gpt2-tiny")
    given = {"input_ids": args[0], **kwargs}
    sharded = autopar.compile(
        model,
        mesh,
        example_inputs=args,
        example_kwargs=kwargs,
        input_mode="local",
        input_placements=dict.fromkeys(given, ["S(0)"]),
        profile=PARTITIONING_PROFILE,
    )
    plan = sharded.plan
    good = {
        k: shard_tensor(v, parse_placements(plan.inputs[k].placements), mesh.shape, mesh.coordinate(rank))
        for k, v in given.items()
    }
    bad = {**good, "input_ids": good["input_ids"][:1]}

    def step(inputs):
        def run():
            sharded(**inputs)[0].backward()

        t0 = time.monotonic()
        return _errors(run), time.monotonic() - t0

    import torch.distributed as dist

    dist.barrier()  # rank 1 captured the graph after rank 0 planned it: start the calls together, as training does
    out = {"everyone_bad": step(bad), "then_good": step(good)}
    twin = autopar.compile(model, mesh, example_inputs=args, example_kwargs=kwargs, input_mode="local", plan=plan)
    out["twin_shares"] = twin._groups.axis_group(0) is sharded._groups.axis_group(0)
    out["one_bad"] = step(bad if rank == 1 else good)
    out["after"] = step(good)
    # the twin shared the groups the failure destroyed: it says so too
    out["twin_after"] = _errors(lambda: twin(**good)[0].backward())
    # compiling again makes new groups on every rank (the ranks agree: rank 1 destroyed them, rank 0 may not have)
    sharded = autopar.compile(model, mesh, example_inputs=args, example_kwargs=kwargs, input_mode="local", plan=plan)
    out["recompiled"] = step(good)
    out["recompiled_loss"] = float(sharded(**good)[0])
    return out


def test_bad_input_on_one_rank_fails_every_rank_fast():
    """Only rank 1 passes a wrong shape: rank 0, already in a collective, raises rank 1's reason within seconds."""
    timeout_s = 120.0  # the collective timeout a waiting rank would otherwise sit out
    outs, _ = spawn_ranks(
        _one_rank_bad_input_fn, 2, settings=RankSettings(timeout_s=600, collective_timeout_s=timeout_s)
    )
    wrong = (
        "input_ids: shape (1, 16) given, expected (2, 16); under input_mode='local' each rank passes its piece "
        "(placement S(0)"
    )
    for rank, out in enumerate(outs):
        # the same bad input on every rank: each raises its own error, nobody waits, the module stays usable
        msg, _ = out["everyone_bad"]
        assert wrong in msg and "shut" not in msg, (rank, msg)
        assert out["then_good"][0] == "no error", (rank, out["then_good"])
        # rank 1 alone: both ranks raise well before the timeout, and both messages name input, expected, got
        msg, took_s = out["one_bad"]
        assert took_s < 20.0 < timeout_s, (rank, took_s, msg)
        assert wrong in msg, (rank, msg)
        assert "shut the mesh's process groups down" in msg and "compile again" in msg.lower(), (rank, msg)
        if rank == 0:  # waiting in a collective of forward or backward when rank 1 shut the groups down
            assert "on rank 0 (mesh coordinate (0,)) stopped: rank 1: InputMismatchError" in msg, msg
        # the module is shut down on every rank: a further call says so instead of hanging
        assert "process groups were shut down" in out["after"][0] and "compile the model again" in out["after"][0]
        # a second compile on the same mesh shares the first's process groups (runtime.shared_groups), so the
        # failure shut it down too; a compile after it makes new groups on every rank, and trains
        assert out["twin_shares"], rank
        assert "process groups were shut down" in out["twin_after"], (rank, out["twin_after"])
        assert "InputMismatchError" in out["twin_after"] and "sharing its process groups" in out["twin_after"]
        assert out["recompiled"][0] == "no error", (rank, out["recompiled"])
    assert outs[0]["recompiled_loss"] == pytest.approx(outs[1]["recompiled_loss"], rel=1e-6)
