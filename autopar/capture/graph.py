"""The planning graph capture hands every later stage: ``OpGraph``, its ``OpNode``s and each op's ``OpCall``.

An ``OpGraph`` lists the captured model's nodes in topological order: parameters,
buffers and inputs (sources), then ops.  Each op node carries an ``OpCall``, the op as
the strategy rules see it (target and arguments, every tensor as its ``TensorMeta``),
and the fx node it came from, which lowering replays.  The graph is built once per
capture (``export.graph_from_export``) and read by every later stage; nothing after
capture changes it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopar.spec import TensorMeta

from .call_spec import CallSpec

__all__ = ["OpCall", "OpNode", "OpGraph"]


@dataclass(frozen=True)
class OpCall:
    """What a rule sees of one op: its target and arguments, tensors as TensorMeta.

    ``args``/``kwargs`` mirror the fx node's, with each tensor argument replaced by
    its TensorMeta; ``inputs`` lists those metas in pytree-flattening order of
    ``(args, kwargs)`` (the order placements are given in), ``outputs`` the op's
    tensor outputs in order (a multi-output op such as ``split`` has several).

    ``block_hints`` holds ``(output_index, dim, blocks)`` triples: consumers of that
    output cut ``dim`` into ``blocks`` equal pieces (a fused qkv split), so a rule
    that can shard that output dim should also offer ``Shard(dim, blocks)``.
    """

    target: Any
    args: tuple
    kwargs: dict
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    block_hints: frozenset = frozenset()

    @functools.cached_property
    def flat_args(self) -> tuple[list, pytree.TreeSpec]:
        """``pytree.tree_flatten((args, kwargs))``, flattened once per call: every context built on a graph (one per
        mesh of a device count's plan) reads it for each op.  The list is shared: copy it to change it."""
        return pytree.tree_flatten((self.args, self.kwargs))

    def with_metas(self, inputs: tuple[TensorMeta, ...], outputs: tuple[TensorMeta, ...]) -> OpCall:
        """The same call with other tensor metas (used to descend to local shapes)."""
        it = iter(inputs)
        flat, spec = self.flat_args
        flat = [next(it) if isinstance(a, TensorMeta) else a for a in flat]
        args, kwargs = pytree.tree_unflatten(flat, spec)
        return OpCall(self.target, tuple(args), dict(kwargs), tuple(inputs), tuple(outputs), self.block_hints)

    @property
    def name(self) -> str:
        return str(self.target)


@dataclass(frozen=True)
class OpNode:
    """One node of the planning graph.

    ``kind``: ``param`` | ``buffer`` | ``input`` | ``op``.  ``inputs`` lists, for each
    tensor input of ``call`` (same order as ``call.inputs``), the producing node's
    index and output index.  ``requires_grad``: gradients flow through the node.
    """

    index: int
    name: str
    kind: str
    outputs: tuple[TensorMeta, ...]
    inputs: tuple[tuple[int, int], ...] = ()
    call: OpCall | None = None
    module: str = ""
    fqn: str | None = None
    requires_grad: bool = False
    fx_node: fx.Node | None = field(default=None, repr=False)

    @property
    def target(self) -> Any:
        return self.call.target if self.call is not None else None

    def describe(self) -> str:
        if self.fx_node is not None:
            return self.fx_node.format_node()
        return self.name


@dataclass(frozen=True)
class OpGraph:
    """The captured model as planning data: nodes in topological order.

    ``outputs`` are the tensor outputs as (node index, output index), in the order
    of the output tree's leaves; ``loss_output`` indexes into ``outputs`` the scalar
    loss when the model returns one.  ``call`` maps a call's Python values to the
    input nodes and the outputs back to the model's structure (its
    ``OutputLeaf.index`` points into ``outputs``).
    ``tied`` maps every alias FQN of a tied parameter to its canonical FQN.
    """

    nodes: list[OpNode]
    outputs: list[tuple[int, int]]
    loss_output: int | None
    gm: fx.GraphModule
    model_name: str
    tied: dict[str, str]
    user_inputs: list[str]
    placeholder_alias: dict[str, int] = field(default_factory=dict)  # tied alias placeholder -> node index
    # tensors export lifted out of forward (``torch.tensor(...)``, index constants): buffer-kind
    # nodes whose ``fqn`` names them here, not in the model's buffers
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    call: CallSpec | None = None
    # what is derived from the graph alone, made once (``derived``); not copied by ``dataclasses.replace``
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, made once per ``key`` for this graph: what the planner derives from the graph alone (its
        blocks, what each op saves for backward, the strategies' cache keys) is the same for every mesh and every
        context planned on it (a device count's plan prices one capture on dozens of meshes).  A captured graph
        does not change; a graph made from it (``dataclasses.replace``) starts with none."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def params(self) -> list[OpNode]:
        return [n for n in self.nodes if n.kind == "param"]

    def consumers(self) -> dict[int, list[tuple[int, int, int]]]:
        """node index -> [(consumer index, consumer input position, producer output index)]."""
        out: dict[int, list[tuple[int, int, int]]] = {n.index: [] for n in self.nodes}
        for n in self.nodes:
            for pos, (src, idx) in enumerate(n.inputs):
                out[src].append((n.index, pos, idx))
        return out
