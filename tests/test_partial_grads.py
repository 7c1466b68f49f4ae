"""Partial gradients: backward of an op an axis does not split may run on P(sum) gradients.

The planning side (which reductions a plan has, and where); the numerics on real
ranks are checked by the execution tests, which run every plan kind.
"""

from __future__ import annotations

import collections

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE

import autopar
from autopar.placement import Partial, Replicate, Shard
from autopar.strategies.base import OpStrategy, with_partial_grads
from autopar.strategies.candidates import SourceStrategy

R, P, S0 = Replicate(), Partial("sum"), Shard(0)

MEGATRON_LLAMA = {
    "model.layers.*.self_attn.[qkv]_proj.weight": "S(0)",  # column parallel (nn.Linear stores (out, in))
    "model.layers.*.mlp.gate_proj.weight": "S(0)",
    "model.layers.*.mlp.up_proj.weight": "S(0)",
    "model.layers.*.self_attn.o_proj.weight": "S(1)",  # row parallel
    "model.layers.*.mlp.down_proj.weight": "S(1)",
}


def _strategy(inputs, outputs, split, flags=()):
    n = len(split)
    return OpStrategy(tuple(inputs), tuple(outputs), ((),) * n, (None,) * n, tuple(split), False, tuple(flags))


def test_gradient_placements_of_a_strategy():
    # mesh (2, 2): the op splits axis 0 (batch) and repeats on axis 1
    s = _strategy([(S0, R), (R, R)], [(S0, R)], (True, False))
    assert s.input_grad(0) == (S0, R) and s.input_grad(1) == (P, R)  # DP weight gradient: P on the split axis
    assert s.output_grad(0) == (S0, R)
    f = _strategy(s.inputs, s.outputs, s.split, (False, True))
    assert f.input_grad(0) == (S0, P) and f.input_grad(1) == (P, P)  # backward on partial gradients, axis 1
    assert f.output_grad(0) == (S0, P)
    assert "grad P@1" in f.label() and "grad" not in s.label()


def test_variants_only_on_axes_the_op_does_not_split():
    split0 = _strategy([(S0, R)], [(S0, R)], (True, False))
    whole = _strategy([(R, R)], [(R, R)], (False, False))
    out = with_partial_grads([split0, whole], (2, 2))
    flags = sorted(s.partial_grad for s in out if s.partial_grad)
    assert flags == [(False, True), (False, True), (True, False), (True, True)]
    # an axis of one rank has nothing to sum
    assert [s.partial_grad for s in with_partial_grads([whole], (1, 4)) if s.partial_grad] == [(False, True)]


def test_source_accumulates_then_reduces_once():
    s = SourceStrategy((R,), (S0,), (True,))
    assert s.output_grad() == (P,) and s.accumulated_grad == ((P,), (S0,))
    assert SourceStrategy((R,), (R,)).accumulated_grad is None


def _block_activation_collectives(plan, prefix):
    return [c for c in plan.collectives if c.module.startswith(prefix) and not c.tensor.startswith("p_")]


