"""A model that does not return its loss, given one: ``compile(model, mesh, loss_fn=fn, example_target=t)``.

``with_loss(model, fn)`` is an ``nn.Module`` whose call ``(*args, target=t, **kwargs)`` returns
``fn(model(*args, **kwargs), t)``, so the loss is traced into the graph like a model's own: the planner prices
it, ``train_step`` runs its backward, and micro-batches weigh it as one device does (a mean over the batch, or
over the labels not ignored, ``compiled/pipeline_runner.LossWeights``).

It is the model under another call, not a parent of it: it shares the model's tables of submodules, parameters
and buffers, so every name (a plan's, a hint's, a checkpoint's, ``named_parameters``) is the model's own, and a
state dict of one loads into the other.  Its signature is the model's with a keyword-only ``target`` added, which
``capture`` binds calls against as it binds the model's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

__all__ = ["TARGET", "WithLoss", "attach_loss", "with_loss"]

#: The keyword the target travels under (``train_step(..., target=t)``).
TARGET = "target"


class WithLoss(nn.Module):
    """``loss_fn(model(*args, **kwargs), target)`` under the model's own names (module docstring)."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        object.__setattr__(self, "model", model)  # not registered: its children are already ours
        object.__setattr__(self, "loss_fn", loss_fn)
        self.training = model.training
        object.__setattr__(self, "forward", self._forward_with(_signature(model)))

    def _forward_with(self, signature: inspect.Signature | None):
        def forward(*args, **kwargs):
            if TARGET not in kwargs:
                raise TypeError(
                    f"{type(self.model).__name__} was compiled with loss_fn=: call it with the target as a keyword, "
                    f"e.g. sharded.train_step(*inputs, {TARGET}=labels)"
                )
            target = kwargs.pop(TARGET)
            return self.loss_fn(self.model(*args, **kwargs), target)

        forward.__signature__ = signature
        forward.__name__ = "forward"
        return forward

    def train(self, mode: bool = True) -> WithLoss:
        self.model.train(mode)
        return super().train(mode)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # the model's own attributes (a Hugging Face model's config, ...)
            model = self.__dict__.get("model")
            if model is None:  # not yet set (during __init__)
                raise
            return getattr(model, name)


def _signature(model: nn.Module) -> inspect.Signature | None:
    """The model's forward signature with ``target`` added as a keyword-only parameter (before ``**kwargs``)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if TARGET in sig.parameters:
        raise ValueError(
            f"{type(model).__name__}.forward already takes {TARGET!r}: with loss_fn= the target travels under that "
            f"keyword; rename the model's argument or fold the loss into the model"
        )
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter(TARGET, inspect.Parameter.KEYWORD_ONLY))
    return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


def with_loss(model: nn.Module, loss_fn: Callable | None) -> nn.Module:
    """``model`` itself when ``loss_fn`` is None, else a ``WithLoss`` of it (its class named
    ``<model class>WithLoss``, which messages and plans show)."""
    if loss_fn is None:
        return model
    if not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r}: expected a callable fn(output, target) returning a scalar loss")
    cls = type(f"{type(model).__name__}WithLoss", (WithLoss,), {"__module__": __name__})
    return cls(model, loss_fn)


def attach_loss(
    model: nn.Module, loss_fn: Callable | None, example_kwargs: dict | None, example_target, *, lazy: bool = False
) -> tuple[nn.Module, dict | None]:
    """What ``plan`` and ``compile`` trace when given ``loss_fn=`` / ``example_target=``: the model with its loss
    (``with_loss``) and the example keywords with the target added.  ``lazy``: no example inputs yet (a lazy
    compile takes the target from its first call)."""
    if loss_fn is None:
        if example_target is not None:
            raise ValueError(
                "example_target= without loss_fn=: the target is what loss_fn(output, target) compares the "
                "output with; pass loss_fn= too, or give the model its labels in example_kwargs"
            )
        return model, example_kwargs
    if example_target is None and not lazy:
        raise ValueError(
            "loss_fn= without example_target=: the loss is traced into the graph, which needs an example target "
            f"(e.g. example_target=labels); train_step then takes it as {TARGET}=..."
        )
    if example_kwargs and TARGET in example_kwargs:
        raise ValueError(f"example_kwargs already holds {TARGET!r}: with loss_fn= pass it as example_target=")
    kwargs = dict(example_kwargs or {})
    if example_target is not None:
        kwargs[TARGET] = example_target
    return with_loss(model, loss_fn), kwargs
