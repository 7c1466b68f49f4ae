"""The state dicts a checkpoint holds: a model's and its optimizer's, each rank giving only its own pieces.

``ModelState(module)`` and ``OptimizerState(module, optimizer)`` are DCP
``Stateful`` objects (``state_dict()`` / ``load_state_dict()``), for a compiled
``ShardedModule`` and for a plain ``nn.Module`` alike, so the same checkpoint
saves from one and loads into the other:

- **Model.** Keys are the original FQNs of the model's ``state_dict()``, tied
  aliases left out (the tensor is stored once, under its first name; loading sets
  every alias through the tie).  On a ``ShardedModule`` each value is a
  ``PieceTensor`` over the live local piece (``ShardedModule.local_state``), so
  DCP writes this rank's boxes and loads in place, resharding from whatever layout
  saved them; ``load_state_dict`` then calls ``module.after_load()`` (the ZeRO
  buffers' all-gather).  On a plain module the values are its own tensors.
- **Optimizer.** Keyed by parameter FQN, as ``torch.distributed.checkpoint.state_dict``
  keys it: ``{"state": {fqn: {name: value}}, "param_groups": [{..., "params":
  [fqn, ...]}]}``.  A state tensor shaped like its parameter's piece (AdamW's
  ``exp_avg``) is laid out as that parameter (a ``PieceTensor`` at its state
  placement); a 0-d tensor (``step``) is the same on every rank and saved once;
  any other shape is refused (no per-rank state autopar cannot lay out).
- **Pipelines.** A rank of a pipelined plan holds only its stages' weights: the others'
  entries are handles with no box (``LocalState.held``), so the ranks of the stage that
  holds a weight write and read it, and its optimizer state.
  Loading into an optimizer that has not stepped yet first creates its state with
  one step at learning rate 0 on zero gradients (as DCP's own helpers do), then
  writes the checkpoint's values into it in place and restores the param groups'
  hyperparameters (learning rate, schedule state) with ``optimizer.load_state_dict``.

Anything else with ``state_dict()`` / ``load_state_dict()`` (an LR scheduler, a
data loader) is Stateful to DCP as it is; plain Python values are saved as bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autopar.capture import canonical_param_names
from autopar.compiled import LocalState, ShardedModule

from .piece import PieceTensor

__all__ = ["ModelState", "OptimizerState", "init_optimizer_state", "model_pieces", "tied_aliases"]


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Alias FQN -> canonical FQN of every tied parameter of ``module`` in its state dict."""
    if isinstance(module, ShardedModule):
        return module.tied_aliases
    return {alias: canon for alias, canon in canonical_param_names(module).items() if alias != canon}


def model_pieces(module: nn.Module) -> dict[str, LocalState]:
    """FQN -> this process's piece of every model state entry, tied aliases left out.

    A plain module holds every tensor whole (a mesh of one device).
    """
    if isinstance(module, ShardedModule):
        return module.local_state()
    aliases = tied_aliases(module)
    return {
        k: LocalState(v, (), tuple(v.shape))
        for k, v in module.state_dict(keep_vars=False).items()
        if k not in aliases and torch.is_tensor(v)
    }


def _handle(module: nn.Module, piece: LocalState) -> torch.Tensor:
    """What the checkpoint reads and writes for one entry: a PieceTensor on a mesh, the tensor itself on one process."""
    if not isinstance(module, ShardedModule):
        return piece.local
    if not piece.held:  # another pipeline stage's weight: this rank writes and reads no box of it
        return PieceTensor(piece.local, piece.shape, ())
    return PieceTensor.of(piece.local, piece.shape, piece.placements, module.mesh.shape, module.coordinate)


class ModelState:
    """DCP ``Stateful`` over a model's parameters and buffers (module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return {k: _handle(self.module, p) for k, p in model_pieces(self.module).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # DCP has written every value in place (the handles view the live tensors)
        if isinstance(self.module, ShardedModule):
            self.module.after_load()
        else:
            self.module.load_state_dict(
                {**state_dict, **{a: state_dict[c] for a, c in tied_aliases(self.module).items()}}, strict=True
            )


def _named_params(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _param_groups(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> Iterator[tuple[dict, list[str]]]:
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                f"the optimizer holds {len(missing)} parameter(s) of shapes {[tuple(p.shape) for p in missing[:3]]} "
                "that are not the module's: checkpoint an optimizer built over module.parameters()"
            )
        yield group, [names[id(p)] for p in group["params"]]


class OptimizerState:
    """DCP ``Stateful`` over an optimizer of ``module``'s parameters, keyed by parameter FQN (module docstring)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module = module
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        names = _named_params(self.module)
        pieces = model_pieces(self.module)
        state: dict[str, dict[str, Any]] = {}
        groups = []
        for group, fqns in _param_groups(self.optimizer, names):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
            for p, fqn in zip(group["params"], fqns, strict=True):
                # a weight of another pipeline stage: its optimizer state is the stage's to save
                if p in self.optimizer.state and pieces[fqn].held:
                    state[fqn] = {k: self._value(fqn, k, v, p, pieces[fqn]) for k, v in self.optimizer.state[p].items()}
        return {"state": state, "param_groups": groups}

    def _value(self, fqn: str, key: str, value: Any, param: torch.Tensor, piece: LocalState) -> Any:
        if not torch.is_tensor(value) or value.dim() == 0:
            return value
        if value.shape != param.shape:
            raise ValueError(
                f"optimizer state {key!r} of parameter {fqn} has shape {tuple(value.shape)}, neither the parameter "
                f"piece's {tuple(param.shape)} nor a scalar: autopar checkpoints per-element and scalar optimizer "
                "state only; use an optimizer whose state is shaped like its parameters (SGD, Adam, AdamW, ...)"
            )
        return _handle(self.module, LocalState(value, piece.placements, piece.shape))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # DCP has written every tensor of the template in place; set the rest by parameter object
        pairs = list(_param_groups(self.optimizer, _named_params(self.module)))
        by_fqn = {f: p for group, fqns in pairs for f, p in zip(fqns, group["params"], strict=True)}
        saved_groups = state_dict["param_groups"]
        current = [fqns for _, fqns in pairs]
        if [list(g["params"]) for g in saved_groups] != current:
            raise ValueError(
                "the checkpoint's optimizer has param groups of parameters "
                f"{[_brief(g['params']) for g in saved_groups]}, this optimizer "
                f"{[_brief(f) for f in current]}: build the optimizer with the same parameter groups as the run "
                "that saved it"
            )
        ids = {fqn: i for i, fqn in enumerate(f for fqns in current for f in fqns)}
        state = {
            ids[fqn]: {k: _unwrap(v, self.optimizer.state[by_fqn[fqn]].get(k)) for k, v in values.items()}
            for fqn, values in state_dict["state"].items()
        }
        groups = [{**g, "params": [ids[f] for f in g["params"]]} for g in saved_groups]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _unwrap(loaded: Any, live: Any) -> Any:
    """The value ``optimizer.load_state_dict`` should take: the live tensor DCP wrote into, or the loaded value."""
    if isinstance(loaded, PieceTensor):
        return live if live is not None else loaded.local
    return loaded


def _brief(fqns: list[str]) -> str:
    return f"{len(fqns)} starting {fqns[0]}" if fqns else "none"


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state without changing a parameter: one step on zero gradients at learning rate 0.

    Does nothing when the optimizer already has state or a parameter has a
    gradient.  Collective on a ``ShardedModule`` with ZeRO parameters (the step's
    all-gather follows the step): call it on every rank.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        if lr is not None:
            g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
