"""Depth reuse: trace a deep model at four layers and stamp its middle layer to the whole depth.

torch.export's time grows with the ops it traces (about 35 ms per Llama block on a 2-core
machine: 2.3 s of a 64-layer model's planning), and a deep model is one layer traced over
and over.  ``export_stamped(model, args, kwargs, export)`` traces the model with its layer
list cut to four of its modules (the first three and the last) and builds the graph of the
whole depth ``L`` from that trace::

    prelude | layer 0 | layer 1 | layer 2, stamped as layers 2 .. L-2 | layer 3, renamed L-1 | postlude

The result is the graph (and graph signature) a full ``torch.export`` gives: the same nodes
in the same order with the same names (export numbers nodes per op name in creation order,
``add``, ``add_1``, ...: the copies are created in that order from base names), the same
placeholders and input specs (layer ``j``'s parameters and buffers named as export names
them), the same fake values (a copy's values own fresh storages where the stamped layer's
own, and share the storages of the values they view elsewhere, so ``saved.storage_roots``
sees the views the full trace has) and module paths (``nn_module_stack`` renamed).
``tests/test_stamp.py`` compares a stamped capture with the full trace, node by node, on
several Hugging Face architectures.

Stamping applies when all of these hold, else ``export_stamped`` returns None and the caller
traces the whole model (logged at INFO):

1. the model has an ``nn.ModuleList`` of at least :data:`STAMP_MIN_LAYERS` alike modules,
   not inside another module list: the same class, the same parameters and buffers (names,
   shapes, dtypes, ``requires_grad``; each its own tensor, used nowhere else), the same
   plain attributes over the whole subtree (an int equal to the module's position, a
   ``layer_idx``, aside), no hooks;
2. the model traces with the cut list;
3. in that trace each layer's nodes (by ``nn_module_stack``) are one run, in list order;
4. layers 1 and 2 are the same program: op by op the same target, arguments (a node of the
   layer by position, of the layer before by position, the layer's own parameters and
   buffers by name, any other node the same node), fake values (shape, stride, dtype,
   ``requires_grad``, the owner of the storage by the same rule) and module paths;
5. a layer's nodes are read only by itself and the next layer (the last layer's by
   anything): no output collects every layer's hidden state; every output is a user
   output (no per-layer buffer mutation).

Then layer ``j`` of the full model runs layer 2's program on layer ``j``'s parameters and
layer ``j - 1``'s values, exactly as layer 2 runs on layer 1's: that is what the full
trace records, since the modules are alike and their inputs have the same form.  What the
checks cannot see is behaviour the model's own loop decides by the loop index (a
``config.layer_types[i]`` read in the parent's ``forward`` while the layers' modules are
alike): ``AUTOPAR_FULL_TRACE=1`` turns stamping off.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.export.graph_signature import ExportGraphSignature, InputSpec, OutputSpec, TensorArgument
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.utils import _pytree as pytree

from .fake_values import NUMBERED, fake_on, meta_storage

__all__ = ["STAMP_MIN_LAYERS", "Traced", "export_stamped"]

log = logging.getLogger(__name__)

#: the fewest layers a list must have to be stamped (four are traced; fewer gain nothing)
STAMP_MIN_LAYERS = 6
#: positions of the full list traced: the first three and the last
_TRACED = 4

_HOOK_KEYS = re.compile(r"hook")
_MODULE_STATE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


class _CannotStamp(Exception):
    """A check of the module docstring failed; the message says which."""


@dataclass(frozen=True)
class Traced:
    """What capture reads of an export: the graph, its signature, lifted constants and the call's trees."""

    gm: fx.GraphModule
    signature: ExportGraphSignature
    constants: dict
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec

    @classmethod
    def of(cls, ep) -> Traced:
        return cls(ep.graph_module, ep.graph_signature, ep.constants, ep.call_spec.in_spec, ep.call_spec.out_spec)


