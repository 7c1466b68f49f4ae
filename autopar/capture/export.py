"""Capture: trace a model with torch.export into an ``OpGraph``.

``capture(model, example_inputs)`` runs ``torch.export.export`` (non-strict,
training IR, the model in train mode so dropout is kept) on real, meta or fake
tensors, then cleans the graph for planning:

* higher-order ops that only switch grad mode (``wrap_with_set_grad_enabled``,
  e.g. Llama's rotary embedding) are inlined, their nodes marked grad-free;
* ``_assert_tensor_metadata`` checks are dropped;
* ``cross_entropy_loss`` is decomposed (``autopar.capture.decompose``) so the
  vocab-parallel cross-entropy falls out of the generic rules;
* tied parameters (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are
  one parameter under the first name ``model.named_parameters()`` gives.

Every ``OpNode`` carries TensorMeta for its outputs, its module path (from
``nn_module_stack``) and, for parameters and buffers, the original FQN.

Calls: the example ``(args, kwargs)`` are bound to ``forward``'s signature first
(``call_spec.bind_call``: defaults dropped, one canonical form), and the graph keeps
the input and output trees torch.export recorded (``OpGraph.call``, a
``call_spec.CallSpec``), so the compiled module takes and returns what the model
does.

``capture`` is ``export_program`` then ``graph_from_export``; ``autopar.capture.batch``
exports once with a symbolic batch and hands ``graph_from_export`` a copy of that
graph at each concrete batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopar.spec import TensorMeta

from .call_spec import (
    CallSpec,
    InputLeaf,
    OutputLeaf,
    bind_call,
    forward_signature,
    register_dataclasses,
    render_input_path,
)
from .decompose import decompose_for_planning
from .graph import OpCall, OpGraph, OpNode
from .hf_masks import eager_attention_masks
from .stamp import Traced, export_stamped

__all__ = [
    "OpNode",
    "OpGraph",
    "ExportedCall",
    "capture",
    "CaptureError",
    "export_program",
    "graph_from_export",
    "graph_of_trace",
    "normalize_inputs",
]

log = logging.getLogger(__name__)

_GRAD_MODE_HOPS = ("wrap_with_set_grad_enabled",)


class CaptureError(ValueError):
    """torch.export could not trace the model; the message says why and what to try."""


@dataclass(frozen=True)
class ExportedCall:
    """What ``graph_from_export`` needs of a call besides the graph: forward's signature and export's trees."""

    signature: Any
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec

    @classmethod
    def of(cls, model: torch.nn.Module, ep) -> ExportedCall:
        return cls(forward_signature(model), ep.call_spec.in_spec, ep.call_spec.out_spec)


def capture(model: torch.nn.Module, example_inputs: tuple = (), example_kwargs: dict | None = None) -> OpGraph:
    """Trace ``model(*example_inputs, **example_kwargs)`` and build its OpGraph.

    A deep model is traced at four layers and stamped to its depth where ``capture.stamp``'s checks hold (the
    graph a full trace gives, in a fraction of its time); else the whole model is traced."""
    args, kwargs = normalize_inputs(model, example_inputs, example_kwargs)
    traced = export_stamped(model, args, kwargs, export_program) or Traced.of(export_program(model, args, kwargs))
    return graph_of_trace(model, traced)


def graph_of_trace(model: torch.nn.Module, traced: Traced) -> OpGraph:
    """The OpGraph of ``traced``, a trace of ``model`` (cleaned in place: ``graph_from_export``)."""
    return graph_from_export(
        traced.gm,
        traced.signature,
        canonical_param_names(model),
        type(model).__name__,
        traced.constants,
        ExportedCall(forward_signature(model), traced.in_spec, traced.out_spec),
    )


def normalize_inputs(model: torch.nn.Module, example_inputs, example_kwargs: dict | None) -> tuple[tuple, dict]:
    """The canonical ``(args, kwargs)`` of calling ``model`` so (``call_spec.bind_call``), as export takes them.

    ``example_inputs`` is a tuple or list of positional inputs, or one input; a
    dataclass anywhere in them is registered with pytree.
    """
    kwargs = dict(example_kwargs or {})
    if example_inputs is None:
        args = ()
    else:
        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    register_dataclasses((args, kwargs))
    return bind_call(forward_signature(model), args, kwargs, model_name=type(model).__name__)


def export_program(model: torch.nn.Module, args: tuple, kwargs: dict, *, dynamic_shapes=None):
    """``torch.export.export`` (non-strict, the model in train mode); CaptureError says what to try."""
    name = type(model).__name__
    was_training = model.training
    model.train()
    # outputs are flattened after forward returns: register the dataclasses it returns before that
    hook = model.register_forward_hook(lambda _module, _args, out: register_dataclasses(out))
    try:
        with lean_export(), _without_kv_cache(model), eager_attention_masks(model, args, kwargs):
            return torch.export.export(model, args, kwargs=kwargs, strict=False, dynamic_shapes=dynamic_shapes)
    except Exception as e:  # export raises many types; all mean "could not trace"
        raise CaptureError(
            f"autopar could not trace {name} with torch.export (non-strict): {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}\n"
            "  - check that example_inputs match forward()'s signature (args vs kwargs) and shapes;\n"
            "  - inputs and outputs may nest tuples, lists, dicts, dataclasses and ModelOutputs of tensors, and hold "
            "int, float, bool, str or None; any other class must be registered with "
            "torch.utils._pytree.register_pytree_node;\n"
            "  - Hugging Face models: pass input_ids (and labels for a loss), not use_cache=True or past_key_values;\n"
            "  - data-dependent Python control flow must be static for the example inputs.\n"
            "Fix the model or inputs, or pass a smaller reproduction to torch.export.export to see the full trace."
        ) from e
    finally:
        hook.remove()
        model.train(was_training)


def graph_from_export(
    gm: fx.GraphModule,
    sig,
    canonical: dict[str, str],
    model_name: str,
    constants: dict | None,
    exported: ExportedCall,
) -> OpGraph:
    """Clean an exported graph for planning (in place: see the module docstring) and build its OpGraph.

    ``sig`` is the export's graph signature, ``canonical`` maps every parameter FQN to
    its canonical one (``canonical_param_names``), ``constants`` is the export's lifted
    constants (``ExportedProgram.constants``; the tensors are kept in ``OpGraph.constants``),
    ``exported`` the call's signature and trees (``OpGraph.call``).
    """
    param_of = {spec.arg.name: spec.target for spec in sig.input_specs if spec.kind.name == "PARAMETER"}
    buffer_of = {
        spec.arg.name: spec.target for spec in sig.input_specs if spec.kind.name in ("BUFFER", "CONSTANT_TENSOR")
    }
    no_grad_nodes = _inline_grad_mode_hops(gm)
    _drop_asserts(gm)
    decompose_for_planning(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    tied = {alias: canon for alias, canon in canonical.items() if alias != canon}
    graph, output_leaves = _build(
        gm, model_name, param_of, buffer_of, canonical, tied, no_grad_nodes, list(sig.user_inputs)
    )
    lifted = {spec.target for spec in sig.input_specs if spec.kind.name == "CONSTANT_TENSOR"}
    return dataclasses.replace(
        graph,
        constants={k: v for k, v in (constants or {}).items() if k in lifted and isinstance(v, torch.Tensor)},
        call=_call_spec(graph, sig, exported, output_leaves),
    )


def _call_spec(graph: OpGraph, sig, exported: ExportedCall, output_leaves: list) -> CallSpec:
    """The graph's ``CallSpec``: one ``InputLeaf`` per user input of the export, one ``OutputLeaf`` per output."""
    user = [spec.arg for spec in sig.input_specs if spec.kind.name == "USER_INPUT"]
    paths = [render_input_path(exported.signature, _plain_keys(kp)) for kp, _ in _leaf_paths(exported.in_spec)]
    if len(paths) != len(user):
        raise AssertionError(f"export recorded {len(user)} user inputs for an input tree of {len(paths)} leaves")
    inputs = tuple(
        InputLeaf(path, arg.name, None) if type(arg).__name__ == "TensorArgument" else InputLeaf(path, None, arg.value)
        for path, arg in zip(paths, user)
    )
    out_paths = ["output" + pytree.keystr(kp) for kp, _ in _leaf_paths(exported.out_spec)]
    if len(out_paths) != len(output_leaves):
        raise AssertionError(
            f"export recorded an output tree of {len(out_paths)} leaves, the graph returns {len(output_leaves)}"
        )
    outputs = tuple(
        OutputLeaf(path, leaf, None) if isinstance(leaf, int) else OutputLeaf(path, None, leaf.value)
        for path, leaf in zip(out_paths, output_leaves)
    )
    return CallSpec(graph.model_name, exported.signature, exported.in_spec, inputs, exported.out_spec, outputs)


