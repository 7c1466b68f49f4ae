"""Fused cross-entropy (lower/fused_loss.py): where the plan keeps the classes whole, the loss runs as one log-softmax.

Each case trains on 2 gloo ranks under a data-parallel plan (rows split, classes
whole: the fused path must be taken) and under a plan whose hint shards the
classifier's output dim (classes split: the decomposed vocab-parallel form must
run), and compares loss, logits, every gradient and every parameter after 3 AdamW steps
with one device; the collectives counted in the first step must equal the plan's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import PARTITIONING_PROFILE, run_ranks
from test_execution import _assert_trains_alike, _loss_and_logits, _train
from torch import nn

from autopar.placement import Shard

# (rows, classes) per plan: many rows make the data-parallel plan split them; few rows of many classes
# make splitting the rows of the logits (an all-to-all of them) dearer than the vocab-parallel loss's
# three small all-reduces, so the vocab hint's plan keeps the classes split through the loss
SIZES = {"dp": (64, 1000), "vocab": (16, 16384)}
# a vocab-parallel classifier: the activation whole, the weight's output features split over the 2 ranks
VOCAB_HINT = ((1, 1), (1, 2))
PLANS = {"dp": {"family": "data parallel"}, "vocab": {"hints": {"lm_head": VOCAB_HINT}}}


class _Classifier(nn.Module):
    """``F.cross_entropy`` with the options the decomposition supports (label smoothing, sum/none).

    ``reduction="none"``: the rows are summed with weights (every row's gradient
    differs), so the module still returns one loss.
    """

    def __init__(self, reduction: str, label_smoothing: float, rows: int, classes: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, classes)
        self.register_buffer("row_weights", torch.linspace(0.5, 1.5, rows))
        self.reduction, self.label_smoothing = reduction, label_smoothing

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        logits = self.lm_head(torch.tanh(self.body(x)))
        loss = F.cross_entropy(logits, labels, reduction=self.reduction, label_smoothing=self.label_smoothing)
        if self.reduction == "none":
            loss = (loss * self.row_weights).sum()
        return loss, logits


def _labels(labels: torch.Tensor) -> torch.Tensor:
    """Some targets ignored (-100), as padding and prompt tokens are."""
    labels = labels.clone()
    flat = labels.view(-1)
    flat[::5] = -100
    flat[:3] = -100
    return labels


def _model(name: str, plan: str):
    """(model, args, kwargs): a tiny HF model or a ``_Classifier`` of ``SIZES[plan]``, some labels ignored."""
    rows, classes = SIZES[plan]
    gen = torch.Generator().manual_seed(1)
    if name.startswith("classifier"):
        _, reduction, smoothing = name.split("-")
        x = torch.randn(rows, 32, generator=gen)
        labels = _labels(torch.randint(0, classes, (rows,), generator=gen))
        return _Classifier(reduction, float(smoothing), rows, classes), (x, labels), {}
    import transformers

    if name == "llama":
        config = transformers.LlamaConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=classes,
            max_position_embeddings=64,
            use_cache=False,
        )
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=classes + 1, n_positions=64)
        config.use_cache = False
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    model = cls(config)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    model.train()
    ids = torch.randint(0, classes, (4, rows // 4), generator=gen)
    return model, (ids,), {"labels": _labels(torch.randint(0, classes, (4, rows // 4), generator=gen))}


def _loss_facts(sharded) -> dict:
    """Whether the lowered program fuses the loss, and how the plan places the gathered logits (classes split?)."""
    from autopar.capture.decompose import DECOMPOSED

    gather = [
        n.name for n in sharded._graph.gm.graph.nodes if getattr(n.meta.get(DECOMPOSED), "role", "") == "target_logit"
    ]
    placements = [sharded.plan.nodes[name].inputs[0] for name in gather]
    code = sharded.local_graph.code
    return {
        "groups": len(gather),
        "fused": code.count("aten._log_softmax.default("),
        "decomposed": code.count("aten.exp.default("),
        "classes_split": any(isinstance(p, Shard) and p.dim == 1 for pl in placements for p in pl),
        "rows_split": any(isinstance(p, Shard) and p.dim == 0 for pl in placements for p in pl),
    }


def _rank_fn(rank, world, name, plans):
    import autopar
    from autopar.runtime import CollectiveCounter

    mesh = autopar.Mesh((world,), axis_names=("x",))
    out = {}
    for plan_name in plans:
        model, args, kwargs = _model(name, plan_name)
        sharded = autopar.compile(
            model, mesh, example_inputs=args, example_kwargs=kwargs, profile=PARTITIONING_PROFILE, **PLANS[plan_name]
        )
        counter = CollectiveCounter()
        result = _train((sharded, _loss_and_logits(sharded)), args, kwargs, counter)
        counted = sorted((r.kind, r.phase, r.bytes) for r in counter.records)
        planned = sorted((c.kind, c.phase, c.bytes) for c in sharded.plan.collectives)
        out[plan_name] = (result, _loss_facts(sharded), counted, planned)
    return out


def _reference(name, plan):
    model, args, kwargs = _model(name, plan)
    return _train((model, lambda *a, **k: _as_pair(model(*a, **k))), args, kwargs)


def _as_pair(out):
    return (out.loss, out.logits) if hasattr(out, "loss") else out


CASES = ["llama", "gpt2", "classifier-mean-0.1", "classifier-sum-0.0", "classifier-none-0.2"]


@pytest.mark.parametrize("name", CASES)
def test_fused_loss_trains_like_one_device(name):
    """Data parallel: fused, vocab-sharded: decomposed; both exact, with the plan's collectives."""
    refs = {plan: _reference(name, plan) for plan in PLANS}
    results = run_ranks(_rank_fn, 2, name, tuple(PLANS), timeout_s=600)
    for rank, per_plan in enumerate(results):
        for plan_name, (got, facts, counted, planned) in per_plan.items():
            where = f"{name}, rank {rank}, plan {plan_name}"
            assert facts["groups"] == 1, f"{where}: {facts}"
            if plan_name == "dp":  # classes whole on every rank: one log-softmax, no exp of the decomposition
                assert (facts["fused"], facts["decomposed"], facts["classes_split"]) == (1, 0, False), where
            else:  # classes split: the vocab-parallel pieces run, nothing fused
                assert (facts["fused"], facts["decomposed"], facts["classes_split"]) == (0, 1, True), where
            assert counted == planned, f"{where}: counted {counted} != planned {planned}"
            _assert_trains_alike(got, refs[plan_name], where)