def export_stamped(model: torch.nn.Module, args: tuple, kwargs: dict, export: Callable) -> Traced | None:
    """The full-depth trace of ``model(*args, **kwargs)`` built from a four-layer one, or None (see the module
    docstring).  ``export(model, args, kwargs)`` is the tracer (``capture.export_program``)."""
    if os.environ.get("AUTOPAR_FULL_TRACE"):
        return None
    found = _layer_list(model)
    if found is None:
        return None
    path, layers = found
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    depth = len(layers)
    setattr(parent, name, torch.nn.ModuleList([layers[0], layers[1], layers[2], layers[depth - 1]]))
    try:
        ep = export(model, args, kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of the cut model means: trace the whole one
        log.info(
            "stamp: %s with %s cut to %d layers does not trace (%s); tracing all %d",
            type(model).__name__,
            path,
            _TRACED,
            type(e).__name__,
            depth,
        )
        return None
    finally:
        setattr(parent, name, layers)
    try:
        traced = _Stamp(Traced.of(ep), path, depth).build()
    except _CannotStamp as e:
        log.info("stamp: %s: %s; tracing all %d layers", path, e, depth)
        return None
    log.info("stamp: traced %d of %d layers of %s", _TRACED, depth, path)
    return traced


# --- 1. the layer list ------------------------------------------------------------------------------------------


def _layer_list(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """(path, list) of the module list with the most parameters whose modules are alike, or None."""
    best = None
    counts = _use_counts(model)
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < STAMP_MIN_LAYERS or not path:
            continue
        if any(part.isdigit() for part in path.split(".")):
            continue  # a list inside a list's module (a layer's experts): not the layers
        if not _alike(list(mod), counts):
            continue
        size = sum(p.numel() for p in mod.parameters())
        if best is None or size > best[0]:
            best = (size, path, mod)
    return None if best is None else (best[1], best[2])


def _use_counts(model: torch.nn.Module) -> dict[int, int]:
    """id(tensor) -> how many names the model has for it (parameters and buffers)."""
    counts: dict[int, int] = {}
    for _, t in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        counts[id(t)] = counts.get(id(t), 0) + 1
    return counts


def _alike(layers: list[torch.nn.Module], counts: dict[int, int]) -> bool:
    forms = [_form(layer) for layer in layers]
    if any(f is None for f in forms) or any(f[0] != forms[0][0] for f in forms):
        return False
    for key in forms[0][1]:
        values = [f[1].get(key) for f in forms]
        if any(v != values[0] for v in values) and values != list(range(len(layers))):
            return False  # differs between layers and is not the layer's position
    if any(f[1].keys() != forms[0][1].keys() for f in forms):
        return False
    return all(counts.get(id(t)) == 1 for layer in layers for t in itertools.chain(layer.parameters(), layer.buffers()))


def _form(layer: torch.nn.Module) -> tuple[tuple, dict] | None:
    """(structure, plain attributes by (submodule path, name)) of one layer; None when it has hooks."""
    structure = []
    attrs: dict[tuple[str, str], Any] = {}
    for sub_path, sub in layer.named_modules(remove_duplicate=False):
        structure.append((sub_path, type(sub), sub.training))
        for key, value in vars(sub).items():
            if _HOOK_KEYS.search(key):
                if value:
                    return None
            elif key not in _MODULE_STATE:
                attrs[(sub_path, key)] = _plain(value)
    for fqn, t in itertools.chain(layer.named_parameters(), layer.named_buffers()):
        structure.append((fqn, tuple(t.shape), t.dtype, t.device.type, t.requires_grad))
    return tuple(structure), attrs


def _plain(value, depth: int = 2) -> Any:
    """A comparable form of an attribute: plain values as they are, containers by content, tensors by shape and
    dtype, a ``functools.partial`` by its function and arguments, an object of a class with plain attributes by
    its class and those (``depth`` levels deep), any other object by identity (layers sharing one config compare
    equal; functions are module-level objects)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if depth < 0:
        return ("object", id(value))
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_plain(v, depth - 1) for v in value))
    if isinstance(value, (set, frozenset)):
        return frozenset(_plain(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return (dict, tuple((k, _plain(v, depth - 1)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, tuple(value.shape), value.dtype)
    if isinstance(value, functools.partial):
        return (functools.partial, id(value.func), _plain(value.args, depth - 1), _plain(value.keywords, depth - 1))
    if not callable(value) and type(value).__init__ is not object.__init__ and hasattr(value, "__dict__"):
        return (type(value), _plain(vars(value), depth - 1))
    return ("object", id(value))


# --- 2-5. the traced layers and the stamped graph -----------------------------------------------------------


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(val) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(val) if isinstance(x, torch.Tensor)]


def _fake(t: torch.Tensor, storage) -> torch.Tensor:
    """A fake tensor like ``t`` (size, stride, offset, dtype, requires_grad) on ``storage``."""
    return fake_on(t, storage, t.storage_offset(), t.shape, t.stride(), t.fake_mode)


def _fresh_storage(t: torch.Tensor):
    return meta_storage(t.untyped_storage().nbytes())


class _Stamp:
    """The four-layer trace ``traced`` of a list at ``path`` of ``depth`` layers, and the full graph built from it."""

    def __init__(self, traced: Traced, path: str, depth: int) -> None:
        self.traced, self.path, self.depth = traced, path, depth
        self.index = re.compile(re.escape(path) + r"\.(\d+)(?=\.|$)")
        self.graph = traced.gm.graph
        nodes = list(self.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = nodes[-1]
        self.spec = {s.arg.name: s for s in traced.signature.input_specs}
        self.state_layer = {n: self._layer_of_path(self.spec[n.name].target or "") for n in self.placeholders}
        self.prelude, self.layers, self.postlude = self._segments(
            [n for n in nodes if n.op in ("call_function", "get_attr")]
        )
        self.owner: dict[int, fx.Node] = {}  # storage -> the node whose value made it (the first in graph order)
        for n in nodes:
            for t in _tensors(n.meta.get("val")):
                self.owner.setdefault(_storage_key(t), n)
        self._check()

    # -- reading the trace

    def _layer_of_path(self, path: str) -> int | None:
        m = self.index.match(path)
        return int(m.group(1)) if m else None

    def _layer_of_node(self, node: fx.Node) -> int | None:
        found = {self._layer_of_path(p) for p, _ in (node.meta.get("nn_module_stack") or {}).values()} - {None}
        if len(found) > 1:
            raise _CannotStamp(f"{node.name} runs in layers {sorted(found)} at once")
        return found.pop() if found else None

    def _segments(self, ops: list[fx.Node]) -> tuple[list, list[list], list]:
        """(prelude, the four layers' runs, postlude): layer i's run is from its first node to the next layer's
        first (the last layer's to its last node), so nodes between layers belong to the layer before."""
        layer = [self._layer_of_node(n) for n in ops]
        seen = [x for x in layer if x is not None]
        if seen != sorted(seen) or set(seen) != set(range(_TRACED)):
            raise _CannotStamp(f"the layers' nodes are not {_TRACED} runs in order")
        first = [layer.index(i) for i in range(_TRACED)]
        end = len(layer) - layer[::-1].index(_TRACED - 1)
        bounds = [*first, end]
        runs = [ops[bounds[i] : bounds[i + 1]] for i in range(_TRACED)]
        return ops[: first[0]], runs, ops[end:]

    def _token(self, node: fx.Node, here: dict, before: dict, layer: int):
        """How ``node`` is read by layer ``layer`` (see check 4): a position in it or the layer before, its own
        state by name, or the node itself."""
        if node in here:
            return ("in", here[node])
        if node in before:
            return ("before", before[node])
        if self.state_layer.get(node) == layer:
            return ("state", self.index.sub("*", self.spec[node.name].target, count=1))
        return ("node", node)

    def _program(self, layer: int) -> list:
        """Layer ``layer``'s run in the form check 4 compares."""
        here = {n: p for p, n in enumerate(self.layers[layer])}
        before = {n: p for p, n in enumerate(self.layers[layer - 1])}
        out = []
        for n in self.layers[layer]:
            args = fx.map_arg((n.args, n.kwargs), lambda a: self._token(a, here, before, layer))
            vals = [
                (
                    tuple(t.shape),
                    t.stride(),
                    t.storage_offset(),
                    t.dtype,
                    t.requires_grad,
                    self._token(self.owner[_storage_key(t)], here, before, layer),
                )
                for t in _tensors(n.meta.get("val"))
            ]
            stack = [(self.index.sub("*", p), kind) for p, kind in (n.meta.get("nn_module_stack") or {}).values()]
            out.append((n.op, n.target, args, vals, stack))
        return out

    def _check(self) -> None:
        if self._program(1) != self._program(2):
            raise _CannotStamp("layers 1 and 2 trace to different programs")
        runs = [set(run) for run in self.layers]
        for i in range(_TRACED - 1):
            readers = runs[i] | runs[i + 1]
            for n in self.layers[i]:
                if any(u not in readers for u in n.users):
                    raise _CannotStamp(f"layer {i}'s {n.name} is read past the next layer")
        earlier = runs[0] | runs[1]
        if any(a in earlier for n in self.layers[_TRACED - 1] for a in n.all_input_nodes):
            raise _CannotStamp("the last layer reads a layer before the one before it")
        kinds = {s.kind.name for s in self.traced.signature.output_specs}
        if kinds - {"USER_OUTPUT", "LOSS_OUTPUT"}:
            raise _CannotStamp(f"the graph outputs {sorted(kinds)} (a buffer mutation per layer is not stamped)")
        if {s.kind.name for s in self.traced.signature.input_specs} - {
            "PARAMETER",
            "BUFFER",
            "CONSTANT_TENSOR",
            "USER_INPUT",
        }:
            raise _CannotStamp("the graph takes tokens or script objects")
        if any(a.op == "get_attr" for run in self.layers for n in run for a in n.all_input_nodes):
            raise _CannotStamp("a layer calls a submodule graph")

    # -- building the full graph

    def _renamed(self, text: str, layer: int, sep: str) -> str:
        """``text`` (an FQN, ``sep`` "."; or a placeholder name, ``sep`` "_") of traced layer 3 or 2, as layer
        ``layer``'s."""
        head = self.path.replace(".", sep) + sep
        pattern = re.compile(re.escape(head) + r"(\d+)(?=" + re.escape(sep) + "|$)")
        new, count = pattern.subn(lambda m: f"{head}{layer}", text, count=1)
        if count != 1:
            raise _CannotStamp(f"cannot name {text!r} for layer {layer}")
        return new

    def build(self) -> Traced:
        self.new = fx.Graph()
        self.new._codegen = self.graph._codegen
        self.env: dict[fx.Node, fx.Node] = {}
        specs = self._placeholders()
        for n in itertools.chain(self.prelude, self.layers[0], self.layers[1], self.layers[2]):
            self._emit(n, self.env.__getitem__, n.meta.get("val"))
        before = [self.env[n] for n in self.layers[2]]
        for j in range(3, self.depth - 1):
            before = self._stamp(j, before)
        last = {n: c for n, c in zip(self.layers[2], before)}
        storages = self._storage_map(self.layers[2], before, {})
        rename = self._stack_renamer(3, self.depth - 1)
        for run, renamed in ((self.layers[3], rename), (self.postlude, None)):
            for n in run:
                val = self._moved(n.meta.get("val"), storages, None)
                self._emit(n, lambda a: last.get(a) or self.env[a], val, renamed=renamed)
        out = self.new.create_node("output", "output", fx.map_arg(self.output.args, self.env.__getitem__))
        out.meta = dict(self.output.meta)
        outputs = [
            OutputSpec(
                s.kind,
                TensorArgument(self._new_name(s.arg.name)) if isinstance(s.arg, TensorArgument) else s.arg,
                s.target,
            )
            for s in self.traced.signature.output_specs
        ]
        with _use_lazy_graph_module(True):  # no code generated here: capture's clean-up recompiles once
            gm = _make_graph_module(self.traced.gm, self.new, class_name=type(self.traced.gm).__name__)
        gm.meta.update(self.traced.gm.meta)
        signature = ExportGraphSignature(input_specs=specs, output_specs=outputs)
        return Traced(gm, signature, self.traced.constants, self.traced.in_spec, self.traced.out_spec)

    def _new_name(self, old: str) -> str:
        return next(c.name for n, c in self.env.items() if n.name == old)

    def _placeholders(self) -> list[InputSpec]:
        """Create every placeholder of the full graph, in the full export's order (each layer's state in a run:
        traced layer 2's runs repeated for layers 2 .. L-2, layer 3's renamed L-1); their input specs."""
        self.state_copies: dict[tuple[fx.Node, int], fx.Node] = {}
        specs = []
        for layer, run in itertools.groupby(self.placeholders, key=self.state_layer.get):
            run = list(run)
            targets = {2: range(2, self.depth - 1), 3: [self.depth - 1]}.get(layer, [layer])
            for j in targets:
                for n in run:
                    spec = self.spec[n.name]
                    if j == layer:
                        node = self.new.placeholder(n.name)
                        node.meta = dict(n.meta)
                        self.env[n] = node
                        specs.append(spec)
                        continue
                    name = self._renamed(n.name, j, "_")
                    node = self.new.placeholder(name)
                    node.meta = dict(n.meta)
                    if layer == 2:
                        val = n.meta["val"]
                        node.meta["val"] = _fake(val, _fresh_storage(val))
                        self.state_copies[(n, j)] = node
                    else:
                        self.env[n] = node
                    target = self._renamed(spec.target, j, ".")
                    specs.append(InputSpec(spec.kind, TensorArgument(name), target, spec.persistent))
        return specs

    def _stamp(self, j: int, before: list[fx.Node]) -> list[fx.Node]:
        """Layer ``j`` (3 <= j <= L-2): traced layer 2's program on layer j's state and ``before``, layer j-1's
        nodes (by position); its nodes."""
        state = {n: c for (n, k), c in self.state_copies.items() if k == j}
        prior = dict(zip(self.layers[1], before))
        storages = self._storage_map(self.layers[1], before, state)
        made: dict[fx.Node, fx.Node] = {}
        rename = self._stack_renamer(2, j)
        for n in self.layers[2]:
            val = self._moved(n.meta.get("val"), storages, self.layers[2])
            made[n] = self._emit(
                n, lambda a: made.get(a) or prior.get(a) or state.get(a) or self.env[a], val, renamed=rename, keep=False
            )
        return [made[n] for n in self.layers[2]]

    def _storage_map(self, traced: list[fx.Node], copies: list[fx.Node], state: dict) -> dict:
        """storage of a traced value -> the storage its counterpart has in the graph being built."""
        out = {}
        for n, c in itertools.chain(zip(traced, copies), state.items()):
            for t, u in zip(_tensors(n.meta.get("val")), _tensors(c.meta.get("val"))):
                out[_storage_key(t)] = u.untyped_storage()
        return out

    def _moved(self, val, storages: dict, own: list[fx.Node] | None):
        """``val`` on the storages of the copy: mapped ones moved, those made by a node of ``own`` fresh (one per
        storage, kept in ``storages``), any other kept."""
        if own is None and not any(_storage_key(t) in storages for t in _tensors(val)):
            return val  # nothing of it moves
        owned = set(own or ())

        def move(t):
            if not isinstance(t, torch.Tensor):
                return t
            key = _storage_key(t)
            if key not in storages:
                if self.owner[key] not in owned:
                    return t if own is None else _fake(t, t.untyped_storage())
                storages[key] = _fresh_storage(t)
            return _fake(t, storages[key])

        return pytree.tree_map(move, val)

    def _stack_renamer(self, traced_layer: int, layer: int) -> Callable[[dict], dict]:
        head = f"{self.path}.{traced_layer}"
        new = f"{self.path}.{layer}"

        def rename(stack: dict) -> dict:
            out = {}
            for key, (p, kind) in stack.items():
                if self._layer_of_path(p) == traced_layer:
                    p2 = new + p[len(head) :]
                    key = key[: -len(p)] + p2 if key.endswith(p) else key
                    p = p2
                out[key] = (p, kind)
            return out

        return rename

    def _emit(self, n: fx.Node, arg: Callable, val, *, renamed: Callable | None = None, keep: bool = True) -> fx.Node:
        """Create ``n``'s copy (arguments through ``arg``, value ``val``) under its op's next export name."""
        args, kwargs = fx.map_arg((n.args, n.kwargs), arg)
        m = NUMBERED.match(n.name)
        node = self.new.create_node(n.op, n.target, args, kwargs, name=m.group(1) if m else n.name, type_expr=n.type)
        node.meta = dict(n.meta)
        node.meta["val"] = val
        if renamed is not None and "nn_module_stack" in n.meta:
            node.meta["nn_module_stack"] = renamed(n.meta["nn_module_stack"])
        if keep:
            self.env[n] = node
        return node