def _leaf_paths(spec: pytree.TreeSpec) -> list:
    """(key path, placeholder) per leaf of ``spec``, in flattening order.

    The placeholders are distinct objects, not None: a ``ModelOutput`` drops None fields when flattened.
    """
    return pytree.tree_flatten_with_path(pytree.tree_unflatten([object() for _ in range(spec.num_leaves)], spec))[0]


def _plain_keys(key_path: tuple) -> tuple:
    """Pytree keys as plain ints/strings where they index (``SequenceKey(0)`` -> 0), attribute keys kept."""
    out = []
    for k in key_path:
        if isinstance(k, pytree.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, pytree.MappingKey):
            out.append(k.key)
        else:
            out.append(k)
    return tuple(out)


@contextlib.contextmanager
def lean_export():
    """Export without work planning never uses: each node's Python stack trace (extracting and
    symbolizing one per traced op is about a quarter of a deep model's export) and the Python
    code of the intermediate graph modules export's passes build (lazy graph modules generate
    it on first use; only the final module's is built).  The graph is the same."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # a torch without lazy graph modules: eager code generation
        lazy = contextlib.nullcontext()
    else:
        lazy = _use_lazy_graph_module(True)
    config = getattr(fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):  # torch < 2.12 has no such switch
        with lazy:
            yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        with lazy:
            yield
    finally:
        config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _without_kv_cache(model: torch.nn.Module):
    """Trace with every Hugging Face ``config.use_cache`` turned off, then restore them.

    A training step has no use for a key/value cache: it is inference state, and
    Hugging Face decoders build one by default (``use_cache=True`` in most configs),
    returning a cache object torch.export cannot flatten.  The compiled module
    therefore never returns a cache, whatever the config says; an explicit
    ``use_cache=True`` in the example kwargs still wins (and fails to trace, with
    ``CaptureError`` saying so).
    """
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
    if configs:
        log.info("tracing %s with use_cache=False: a training step keeps no key/value cache", type(model).__name__)
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def canonical_param_names(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter FQN (tied aliases included) -> the first FQN of the same tensor."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        out[fqn] = first.setdefault(id(p), fqn)
    return out


def _inline_grad_mode_hops(gm: fx.GraphModule) -> set[str]:
    """Inline grad-mode higher-order ops; return names of nodes that must carry no grad."""
    no_grad: set[str] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or getattr(node.target, "__name__", "") not in _GRAD_MODE_HOPS:
            continue
        enabled, sub_ref, *operands = node.args
        sub = getattr(gm, sub_ref.target)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        val_map = dict(zip(placeholders, operands))
        with gm.graph.inserting_before(node):
            out = gm.graph.graph_copy(sub.graph, val_map)
        copied = [v for k, v in val_map.items() if k.op not in ("placeholder", "output")]
        if not enabled:
            no_grad.update(n.name for n in copied)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not sub_ref.users:
            gm.graph.erase_node(sub_ref)
    return no_grad


def _drop_asserts(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and "assert" in str(node.target) and not node.users:
            gm.graph.erase_node(node)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _tensor_vals(val) -> list:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _build(gm, model_name, param_of, buffer_of, canonical, tied, no_grad_nodes, user_inputs):
    """(the OpGraph, one entry per output leaf: an index into its ``outputs`` or a ``_Constant``)."""
    builder = _GraphBuilder(param_of, buffer_of, canonical, no_grad_nodes)
    for fxn in gm.graph.nodes:
        builder.add(fxn)
    outputs, output_leaves, loss_output = builder.outputs(next(n for n in gm.graph.nodes if n.op == "output"))
    graph = OpGraph(builder.nodes, outputs, loss_output, gm, model_name, tied, user_inputs, builder.aliases)
    return graph, output_leaves


class _GraphBuilder:
    """The ``OpNode`` list of a cleaned exported graph, built one fx node at a time, in graph order.

    ``param_of`` / ``buffer_of``: placeholder name -> parameter / buffer FQN; ``canonical``:
    parameter FQN -> its canonical one (a tied alias's placeholder becomes the canonical
    parameter's node, noted in ``aliases``); ``no_grad_nodes``: nodes that carry no gradient.
    """

    def __init__(self, param_of: dict, buffer_of: dict, canonical: dict[str, str], no_grad_nodes: set[str]) -> None:
        self.param_of, self.buffer_of, self.canonical = param_of, buffer_of, canonical
        self.no_grad_nodes = no_grad_nodes
        self.nodes: list[OpNode] = []
        self.where: dict[fx.Node, int] = {}  # fx node -> OpNode index (single-output or multi-output op)
        self.proj: dict[fx.Node, tuple[int, int]] = {}  # getitem node -> (producer, output index)
        self.param_index: dict[str, int] = {}
        self.aliases: dict[str, int] = {}

    def add(self, fxn: fx.Node) -> None:
        """The node for ``fxn`` (a tensor placeholder, or a call with tensor outputs); a getitem of a multi-output
        op is noted as a projection of it; anything else is skipped."""
        val = fxn.meta.get("val")
        if fxn.op == "placeholder":
            if isinstance(val, torch.Tensor):
                self._add_source(fxn, (TensorMeta.of(val),))
            return
        if fxn.op != "call_function":
            return
        where = self.where
        if fxn.target is operator.getitem and fxn.args[0] in where and self.nodes[where[fxn.args[0]]].kind == "op":
            self.proj[fxn] = (where[fxn.args[0]], int(fxn.args[1]))
            return
        outs = _tensor_vals(val)
        if outs:
            self._add_op(fxn, tuple(TensorMeta.of(t) for t in outs))

    def _add_source(self, fxn: fx.Node, meta: tuple[TensorMeta, ...]) -> None:
        nodes = self.nodes
        if fxn.name in self.param_of:
            fqn = self.canonical.get(self.param_of[fxn.name], self.param_of[fxn.name])
            if fqn in self.param_index:  # a tied alias placeholder: reuse the canonical node
                self.where[fxn] = self.param_index[fqn]
                self.aliases[fxn.name] = self.param_index[fqn]
                return
            node = OpNode(len(nodes), fxn.name, "param", meta, fqn=fqn, requires_grad=True, fx_node=fxn)
            self.param_index[fqn] = node.index
        elif fxn.name in self.buffer_of:
            node = OpNode(len(nodes), fxn.name, "buffer", meta, fqn=self.buffer_of[fxn.name], fx_node=fxn)
        else:
            node = OpNode(len(nodes), fxn.name, "input", meta, fqn=fxn.name, fx_node=fxn)
        self.where[fxn] = node.index
        nodes.append(node)

    def _add_op(self, fxn: fx.Node, out_metas: tuple[TensorMeta, ...]) -> None:
        nodes = self.nodes
        flat, spec = pytree.tree_flatten((fxn.args, fxn.kwargs))
        in_refs: list[tuple[int, int]] = []
        metas: list[TensorMeta] = []
        new_flat = []
        for a in flat:
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                ref = self.proj.get(a) or (self.where[a], 0)
                in_refs.append(ref)
                m = nodes[ref[0]].outputs[ref[1]]
                metas.append(m)
                new_flat.append(m)
            else:
                new_flat.append(a)
        args, kwargs = pytree.tree_unflatten(new_flat, spec)
        call = OpCall(fxn.target, tuple(args), dict(kwargs), tuple(metas), out_metas)
        differentiable = any(m.is_float for m in out_metas) and fxn.name not in self.no_grad_nodes
        grad = (
            differentiable
            and "detach" not in str(fxn.target)
            and any(nodes[s].requires_grad and nodes[s].outputs[i].is_float for s, i in in_refs)
        )
        node = OpNode(
            len(nodes),
            fxn.name,
            "op",
            out_metas,
            tuple(in_refs),
            call,
            _module_path(fxn),
            requires_grad=grad,
            fx_node=fxn,
        )
        self.where[fxn] = node.index
        nodes.append(node)

    def outputs(self, out_node: fx.Node) -> tuple[list[tuple[int, int]], list, int | None]:
        """(the graph's tensor outputs as (node, output index), one entry per output leaf, the loss's output):
        the loss is the first scalar float output that requires grad."""
        outputs: list[tuple[int, int]] = []
        output_leaves: list[int | _Constant] = []
        loss_output = None
        for o in out_node.args[0]:
            if isinstance(o, fx.Node) and (o in self.where or o in self.proj):
                ref = self.proj.get(o) or (self.where[o], 0)
                meta = self.nodes[ref[0]].outputs[ref[1]]
                if loss_output is None and meta.numel == 1 and meta.is_float and self.nodes[ref[0]].requires_grad:
                    loss_output = len(outputs)
                output_leaves.append(len(outputs))
                outputs.append(ref)
            else:  # a constant export kept in the output (an int, None), or a non-tensor input passed through
                output_leaves.append(_Constant(o.meta.get("val") if isinstance(o, fx.Node) else o))
        return outputs, output_leaves, loss_output


@dataclass(frozen=True)
class _Constant:
    """A graph output that is no tensor: its value."""

    value: Any
