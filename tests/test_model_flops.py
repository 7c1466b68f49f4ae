"""Model FLOPs and MFU (``autopar/cost/model_flops.py``, ``Plan.throughput``): the standard count, 6 x parameters x
tokens + 12 x layers x width x sequence x tokens, taken from the graph of any model, fused or written-out attention,
and what the plan's predicted step makes of it."""

from __future__ import annotations

import pytest

import autopar
from autopar.capture import capture
from autopar.cost import count_model_flops
from autopar.models import load_model


def _standard(model, batch: int, seq: int) -> float:
    """6 N T + 12 L H S T from the model's config (PaLM, appendix B)."""
    cfg = model.config
    layers = getattr(cfg, "n_layer", None) or cfg.num_hidden_layers
    width = getattr(cfg, "n_embd", None) or cfg.hidden_size
    params = sum(p.numel() for p in model.parameters())  # a tied weight once
    tokens = batch * seq
    return 6 * params * tokens + 12 * layers * width * seq * tokens


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("gpt2-tiny", {}),
        ("gpt2-tiny", {"_attn_implementation": "eager"}),  # attention as matmuls of activations
        ("llama-tiny", {}),
        ("bert-tiny", {}),
    ],
    ids=["gpt2 sdpa", "gpt2 eager", "llama", "bert"],
)
def test_the_count_is_the_standard_formula_on_any_attention(name, overrides):
    model, args, kwargs = load_model(name, batch=4, seq=32, device="meta", overrides=overrides)
    flops = count_model_flops(capture(model, args, kwargs))
    assert flops.tokens == 4 * 32 and flops.parameters == sum(p.numel() for p in model.parameters())
    assert flops.per_step == pytest.approx(_standard(model, 4, 32), rel=1e-9)
    assert flops.with_recompute == flops.per_step  # nothing recomputed
    doubled = count_model_flops(capture(model, args, kwargs), microbatches=2)  # a step of two such micro-batches
    assert doubled.per_step == pytest.approx(2 * flops.per_step) and doubled.tokens == 2 * flops.tokens


def test_a_plan_reports_its_mfu_and_recomputation_adds_hardware_flops_only():
    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=64, device="meta")
    mesh = autopar.Mesh((4,), axis_names=("dp",))
    common = dict(example_inputs=args, example_kwargs=kwargs, profile="h100", dtype="bf16", compare_families=False)
    plain = autopar.plan(model, mesh, recompute="none", **common)
    full = autopar.plan(model, mesh, recompute="full", **common)
    f, g = plain.throughput, full.throughput
    assert f.model_flops == pytest.approx(_standard(model, 8, 64), rel=1e-9) and g.model_flops == f.model_flops
    assert f.peak_flops == 989e12  # the h100 profile's dense bf16 peak
    assert f.mfu == pytest.approx(f.model_flops / (plain.cost.total_s * 4 * f.peak_flops), rel=1e-9)
    # full recomputation runs each block's forward again: about a third of the blocks' model FLOPs
    cfg = model.config
    blocks = sum(p.numel() for n, p in model.named_parameters() if ".h." in n)
    again = 2 * blocks * 8 * 64 + 4 * cfg.n_layer * cfg.n_embd * 64 * 8 * 64
    assert g.with_recompute_flops - g.model_flops == pytest.approx(again, rel=0.05)
    assert autopar.Plan.from_json(plain.to_json()).throughput == f  # in the JSON
    assert "MFU" in plain.table() and "model FLOPs / step" in plain.table()
