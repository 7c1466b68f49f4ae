"""Batch-size reuse: one symbolic capture, specialized per batch, plans exactly as a fresh capture.

The test of truth: the plan JSON of ``prepare(..., reuse_batch=True).at_batch(b)``
equals, byte for byte, the plan JSON of a fresh ``autopar.plan`` at batch ``b``.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import autopar
from autopar.capture.batch import capture_template, specialize
from autopar.capture.export import CaptureError, capture
from autopar.cost.saved import memory_layouts, storage_roots
from autopar.mesh import Mesh
from autopar.models import load_model
from autopar.planner import HintOptions
from autopar.planner.driver import plan_from_context, prepare

SEQ = 16
EXAMPLE_BATCH = 4
MESHES = {"2x2": Mesh((2, 2), axis_names=("dp", "tp")), "4": Mesh((4,), axis_names=("dp",))}


@functools.cache
def _template_ctx(name: str):
    """One symbolic capture per model, prepared on the 4-device mesh."""
    model, args, kwargs = load_model(name, batch=EXAMPLE_BATCH, seq=SEQ)
    return prepare(model, MESHES["4"], example_inputs=args, example_kwargs=kwargs, reuse_batch=True)


def _fresh(name: str, mesh: Mesh, batch: int, **kw) -> autopar.Plan:
    model, args, kwargs = load_model(name, batch=batch, seq=SEQ)
    return autopar.plan(model, mesh, example_inputs=args, example_kwargs=kwargs, **kw)


def _graph_rows(graph) -> list:
    """Everything planning reads of an OpGraph, node by node (the fake values' layout included)."""
    rows = []
    for n in graph.nodes:
        call = None if n.call is None else (str(n.call.target), repr(n.call.args), repr(n.call.kwargs))
        val = n.fx_node.meta.get("val") if n.fx_node is not None else None
        layout = [(tuple(t.shape), t.stride(), t.storage_offset()) for t in torch.utils._pytree.tree_leaves(val)]
        rows.append((n.name, n.kind, n.outputs, n.inputs, call, n.module, n.fqn, n.requires_grad, layout))
    return rows


CASES = [
    (name, mesh_name, batch)
    for name in ("gpt2-tiny", "llama-tiny", "bert-tiny")
    for mesh_name, batch in (("2x2", 8), ("4", 6))  # 6: the 4-way axis does not divide the batch
] + [("gpt2-tiny", "4", EXAMPLE_BATCH)]  # the context prepare made


@pytest.mark.parametrize("name,mesh_name,batch", CASES)
def test_reused_plan_equals_a_fresh_plan_byte_for_byte(name: str, mesh_name: str, batch: int) -> None:
    ctx = _template_ctx(name)
    assert ctx.template.symbolic, ctx.template.reason
    mesh = MESHES[mesh_name]
    # the template does not depend on the mesh: the same capture serves both meshes
    ctx = dataclasses.replace(ctx, mesh=mesh) if mesh is not ctx.mesh else ctx
    reused = ctx.at_batch(batch)
    assert reused.recaptured is None
    assert reused.timings["capture_s"] == 0.0 and reused.timings["specialize_s"] > 0.0
    assert reused.graph.nodes[reused.graph.outputs[0][0]].outputs[0].numel == 1  # the loss
    assert next(n for n in reused.graph.nodes if n.name == "input_ids").outputs[0].shape == (batch, SEQ)
    got = plan_from_context(reused, compare_families=False)
    want = _fresh(name, mesh, batch, compare_families=False)
    assert got.to_json() == want.to_json()


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_specialized_graph_equals_a_static_capture_node_by_node(name: str) -> None:
    template = _template_ctx(name).template
    graph, why = specialize(template, 6)
    assert why is None
    model, args, kwargs = load_model(name, batch=6, seq=SEQ)
    static = capture(model, args, kwargs)
    assert [n.name for n in graph.nodes] == [n.name for n in static.nodes]
    assert _graph_rows(graph) == _graph_rows(static)
    assert (graph.outputs, graph.loss_output, graph.tied, graph.user_inputs) == (
        static.outputs,
        static.loss_output,
        static.tied,
        static.user_inputs,
    )
    assert storage_roots(graph) == storage_roots(static) and len(storage_roots(graph)) > 10
    assert memory_layouts(graph) == memory_layouts(static)
    assert graph.gm.code == static.gm.code  # the fx graph too: sizes folded, no SymInt node left
    assert not any("sym_" in str(n.target) for n in graph.gm.graph.nodes)


def test_reuse_keeps_families_and_hints() -> None:
    hints = {"*.mlp.c_fc.weight": ["R", "S(1)"]}
    ctx = dataclasses.replace(_template_ctx("gpt2-tiny"), mesh=MESHES["2x2"], hint_options=HintOptions(hints))
    got = plan_from_context(ctx.at_batch(8))
    want = _fresh("gpt2-tiny", MESHES["2x2"], 8, hints=hints)
    assert got.hints and got.to_json() == want.to_json()
    assert [a.family for a in got.alternatives] == list(autopar.planner.FAMILIES)


def test_batch_one_is_captured_again_statically() -> None:
    one = _template_ctx("gpt2-tiny").at_batch(1)
    assert "outside the range [2, inf]" in one.recaptured
    assert one.timings["capture_s"] > 0.0 and one.timings["specialize_s"] == 0.0
    got = plan_from_context(one, compare_families=False)
    assert got.to_json() == _fresh("gpt2-tiny", MESHES["4"], 1, compare_families=False).to_json()


class _FixedBatch(torch.nn.Module):
    """Its code fixes the batch at 4 (a reshape to a literal size): no symbolic batch exists."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).reshape(4, 2, 4).sum()


def test_a_model_that_fixes_the_batch_is_captured_again_at_each_batch() -> None:
    model, x = _FixedBatch(), torch.randn(4, 8)
    template = capture_template(model, (x,))
    assert not template.symbolic and "symbolic export failed" in template.reason
    ctx = prepare(model, MESHES["4"], example_inputs=(x,), reuse_batch=True)
    again = ctx.at_batch(4)
    assert again.recaptured == template.reason
    fresh = autopar.plan(model, MESHES["4"], example_inputs=(x,), compare_families=False)
    assert plan_from_context(again, compare_families=False).to_json() == fresh.to_json()
    with pytest.raises(CaptureError, match="could not trace _FixedBatch"):
        ctx.at_batch(6)  # the model itself cannot run at 6: the fresh capture says so


def test_inputs_without_a_shared_batch_dim_fall_back() -> None:
    model = torch.nn.Bilinear(8, 8, 3)
    template = capture_template(model, (torch.randn(4, 8), torch.randn(5, 8)))
    assert not template.symbolic
    assert template.reason == "the tensor inputs do not share a dim-0 size ([0][0]: 4, [0][1]: 5)"
    with pytest.raises(ValueError, match="no batch dim to resize"):
        specialize(template, 8)


def test_at_batch_rejects_a_bad_batch() -> None:
    with pytest.raises(ValueError, match="expected a positive int"):
        _template_ctx("bert-tiny").at_batch(0)
