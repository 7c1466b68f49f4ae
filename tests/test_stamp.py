"""Depth reuse (``autopar.capture.stamp``): a model traced at four layers and stamped to its depth must give the
graph the full trace gives, node by node, on every architecture it stamps; models it cannot stamp are traced whole.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from dist_utils import PARTITIONING_PROFILE, run_ranks
from test_execution import _close, _train

from autopar.capture.export import export_program, graph_of_trace, normalize_inputs
from autopar.capture.stamp import STAMP_MIN_LAYERS, Traced, export_stamped
from autopar.cost.saved import storage_roots

DEPTH = 7
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers")


def _deep(name: str, depth: int = DEPTH, device: str = "meta"):
    """``<name>`` (a built-in model) with ``depth`` layers: (model, args, kwargs) bound as capture binds them."""
    from autopar.models import load_model, model_config

    key = next(k for k in _LAYER_KEYS if k in model_config(name)["config"])
    model, args, kwargs = load_model(name, batch=2, seq=12, device=device, overrides={key: depth}, no_dropout=True)
    return (model, *normalize_inputs(model, args, kwargs))


def _node_form(node):
    return (
        node.name,
        node.kind,
        node.outputs,
        node.inputs,
        node.module,
        node.fqn,
        node.requires_grad,
        node.describe(),
        node.call,
    )


def _assert_same_graph(stamped, full) -> None:
    assert len(stamped.nodes) == len(full.nodes)
    for a, b in zip(stamped.nodes, full.nodes):
        assert _node_form(a) == _node_form(b), f"node {b.index} ({b.name})"
    assert storage_roots(stamped) == storage_roots(full)  # views share the storages they share in the full trace
    assert (stamped.outputs, stamped.loss_output, stamped.call, stamped.tied, stamped.user_inputs) == (
        full.outputs,
        full.loss_output,
        full.call,
        full.tied,
        full.user_inputs,
    )
    assert stamped.constants.keys() == full.constants.keys()


# decoders (rotary, ALiBi, learned positions, MoE experts lists inside each layer), encoders, an encoder-decoder
STAMPED = [
    "gpt2-tiny",
    "llama-tiny",
    "mistral-tiny",
    "qwen2_moe-tiny",
    "bloom-tiny",
    "gpt_neox-tiny",
    "roberta-tiny",
    "mobilebert-tiny",
    "bart-tiny",
]
# alternating sliding/global layers (their modules differ), relative attention bias in layer 0 only,
# per-layer lifted constants, one layer shared by all
TRACED_WHOLE = ["gemma2-tiny", "t5-tiny", "falcon-tiny", "albert-tiny"]


@pytest.mark.parametrize("name", STAMPED)
def test_stamped_trace_is_the_full_trace(name):
    model, args, kwargs = _deep(name)
    stamped = export_stamped(model, args, kwargs, export_program)
    assert stamped is not None, f"{name} with {DEPTH} alike layers should be stamped"
    full = Traced.of(export_program(model, args, kwargs))
    assert [s.target for s in stamped.signature.input_specs] == [s.target for s in full.signature.input_specs]
    assert stamped.signature.output_specs == full.signature.output_specs
    _assert_same_graph(graph_of_trace(model, stamped), graph_of_trace(model, full))


@pytest.mark.parametrize("name", TRACED_WHOLE)
def test_models_whose_layers_differ_are_traced_whole(name, caplog):
    model, args, kwargs = _deep(name)
    with caplog.at_level(logging.INFO, logger="autopar.capture.stamp"):
        assert export_stamped(model, args, kwargs, export_program) is None


def test_outputs_that_read_every_layer_are_traced_whole():
    """``output_hidden_states=True`` returns every layer's output: a stamped graph would miss the copies'."""
    model, args, kwargs = _deep("llama-tiny")
    kwargs = {**kwargs, "output_hidden_states": True}
    assert export_stamped(model, args, kwargs, export_program) is None


def test_hooks_and_shallow_lists_are_traced_whole():
    model, args, kwargs = _deep("llama-tiny")
    handle = model.model.layers[3].register_forward_hook(lambda *a: None)
    assert export_stamped(model, args, kwargs, export_program) is None
    handle.remove()
    assert export_stamped(model, args, kwargs, export_program) is not None
    shallow, args, kwargs = _deep("llama-tiny", depth=STAMP_MIN_LAYERS - 1)
    assert export_stamped(shallow, args, kwargs, export_program) is None


def test_the_model_keeps_its_layers_after_a_stamped_trace():
    model, args, kwargs = _deep("gpt2-tiny")
    before = list(model.transformer.h)
    export_stamped(model, args, kwargs, export_program)
    assert list(model.transformer.h) == before and len(before) == DEPTH


def test_plan_is_the_same_with_the_full_trace(monkeypatch):
    import autopar

    model, args, kwargs = _deep("llama-tiny", depth=8)
    mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"))

    def planned() -> dict:
        plan = autopar.plan(model, mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE)
        out = json.loads(plan.to_json())
        out.pop("timings", None)
        return out

    stamped = planned()
    monkeypatch.setenv("AUTOPAR_FULL_TRACE", "1")
    assert planned() == stamped


def _rank_fn(rank, world, name, depth):
    import autopar

    model, args, kwargs = _deep(name, depth, device="cpu")
    mesh = autopar.Mesh((world,), axis_names=("tp",))
    sharded = autopar.compile(
        model,
        mesh,
        example_inputs=args,
        example_kwargs=kwargs,
        family="tensor parallel",
        profile=PARTITIONING_PROFILE,
    )
    return _train((sharded, sharded), args, kwargs)


def test_stamped_model_trains_on_two_ranks_like_one_device():
    model, args, kwargs = _deep("gpt2-tiny", 6, device="cpu")
    assert export_stamped(model, args, kwargs, export_program) is not None

    def call(*a, **k):
        out = model(*a, **k)
        return out.loss, out.logits

    losses, logits, grads, params = _train((model.train(), call), args, kwargs)
    for rank, (got_losses, got_logits, got_grads, got_params) in enumerate(
        run_ranks(_rank_fn, 2, "gpt2-tiny", 6, timeout_s=600)
    ):
        where = f"6-layer gpt2-tiny, stamped, tensor parallel, rank {rank}"
        _close(torch.stack(got_losses), torch.stack(losses), f"{where}: losses")
        _close(got_logits, logits, f"{where}: logits")
        assert got_grads.keys() == grads.keys() and got_params.keys() == params.keys()
        for k in grads:
            _close(got_grads[k], grads[k], f"{where}: grad {k}")
        # after 3 AdamW steps an element whose gradient is ~0 moves by lr * g / (|g| + eps): the float rounding
        # of a sum taken in another order shows there at ~1e-5 (the same run traced whole does too), so the
        # parameters are compared at 1e-4, the gradients above at the execution tests' 1e-5
        for k in params:
            torch.testing.assert_close(got_params[k], params[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_cut_list_failing_to_trace_falls_back():
    """A model whose forward indexes its list by the config's depth fails at four layers: traced whole."""

    class Indexed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(DEPTH))

        def forward(self, x):
            for i in range(DEPTH):
                x = self.layers[i](x)
            return x.sum()

    model = Indexed()
    assert export_stamped(model, (torch.randn(2, 8),), {}, export_program) is None
