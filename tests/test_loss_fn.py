"""``compile(model, mesh, loss_fn=fn, example_target=t)``: a model that returns no loss, trained with the user's loss
traced into the graph (``autopar/capture/with_loss.py``), on N ranks as on one device, pipelined or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import PARTITIONING_PROFILE, run_ranks
from test_execution import ADAMW

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5


def shifted_cross_entropy(output, target):
    """A causal LM's loss written by hand: the logits of each position against the next token, ``-100``
    ignored, mean over the counted tokens (what Hugging Face computes from ``labels``)."""
    logits = output.logits[:, :-1, :]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1), ignore_index=-100)


def _gpt2_without_labels(batch: int):
    from autopar.models import load_model

    model, args, kwargs = load_model(
        "gpt2-tiny", batch=batch, seq=16, device="cpu", overrides={"n_layer": 2}, no_dropout=True
    )
    target = kwargs["labels"].clone()
    target[: batch // 2, 3:] = -100  # the first micro-batches count fewer tokens
    return model.train(), args, target


def _train(step, params_of, grads_of, args, target, parameters):
    opt = torch.optim.AdamW(parameters, **ADAMW)
    losses, grads = [], None
    for k in range(STEPS):
        losses.append(float(step(*args, target=target)))
        if k == 0:
            grads = grads_of()
        opt.step()
        opt.zero_grad()
    return losses, grads, params_of()


def _rank_fn(rank, world, mesh_shape, axis_names, options):
    import autopar

    torch.manual_seed(0)
    model, args, target = _gpt2_without_labels(8)
    mesh = autopar.Mesh(mesh_shape, axis_names=axis_names)
    sharded = autopar.compile(
        model,
        mesh,
        example_inputs=args,
        loss_fn=shifted_cross_entropy,
        example_target=target,
        profile=PARTITIONING_PROFILE,
        **options,
    )
    names = sorted(n for n, _ in sharded.named_parameters())
    trained = _train(
        sharded.train_step, sharded.full_state_dict, sharded.full_grads, args, target, sharded.parameters()
    )
    try:
        sharded.train_step(*args)
        missing = "no error"
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        missing = f"{type(e).__name__}: {e}"
    return names, trained, sharded.plan.model, missing


def _reference():
    torch.manual_seed(0)
    model, args, target = _gpt2_without_labels(8)

    def step(*a, target):
        loss = shifted_cross_entropy(model(*a), target)
        loss.backward()
        return loss.detach()

    trained = _train(
        step,
        lambda: {n: v.detach().clone() for n, v in model.state_dict().items()},
        lambda: {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        args,
        target,
        model.parameters(),
    )
    return sorted(n for n, _ in model.named_parameters()), trained


@pytest.mark.parametrize(
    "mesh_shape,axis_names,options",
    [
        ((2,), ("dp",), dict(family="data parallel")),
        ((2,), ("pp",), dict(pipeline="pp", microbatches=4, schedule="1f1b")),
    ],
    ids=["data parallel", "2 stages 1f1b m4"],
)
def test_a_loss_fn_trains_like_one_device(mesh_shape, axis_names, options):
    want_names, (want_losses, want_grads, want_params) = _reference()
    for rank, (names, (losses, grads, params), model_name, missing) in enumerate(
        run_ranks(_rank_fn, 2, mesh_shape, axis_names, options, timeout_s=300)
    ):
        assert names == want_names, rank  # the model's own names, no wrapper prefix
        assert model_name == "GPT2LMHeadModelWithLoss", model_name
        assert "missing a required argument: 'target'" in missing, missing
        assert losses == pytest.approx(want_losses, rel=RTOL, abs=ATOL), (rank, losses, want_losses)
        for k, g in want_grads.items():
            torch.testing.assert_close(grads[k], g, rtol=RTOL, atol=ATOL, msg=f"rank {rank} grad {k}")
        for k, v in want_params.items():
            torch.testing.assert_close(params[k], v, rtol=RTOL, atol=ATOL, msg=f"rank {rank} param {k}")


def test_a_loss_fn_is_in_the_plan_and_keeps_the_models_names():
    import autopar

    model, args, target = _gpt2_without_labels(4)
    mesh = autopar.Mesh((2,), axis_names=("dp",))
    common = dict(example_inputs=args, profile="cpu", compare_families=False)
    with_loss = autopar.plan(model, mesh, loss_fn=shifted_cross_entropy, example_target=target, **common)
    assert set(with_loss.params) == {n for n, _ in model.named_parameters()}
    without = autopar.plan(model, mesh, **common)  # logits out, no loss: the loss's ops are not in this plan
    assert len(with_loss.nodes) > len(without.nodes)
    common.pop("compare_families")
    ctx = autopar.prepare(model, mesh, loss_fn=shifted_cross_entropy, example_target=target, **common)
    assert autopar.plan_from_context(ctx, compare_families=False).nodes == with_loss.nodes  # prepare takes it too


@pytest.mark.parametrize(
    "keywords,message",
    [
        (dict(loss_fn=shifted_cross_entropy), "loss_fn= without example_target="),
        (dict(example_target=torch.zeros(4, 16, dtype=torch.long)), "example_target= without loss_fn="),
        (dict(loss_fn="cross_entropy", example_target=torch.zeros(4, 16)), "expected a callable"),
    ],
    ids=["no target", "no loss_fn", "not callable"],
)
def test_a_loss_fn_asked_wrongly_says_what_to_pass(keywords, message):
    import autopar

    model, args, _ = _gpt2_without_labels(4)
    with pytest.raises((ValueError, TypeError), match=message):
        autopar.plan(model, autopar.Mesh((2,)), example_inputs=args, profile="cpu", **keywords)


def test_a_model_that_takes_target_itself_is_refused():
    import autopar

    class TakesTarget(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, target=None):
            return self.lin(x)

    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="already takes 'target'"):
        autopar.plan(TakesTarget(), autopar.Mesh((2,)), example_inputs=(x,), loss_fn=F.mse_loss, example_target=x)
