"""Batch-size reuse: capture once with a symbolic batch dim, specialize to any batch in O(nodes).

``capture_template(model, args, kwargs)`` runs ``torch.export`` once with dim 0 of
every tensor input marked as one shared ``Dim("batch", min=2)`` (size 1 is
specialized by torch, so the example batch must be >= 2).  ``specialize(template,
batch)`` then builds the OpGraph a static capture at that batch builds, without
tracing the model again: it copies the exported graph with

* every SymInt/SymFloat/SymBool node (``sym_size``, ``operator.mul`` ...) evaluated
  at the batch (sympy substitution of the batch symbol) and folded into its users'
  arguments, so ``view(x, [s0, 16, -1])`` reads ``view(x, [8, 16, -1])``;
* every node's ``meta["val"]`` a fake tensor of the concrete sizes, strides and
  storage offset, tensors that shared a storage sharing one again (``saved`` reads
  views and memory layouts from them);
* the scalar checks export recorded (``_assert_scalar``) evaluated: a batch that
  fails one is captured again statically rather than planned wrong;

and hands the copy to the same clean-up as a static capture
(``capture.graph_from_export``).

Where a symbolic trace differs from a static one, the copy takes the static form,
so plans match byte for byte:

* node names: symbolic arithmetic is named ``sym_*`` while tracing
  (``_static_names``), so it does not shift the numbering of aten ops that share
  its name (``operator.mul`` vs ``aten.mul``);
* full slices: indexing ``x[:, ...]`` records ``slice(x, 0, 0, INT64_MAX)`` on a
  symbolic dim where a static trace records nothing (the C++ indexing returns
  ``self``); they are named ``full_slice*`` while tracing and dropped here.  When
  the whole indexing expression returned ``self``, the static trace records
  ``alias(x)`` instead: the copy does the same where neither the slice's input nor
  its users are indexing ops (a heuristic: two back-to-back ``[...]`` on one tensor
  keep no alias, a harmless no-op difference).

A model whose code fixes the batch (export raises, or dim 0 comes out static), or
whose inputs do not share dim 0, gets a template without a symbolic graph: its
``reason`` says why and ``specialize`` captures statically at each batch (logged).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import sys
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _make_graph_module
from torch.utils import _pytree as pytree

from .export import (
    ExportedCall,
    OpGraph,
    canonical_param_names,
    capture,
    export_program,
    graph_from_export,
    lean_export,
    normalize_inputs,
)
from .fake_values import NUMBERED, fake_on, meta_storage

__all__ = [
    "BatchTemplate",
    "batch_of",
    "capture_template",
    "split_microbatches",
    "static_template",
    "specialize",
    "with_batch",
]

log = logging.getLogger(__name__)
aten = torch.ops.aten

_INT64_MAX = sys.maxsize
_FULL_SLICE = "full_slice"  # the trace-time name of a slice that a static trace elides
_SCALAR_CHECKS = (
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten.sym_constrain_range.default,
)
_INDEXING = (aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.index.Tensor)
_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


class _CannotSpecialize(Exception):
    """The symbolic graph does not hold at this batch; the caller captures statically."""


@dataclass(frozen=True, slots=True)
class BatchTemplate:
    """A model captured for re-planning at other batch sizes.

    ``program``: the exported graph with a symbolic batch (never mutated), None when
    the model could not be captured so (``reason`` says why; ``specialize`` then
    captures statically).  ``symbols``: the sympy symbols of the inputs' dim 0;
    ``min_batch``/``max_batch``: the range export proved the graph for.
    """

    model: torch.nn.Module
    args: tuple
    kwargs: dict
    batch: int
    program: fx.GraphModule | None = None
    signature: Any = None
    symbols: tuple = ()
    min_batch: int = 2
    max_batch: int | None = None
    canonical: dict | None = None
    reason: str | None = None
    constants: dict | None = None  # the export's lifted constants (capture.graph_from_export)
    exported: ExportedCall | None = None  # forward's signature and export's input/output trees

    @property
    def symbolic(self) -> bool:
        return self.program is not None


def static_template(model: torch.nn.Module, example_inputs=(), example_kwargs: dict | None = None) -> BatchTemplate:
    """A template without a symbolic graph: ``specialize`` re-captures (prepare without ``reuse_batch``)."""
    args, kwargs = normalize_inputs(model, example_inputs, example_kwargs)
    batch = _common_batch(args, kwargs)
    return BatchTemplate(model, args, kwargs, batch if isinstance(batch, int) else 0, reason="prepared statically")


def capture_template(model: torch.nn.Module, example_inputs=(), example_kwargs: dict | None = None) -> BatchTemplate:
    """Export ``model`` once with dim 0 of every tensor input as one symbolic batch dim."""
    args, kwargs = normalize_inputs(model, example_inputs, example_kwargs)
    batch = _common_batch(args, kwargs)
    if isinstance(batch, str):
        return _fallback(BatchTemplate(model, args, kwargs, 0), batch)
    template = BatchTemplate(model, args, kwargs, batch)
    if batch < 2:
        return _fallback(template, f"example batch {batch}: torch specializes size-1 dims; give an example batch >= 2")
    dim = torch.export.Dim("batch", min=2)
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        return _fallback(template, f"inputs do not bind to forward(): {e}")
    shapes = {name: pytree.tree_map(lambda x: _dim0(x, dim), value) for name, value in bound.arguments.items()}
    try:
        with _static_names():
            ep = export_program(model, args, kwargs, dynamic_shapes=shapes)
    except Exception as e:  # a constraint violation (the code fixes the batch) or any trace failure
        cause = e.__cause__ or e
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        return _fallback(template, f"symbolic export failed ({type(cause).__name__}: {first})")
    symbols = _batch_symbols(ep)
    if isinstance(symbols, str):
        return _fallback(template, symbols)
    lower, upper = 2, None
    for sym in symbols:
        vr = ep.range_constraints.get(sym)
        if vr is not None:
            lower = max(lower, int(vr.lower)) if isinstance(vr.lower, sympy.Integer) else lower
            upper = int(vr.upper) if isinstance(vr.upper, sympy.Integer) else upper
    return BatchTemplate(
        model,
        args,
        kwargs,
        batch,
        ep.graph_module,
        ep.graph_signature,
        symbols,
        lower,
        upper,
        canonical_param_names(model),
        constants=dict(ep.constants),
        exported=ExportedCall.of(model, ep),
    )


def specialize(template: BatchTemplate, batch: int) -> tuple[OpGraph, str | None]:
    """(the OpGraph of ``template``'s model at ``batch``, None) or, when captured again statically, (it, why)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch {batch!r}: expected a positive int, e.g. at_batch(32)")
    reason = template.reason
    if template.program is not None:
        if batch < template.min_batch or (template.max_batch is not None and batch > template.max_batch):
            top = template.max_batch if template.max_batch is not None else "inf"
            reason = f"batch {batch} is outside the range [{template.min_batch}, {top}] the symbolic graph holds for"
        else:
            try:
                gm = _specialize_module(template.program, {s: sympy.Integer(batch) for s in template.symbols})
            except _CannotSpecialize as e:
                reason = str(e)
            else:
                name = type(template.model).__name__
                graph = graph_from_export(
                    gm, template.signature, template.canonical, name, template.constants, template.exported
                )
                return graph, None
    if batch == template.batch:
        return capture(template.model, template.args, template.kwargs), reason
    if template.batch == 0:
        raise ValueError(
            f"{type(template.model).__name__} at batch {batch}: {template.reason}, "
            "so there is no batch dim to resize.\nFix: prepare the model again with inputs of the batch you want."
        )
    log.info("re-capturing %s at batch %d statically: %s", type(template.model).__name__, batch, reason)
    args, kwargs = with_batch(template.args, template.kwargs, batch)
    return capture(template.model, args, kwargs), reason


def with_batch(args: tuple, kwargs: dict, batch: int) -> tuple[tuple, dict]:
    """The inputs with dim 0 of every tensor resized to ``batch`` (rows repeated; meta tensors: new empties)."""

    def resize(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if x.device.type == "meta" or x.shape[0] == 0:
            return x.new_empty((batch, *x.shape[1:]))
        return x[torch.arange(batch) % x.shape[0]]

    return pytree.tree_map(resize, (args, kwargs))


def batch_of(args: tuple, kwargs: dict) -> int | None:
    """The batch of a call: the dim-0 size every tensor input shares, or None when they share none."""
    batch = _common_batch(args, kwargs)
    return None if isinstance(batch, str) else batch


def split_microbatches(args: tuple, kwargs: dict, count: int) -> list[tuple[tuple, dict]]:
    """The call's inputs as ``count`` micro-batches: dim 0 of every tensor input (the batch, which they must
    share) split into equal consecutive chunks; other leaves repeated.  Raises ValueError when the tensors do not
    share dim 0 or ``count`` does not divide it."""
    batch = _common_batch(args, kwargs)
    if isinstance(batch, str):
        raise ValueError(
            f"micro-batches: {batch}; every tensor input must carry the batch in dim 0 to be split into "
            f"{count} micro-batches. Fix: pass inputs batched in dim 0, or microbatches=1"
        )
    if batch % count:
        raise ValueError(
            f"micro-batches: the batch of {batch} does not split into {count} equal micro-batches. Fix: pass "
            f"microbatches= a divisor of {batch} (e.g. {max(d for d in range(1, count + 1) if batch % d == 0)}), "
            "or a batch that is a multiple of it"
        )
    size = batch // count

    def chunk(k: int) -> tuple[tuple, dict]:
        return pytree.tree_map(lambda x: x[k * size : (k + 1) * size] if torch.is_tensor(x) else x, (args, kwargs))

    return [chunk(k) for k in range(count)]


# ---- capture ---------------------------------------------------------------------------------
def _fallback(template: BatchTemplate, reason: str) -> BatchTemplate:
    log.warning(
        "%s: no symbolic batch capture, each batch is captured again: %s", type(template.model).__name__, reason
    )
    return BatchTemplate(template.model, template.args, template.kwargs, template.batch, reason=reason)


def _common_batch(args: tuple, kwargs: dict) -> int | str:
    """The dim-0 size every tensor input shares, or why there is none."""
    sizes = {}
    for path, x in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(x, torch.Tensor):
            sizes[pytree.keystr(path)] = int(x.shape[0]) if x.dim() else None
    if not sizes:
        return "the model takes no tensor inputs"
    if len(set(sizes.values())) != 1 or None in sizes.values():
        listed = ", ".join(f"{k}: {v if v is not None else 'scalar'}" for k, v in sizes.items())
        return f"the tensor inputs do not share a dim-0 size ({listed})"
    return next(iter(sizes.values()))


def _dim0(x, dim):
    return {0: dim} if isinstance(x, torch.Tensor) else None


def _batch_symbols(ep) -> tuple | str:
    """The sympy symbols of the user inputs' dim 0, or why the batch is not symbolic."""
    user = set(ep.graph_signature.user_inputs)
    symbols = set()
    for node in ep.graph_module.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or node.name not in user or not isinstance(val, torch.Tensor) or not val.dim():
            continue
        size = val.shape[0]
        if not isinstance(size, torch.SymInt) or not size.node.expr.free_symbols:
            return f"dim 0 of input {node.name} came out static: the model's code fixes the batch size"
        symbols |= size.node.expr.free_symbols
        symbols |= size.node._expr.free_symbols  # the symbol before the shape env's replacements
    return tuple(sorted(symbols, key=str))


def _is_sym_target(target) -> bool:
    """Targets of SymInt arithmetic in an exported graph (``operator.getitem`` is tuple indexing)."""
    if target is operator.getitem or isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    module = getattr(target, "__module__", None) or ""
    return module in ("_operator", "operator", "math", "builtins") or "sym_" in getattr(target, "__name__", "")


def _is_symbolic_full_slice(target, args) -> bool:
    if target is not aten.slice.Tensor or not args or not isinstance(args[0], fx.Node):
        return False
    dim, start, end, step = (tuple(args[1:]) + (0, 0, None, 1)[len(args) - 1 :])[:4]
    val = args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or start != 0 or step != 1 or end != _INT64_MAX:
        return False
    size = val.shape[dim]
    return isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols)


@contextlib.contextmanager
def _static_names():
    """While tracing, name symbolic arithmetic ``sym_*`` and symbolic full slices ``full_slice*``.

    fx numbers nodes per name (``mul``, ``mul_1`` ...) as it creates them, so a
    SymInt ``operator.mul`` would shift every later ``aten.mul`` one number up
    against a static trace; with names of their own they shift nothing.
    """
    original = fx.Graph.create_node

    def create_node(self, op, target, args=None, kwargs=None, name=None, type_expr=None):
        if op == "call_function":
            if _is_sym_target(target):
                name = "sym_" + (name or self._target_to_str(target))
            elif _is_symbolic_full_slice(target, args):
                name = _FULL_SLICE
        return original(self, op, target, args, kwargs, name, type_expr)

    fx.Graph.create_node = create_node
    try:
        yield
    finally:
        fx.Graph.create_node = original


# ---- specialization ----------------------------------------------------------------------------
class _Values:
    """Concrete values of symbolic ones at one batch: scalars, and fake tensors sharing storage as before."""

    def __init__(self, env: dict) -> None:
        self.env = env
        self.mode = FakeTensorMode()
        self._exprs: dict = {}
        self._storages: dict = {}
        self._tensors: dict[int, torch.Tensor] = {}

    def scalar(self, x):
        if not isinstance(x, _SYM_TYPES):
            return x
        expr = x.node.expr
        hit = self._exprs.get(expr)
        if hit is None:
            value = expr.xreplace(self.env)
            if value.free_symbols:
                raise _CannotSpecialize(
                    f"{expr} depends on more than the batch ({sorted(map(str, value.free_symbols))})"
                )
            if isinstance(x, torch.SymBool):
                hit = bool(value)
            elif isinstance(x, torch.SymFloat):
                hit = float(value)
            else:
                hit = int(value)
            self._exprs[expr] = hit
        return hit

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        hit = self._tensors.get(id(t))
        if hit is not None:
            return hit
        if t.layout is not torch.strided:
            raise _CannotSpecialize(f"a {t.layout} tensor: only strided tensors are specialized")
        storage = t.untyped_storage()
        ref = storage._cdata  # the storage's address: the template keeps it alive (StorageWeakRef is 0.4 ms)
        base = self._storages.get(ref)
        if base is None:
            base = meta_storage(self.scalar(storage.nbytes()))
            self._storages[ref] = base
        size = [self.scalar(s) for s in t.shape]
        stride = [self.scalar(s) for s in t.stride()]
        out = fake_on(t, base, self.scalar(t.storage_offset()), size, stride, self.mode)
        self._tensors[id(t)] = out
        return out

    def value(self, val):
        return pytree.tree_map(lambda x: self.tensor(x) if isinstance(x, torch.Tensor) else self.scalar(x), val)


def _specialize_module(gm: fx.GraphModule, env: dict) -> fx.GraphModule:
    values = _Values(env)
    with lean_export():  # no code generated for the copies: the clean-up recompiles once
        return _specialize_gm(gm, values)


def _specialize_gm(gm: fx.GraphModule, values: _Values) -> fx.GraphModule:
    graph = _specialize_graph(gm.graph, values)
    attrs = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            obj = getattr(gm, node.target)
            attrs[node.target] = _specialize_gm(obj, values) if isinstance(obj, fx.GraphModule) else obj
    out = _make_graph_module(attrs, graph, class_name=type(gm).__name__)  # lazy: no code generated yet
    out.meta.update(gm.meta)
    return out


def _specialize_graph(graph: fx.Graph, values: _Values) -> fx.Graph:
    """A copy of ``graph`` at the batch (see the module docstring)."""
    new = fx.Graph()
    new._codegen = graph._codegen
    env: dict[fx.Node, Any] = {}
    alias_shift, last_alias = 0, -1
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function":
            if node.target in _SCALAR_CHECKS:
                _check_scalar(node, env)
                continue
            if isinstance(val, _SYM_TYPES) or _is_sym_target(node.target):
                env[node] = values.scalar(val)
                continue
            if node.name.startswith(_FULL_SLICE) and node.target is aten.slice.Tensor:
                src = env[node.args[0]]
                producer = node.args[0]
                if _indexing(producer) or any(_indexing(u) for u in node.users):
                    env[node] = src  # part of a longer indexing expression: the static trace records nothing
                    continue
                last_alias += 1
                alias_shift += 1
                copy = new.create_node("call_function", aten.alias.default, (src,), name=_numbered("alias", last_alias))
                copy.meta = dict(node.meta)
                with values.mode:
                    copy.meta["val"] = aten.alias.default(src.meta["val"])
                env[node] = copy
                continue
        if node.op == "call_function" and node.target is aten.alias.default:  # renumbered after inserted aliases
            last_alias = _number(node.name) + alias_shift
            args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: env[n])
            copy = new.create_node(node.op, node.target, args, kwargs, _numbered("alias", last_alias), node.type)
            copy.meta = dict(node.meta)
        else:
            copy = new.node_copy(node, lambda n: env[n])
        if val is not None:
            copy.meta["val"] = values.value(val)
        copy.meta.pop("unbacked_bindings", None)
        copy.meta.pop("tensor_meta", None)
        env[node] = copy
    old, ns = graph._graph_namespace, new._graph_namespace
    ns._used_names |= old._used_names
    for base, count in old._base_count.items():
        ns._base_count[base] = max(ns._base_count.get(base, 0), count)
    if alias_shift:
        ns._base_count["alias"] = max(ns._base_count.get("alias", 0), old._base_count.get("alias", 0) + alias_shift)
    return new


def _check_scalar(node: fx.Node, env: dict) -> None:
    if node.target is not aten._assert_scalar.default:
        return
    cond = env.get(node.args[0], node.args[0]) if isinstance(node.args[0], fx.Node) else node.args[0]
    if cond is False:
        msg = node.args[1] if len(node.args) > 1 else node.format_node()
        raise _CannotSpecialize(f"the model's check {msg!r} fails at this batch")


def _indexing(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _INDEXING


def _number(name: str) -> int:
    m = NUMBERED.match(name)
    return int(m.group(2)) if m else 0


def _numbered(base: str, k: int) -> str:
    return base if k == 0 else f"{base}_{k}"