def test_megatron_llama_reduces_each_sublayer_input_gradient_once(tiny_model):
    """q, k and v (and gate and up) read one replicated input: their partial gradients
    are summed and reduced once, Megatron's single f per sub-layer, not once per reader."""
    model, args, kwargs = tiny_model("llama-tiny", 2, 32)
    mesh = autopar.Mesh((2,), axis_names=("tp",))
    plan = autopar.plan(
        model, mesh, example_inputs=args, example_kwargs=kwargs, hints=MEGATRON_LLAMA, compare_families=False
    )
    for block in range(2):
        acts = _block_activation_collectives(plan, f"model.layers.{block}.")
        kinds = collections.Counter((c.kind, c.phase) for c in acts)
        assert kinds[("all_reduce", "backward")] <= 2, kinds  # Megatron: one f per attention / MLP sub-layer
        assert set(kinds) <= {("all_reduce", "backward"), ("all_reduce", "forward")}, kinds
        for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            assert not [c for c in acts if c.module.endswith(proj)], proj  # nothing reduced per reader
    second = _block_activation_collectives(plan, "model.layers.1.")
    assert collections.Counter((c.kind, c.phase) for c in second) == {
        ("all_reduce", "forward"): 2,
        ("all_reduce", "backward"): 2,
    }
    flagged = [n for n, e in plan.nodes.items() if e.partial_grad_axes]
    assert flagged and all(plan.nodes[n].partial_grad_axes == ("tp",) for n in flagged)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_tied_embedding_gradient_is_reduced_once(tiny_model, mesh_shape):
    """GPT-2's wte is read by the embedding and by lm_head: one reduction of the summed gradient."""
    model, args, kwargs = tiny_model("gpt2-tiny", 8, 32)
    mesh = autopar.Mesh(mesh_shape, axis_names=("dp", "tp")[: len(mesh_shape)])
    batch = ",".join(["S(0)"] + ["R"] * (len(mesh_shape) - 1))  # data parallel on the first axis
    ctx = autopar.prepare(
        model,
        mesh,
        example_inputs=args,
        example_kwargs=kwargs,
        hints={"transformer.wte.weight": ",".join("R" * len(mesh_shape))},
        input_placements={name: batch for name in ("input_ids", "labels")},
        profile=PARTITIONING_PROFILE,  # collectives cheap enough that a tiny model splits its batch
    )
    # state kept whole: a ZeRO state sharded on both axes cannot take a sum reduced on both (nested S(0))
    plan = autopar.plan_from_context(ctx, compare_families=False, allow_state_sharding=False)
    wte = "p_transformer_wte_weight"
    grads = [c for c in plan.collectives if c.tensor == wte and c.phase == "backward"]
    per_axis = collections.Counter(c.axis for c in grads)
    assert grads and all(n == 1 for n in per_axis.values()), grads
    assert any(c.node == wte for c in grads), grads  # the summed uses, reduced by the parameter itself
    assert plan.params["transformer.wte.weight"].partial_grad_axes


def test_uses_sum_their_partial_gradients_only_where_the_parameter_is_stored_whole():
    """A parameter stored sharded on an axis (FSDP) is gathered per use, so each use's gradient is reduced back
    to the stored piece on its own edge: summing the uses' full-size P(sum) gradients first cannot meet the
    sharded piece (the forced sharded-parameter plan of a tied GPT-2 on 4 ranks failed in backward with
    [4096, 256] against the piece [1024, 256]).  Nor can a sum left sharded on a ZeRO axis it does not cover
    (a replicated GPT-2 on 2x2 with wte's state sharded on one axis: [2048, 256] against [4096, 256])."""
    from autopar.capture.export import capture
    from autopar.models import load_model
    from autopar.strategies.candidates import build_candidates

    model, args, kwargs = load_model("gpt2-tiny", batch=4, seq=16)
    graph = capture(model, args, kwargs)
    for mesh_shape in ((4,), (2, 2)):
        cand = build_candidates(graph, mesh_shape)
        summed = 0
        for node in graph.params():
            for s in cand.strategies[node.index]:
                for axis, flag in enumerate(s.partial_grad):
                    assert not flag or isinstance(s.placement[axis], Replicate), (mesh_shape, node.fqn, s)
                    # the sum is the stored piece's gradient: a ZeRO axis (state sharded beyond it) is summed too
                    assert not any(s.partial_grad) or s.state[axis] == s.placement[axis] or flag, (node.fqn, s)
                    summed += flag
        assert summed > 0, mesh_shape  # the summing variants still exist where the parameter is stored whole


def test_a_zero_state_shard_is_always_a_range_of_the_parameter_piece():
    """The runtime's ZeRO aliases the optimizer's shard into the parameter, so the state piece must be a range of
    the placement's piece: a 1-D weight stored (R, S(0)) may not keep its state (S(0), S(0)) (the outer axis would
    split dim 0 first; GPT-NeoX's layer norms on 2x2 were refused at compile), while (S(0), R) -> (S(0), S(0)) may."""
    from autopar.spec import TensorMeta
    from autopar.strategies.candidates import _state_options

    meta = TensorMeta((256,), torch.float32)
    assert (S0, S0) not in list(_state_options(meta, (R, S0), (2, 2)))
    assert (S0, S0) in list(_state_options(meta, (S0, R), (2, 2)))
    assert (S0, R) in list(_state_options(meta, (R, R), (2, 2)))
