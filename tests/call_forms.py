"""Models whose ``forward`` takes and returns every form a user writes, for tests/test_call_forms.py.

Each ``FORMS`` entry builds a model (seeded, small enough to train in a second)
and the call to compile and train it with: ``(model, args, kwargs)``.  The models
share one trunk (layer norm, two linears), so every plan family has something to
split; only the signature and the output structure differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from transformers.utils import ModelOutput

from autopar.capture.call_spec import register_dataclasses

WIDTH, HIDDEN, ROWS = 16, 64, 4


@dataclasses.dataclass
class Pair:
    """A plain dataclass output (autopar registers it with pytree)."""

    loss: torch.Tensor
    out: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Batch:
    """A frozen dataclass input with a field left out of __init__."""

    x: torch.Tensor
    target: torch.Tensor
    tag: str = dataclasses.field(default="b", init=False)


@dataclasses.dataclass
class TrunkOutput(ModelOutput):
    """A Hugging Face ``ModelOutput``, as transformers models return."""

    loss: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    extra: torch.Tensor | None = None


class Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


class Positional(Trunk):
    """forward(x, target) -> a tuple."""

    def forward(self, x, target):
        out = self.run(x)
        return _mse(out, target), out


class PositionalOnly(Trunk):
    """forward(x, target, /) -> a list."""

    def forward(self, x, target, /):
        out = self.run(x)
        return [_mse(out, target), out]


class VarArgs(Trunk):
    """forward(*xs): the last is the target -> a dict with a list of tensors."""

    def forward(self, *xs):
        *inputs, target = xs
        outs = [self.run(x) for x in inputs]
        return {"loss": sum(_mse(o, target) for o in outs), "outs": outs}


class KeywordOnly(Trunk):
    """Keyword-only int, float, bool and str arguments change the graph -> a nested dict."""

    def forward(self, x, *, target, repeat: int = 1, scale: float = 1.0, residual: bool = False, reduce: str = "mean"):
        h = x
        for _ in range(repeat):
            h = self.run(h) * scale + (h if residual else 0)
        err = (h - target) ** 2
        loss = err.mean() if reduce == "mean" else err.sum() / 100
        return {"loss": loss, "parts": {"out": h, "scaled": (h * 2,)}}


class VarKwargs(Trunk):
    """forward(x, **named): every named tensor is a target -> a dataclass."""

    def forward(self, x, **named):
        out = self.run(x)
        return Pair(sum(_mse(out, t) for t in named.values()), out)


class Defaults(Trunk):
    """Defaults left out at compile, passed explicitly (with their default values) at call -> a ModelOutput."""

    def forward(self, x, target, mask=None, scale=1.0, extra=None):
        out = self.run(x) * scale
        if mask is not None:
            out = out * mask
        loss = _mse(out, target)
        return TrunkOutput(loss=loss, hidden=out, extra=None if extra is None else out + extra)


class NoneArguments(Trunk):
    """A ``None`` between tensors, and a tensor where a default None is -> a ModelOutput with a None field."""

    def forward(self, x, mask=None, target=None, bias=None):
        out = self.run(x)
        if bias is not None:
            out = out + bias
        return TrunkOutput(loss=_mse(out, target), hidden=out)


class Nested(Trunk):
    """One nested batch: dicts, tuples, lists and a dataclass of tensors -> a nested dataclass/dict/tuple."""

    def forward(self, batch, aux: Batch):
        x = batch["x"] + batch["extra"][0] + batch["extra"][1][0] * batch["extra"][1][1]
        out = self.run(x) + self.run(aux.x)
        loss = _mse(out, batch["meta"]["target"]) + _mse(out, aux.target)
        return Pair(loss, {"out": out, "pieces": (out[:, :4], [out[:, 4:]]), "count": 2})


class LossOnly(Trunk):
    """-> a bare tensor."""

    def forward(self, x, target):
        return _mse(self.run(x), target)


class Features(Trunk):
    """-> the features alone: the loss is computed outside the compiled module (``loss_of``)."""

    def forward(self, x):
        return self.run(x)


def _t(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _positional(g):
    return Positional(), (_t(ROWS, WIDTH, gen=g), _t(ROWS, WIDTH, gen=g)), {}


def _positional_only(g):
    return PositionalOnly(), (_t(ROWS, WIDTH, gen=g), _t(ROWS, WIDTH, gen=g)), {}


def _var_args(g):
    return VarArgs(), tuple(_t(ROWS, WIDTH, gen=g) for _ in range(3)), {}


def _keyword_only(g):
    kw = {"target": _t(ROWS, WIDTH, gen=g), "repeat": 2, "scale": 0.5, "residual": True, "reduce": "sum"}
    return KeywordOnly(), (_t(ROWS, WIDTH, gen=g),), kw


def _var_kwargs(g):
    return VarKwargs(), (_t(ROWS, WIDTH, gen=g),), {"a": _t(ROWS, WIDTH, gen=g), "b": _t(ROWS, WIDTH, gen=g)}


def _defaults(g):
    return Defaults(), (_t(ROWS, WIDTH, gen=g), _t(ROWS, WIDTH, gen=g)), {}


def _none_arguments(g):
    x, target, bias = _t(ROWS, WIDTH, gen=g), _t(ROWS, WIDTH, gen=g), _t(WIDTH, gen=g)
    return NoneArguments(), (x, None, target), {"bias": bias}


def _nested(g):
    batch = {
        "x": _t(ROWS, WIDTH, gen=g),
        "extra": (_t(ROWS, WIDTH, gen=g), [_t(ROWS, WIDTH, gen=g), _t(ROWS, WIDTH, gen=g)]),
        "meta": {"target": _t(ROWS, WIDTH, gen=g)},
    }
    return Nested(), (batch,), {"aux": Batch(_t(ROWS, WIDTH, gen=g), _t(ROWS, WIDTH, gen=g))}


def _loss_only(g):
    return LossOnly(), (_t(ROWS, WIDTH, gen=g), _t(ROWS, WIDTH, gen=g)), {}


def _loss_outside(g):
    return Features(), (_t(ROWS, WIDTH, gen=g),), {}


#: form name -> factory(generator) -> (model, args, kwargs)
FORMS: dict[str, Callable] = {
    "positional": _positional,
    "positional-only": _positional_only,
    "var-args": _var_args,
    "keyword-only": _keyword_only,
    "var-kwargs": _var_kwargs,
    "defaults": _defaults,
    "none-arguments": _none_arguments,
    "nested": _nested,
    "loss-only": _loss_only,
    "loss-outside": _loss_outside,
}

#: form name -> (args, kwargs) -> the same call written another way (must be accepted as the compiled one)
RESTATED: dict[str, Callable] = {
    "positional": lambda a, k: ((a[0],), {"target": a[1]}),
    "keyword-only": lambda a, k: (a, dict(reversed(list(k.items())))),
    "var-kwargs": lambda a, k: (a, {"b": k["b"], "a": k["a"]}),
    "defaults": lambda a, k: (a, {"mask": None, "scale": 1.0, "extra": None}),
    "none-arguments": lambda a, k: ((a[0],), {"target": a[2], "bias": k["bias"], "mask": None}),
    "nested": lambda a, k: (({"meta": a[0]["meta"], "extra": a[0]["extra"], "x": a[0]["x"]},), {"aux": k["aux"]}),
}


def build(form: str, seed: int = 0):
    """(model, args, kwargs) of ``form``: weights from ``seed``, inputs from ``seed + 1``."""
    torch.manual_seed(seed)
    return FORMS[form](torch.Generator().manual_seed(seed + 1))


def loss_of(out) -> torch.Tensor:
    """The loss in any of the forms' outputs: the first leaf (every form puts it first), or, where that is
    not a scalar (``Features``), a loss computed from it here, outside the model: its distance to a fixed
    target, ``((out - 0.1 * arange) ** 2).mean()``.

    The plain model's dataclass outputs are registered with pytree as autopar's
    capture registers them on the ranks, so both sides flatten alike.
    """
    register_dataclasses(out)
    first = torch.utils._pytree.tree_leaves(out)[0]
    if first.ndim == 0:
        return first
    target = 0.1 * torch.arange(first.numel(), dtype=first.dtype).reshape(first.shape)
    return ((first - target) ** 2).mean()
