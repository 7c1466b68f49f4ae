"""Semi-auto mode: user shard hints, matched to the captured graph, checked, and turned into a restriction.

Hints fix part of the plan; the search chooses everything else, including the
collectives the hints make necessary.  ``hints={pattern: value}`` (``fnmatch``
patterns; ``*`` also crosses dots), by the kind of ``value``:

* **parameter** (``"*.mlp.c_fc.weight": ["R", "S(1)"]``): the pattern is matched
  against parameter FQNs, tied aliases included (``lm_head.weight`` resolves to
  ``transformer.wte.weight``); the value is the parameter's *storage* placement.
  Its consumers still read it however the search finds fastest (a read in
  another placement is a collective the plan shows); its gradient and optimizer
  state may be sharded further (ZeRO) unless the runtime forbids it.
* **region** (``"transformer.h.*": "replicate"``): every op whose module path (or
  an ancestor of it) matches, and every parameter of such a module, stays all-R
  (state included): the region is excluded from partitioning.
* **recompute** (``"transformer.h.*": "recompute"``, ``"model.layers.1?"``: the
  repeated blocks (layers) whose name or one of whose ops' modules matches are
  recomputed in backward whatever ``recompute=`` says; the planner checks that the
  pattern names whole layers (``planner.recompute_tables``).
* **op-level** (``"encoder.layer.0.intermediate.dense": ((2, 1), (1, 4))``): the
  module's one matmul (``nn.Linear``'s ``linear``, GPT-2 ``Conv1D``'s ``addmm``)
  reads its activation input and its weight in the given specs, and the weight
  is stored in its spec.  Operands as MindSpore factor tuples, ``Layout`` results
  or placement lists (``autopar.planner.hint_forms`` states the conventions).

Also: ``autopar.shard(x, placements)`` in model code (``autopar.shard_op``) fixes
an activation; ``input_placements`` (per user input, by name or in order) and
``output_placements`` (per graph output, a list or {index: placements}) fix those.

Checks, each a ``ValueError`` naming the hint, the tensor and its shape, the mesh,
and the fix: the value's form and every axis name (``hint_forms``); that the
tensor can be laid out (``hint_forms.fit_problem``); that two hints never give
one tensor different specs; that the hints leave every node a strategy
(``ResolvedHints.allowed``).  A pattern that matches nothing warns, or raises
with ``strict=True``.

``resolve_hints`` returns ``ResolvedHints``: the fixed placements by graph node,
``allowed(cand)`` (the restriction the planner hands to
``planner.problem_tables.to_problem``) and ``record`` (the normalized hints the plan JSON
stores, so the tuple, Layout and placement forms of one hint give the same bytes).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.capture import OpGraph, OpNode
from autopar.mesh import Mesh
from autopar.placement import Placement, Replicate, format_placements
from autopar.shard_op import SHARD_OP
from autopar.strategies import SourceStrategy

from .hint_forms import HintProblem, Layout, LayoutSpec, fit_problem, operand_placements, parse_hint_placements

__all__ = ["Layout", "LayoutSpec", "ResolvedHints", "resolve_hints", "parse_hint_placements", "UnmatchedHintError"]


class UnmatchedHintError(ValueError):
    """A hint pattern matched nothing under ``strict=True``.

    ``problem`` says which hint and what it could have matched; the message adds the
    fix in the API's words (``strict=False``), so a front end such as the CLI can give
    the fix in its own (``--strict-hints``).
    """

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem}. Fix: correct the pattern, or pass strict=False to only warn.")
        self.problem = problem

    def __reduce__(self):  # pickles (to another rank) as it was built, not from the full message
        return type(self), (self.problem,)


aten = torch.ops.aten

# matmul-like ops an op-level hint can name: target -> (weight's contracted dim, weight's output dim)
_MATMULS = {
    aten.linear.default: (1, 0),
    aten.addmm.default: (0, 1),
    aten.mm.default: (0, 1),
    aten.matmul.default: (0, 1),
}
_MAX_LISTED = 4


# ---- resolution ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResolvedHints:
    """Fixed placements by graph node (see ``resolve_hints``).

    ``sources``: param/input node -> placement; ``state_replicated``: params whose
    state is R too (regions); ``op_inputs``/``op_outputs``: (node, position) -> spec;
    ``labels``: node -> the hints that touch it (for messages); ``record``: the
    normalized hints for the plan JSON (``params``: every parameter placement a
    hint gave, ``inputs``, ``ops``: op inputs/outputs fixed by op-level hints,
    ``output_placements`` and ``autopar.shard``, ``replicate``: region patterns,
    ``recompute``: the patterns of recompute hints, also in ``recompute``).
    """

    sources: Mapping[int, tuple[Placement, ...]] = field(default_factory=dict)
    state_replicated: frozenset[int] = frozenset()
    op_inputs: Mapping[tuple[int, int], tuple[Placement, ...]] = field(default_factory=dict)
    op_outputs: Mapping[tuple[int, int], tuple[Placement, ...]] = field(default_factory=dict)
    labels: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    record: Mapping[str, Any] = field(default_factory=dict)
    mesh: Mesh | None = None
    recompute: tuple[str, ...] = ()  # module patterns whose layers are recomputed (planner.recompute_tables)

    def missing_sources(self, cand) -> dict[int, tuple[Placement, ...]]:
        """Source nodes whose hinted placement is not among their candidates (the planner adds it)."""
        return {i: pl for i, pl in self.sources.items() if not any(s.placement == pl for s in cand.strategies[i])}

    def allowed(self, cand) -> dict[int, frozenset[int]]:
        """node -> the strategy indices that keep every hint; ValueError when a node keeps none."""
        ins: dict[int, dict[int, tuple]] = {}
        outs: dict[int, dict[int, tuple]] = {}
        for (i, pos), pl in self.op_inputs.items():
            ins.setdefault(i, {})[pos] = pl
        for (i, o), pl in self.op_outputs.items():
            outs.setdefault(i, {})[o] = pl
        full = tuple(Replicate() for _ in cand.mesh_shape)
        result: dict[int, frozenset[int]] = {}
        for i in sorted(set(self.sources) | set(ins) | set(outs)):
            keep = []
            for s, st in enumerate(cand.strategies[i]):
                if isinstance(st, SourceStrategy):
                    ok = st.placement == self.sources[i] and (i not in self.state_replicated or st.state == full)
                else:
                    ok = all(st.inputs[p] == pl for p, pl in ins.get(i, {}).items()) and all(
                        st.outputs[o] == pl for o, pl in outs.get(i, {}).items()
                    )
                if ok:
                    keep.append(s)
            if not keep:
                raise _no_strategy(cand, i, ins.get(i, {}), outs.get(i, {}), self.labels.get(i, ()), self.mesh)
            result[i] = frozenset(keep)
        return result


def _no_strategy(cand, i, ins, outs, labels, mesh) -> ValueError:
    node: OpNode = cand.graph.nodes[i]
    asked = ", ".join(
        [f"input {p} {_fmt(pl)}" for p, pl in sorted(ins.items())]
        + [f"output {o} {_fmt(pl)}" for o, pl in sorted(outs.items())]
    )
    offered = "; ".join(s.label() for s in cand.strategies[i][:_MAX_LISTED])
    return ValueError(
        f"hints {', '.join(labels)} together leave node {node.name} ({node.target}, module {node.module or '<top>'}) "
        f"with no strategy on {mesh}:\n"
        f"  - it is asked for {asked} (tensors {[m.shape for m in node.call.inputs]} -> "
        f"{[m.shape for m in node.outputs]});\n"
        f"  - its rule offers e.g. {offered}.\n"
        "Fix: hint placements this op can run in together (e.g. a column-parallel matmul reads its input R and "
        "its weight split on output features), or drop one of the hints."
    )


def _fmt(pl) -> str:
    return "[" + ", ".join(format_placements(pl)) + "]"


class _Builder:
    """Collects fixed placements, checking shapes and contradictions as they come."""

    def __init__(self, graph: OpGraph, mesh: Mesh) -> None:
        self.graph, self.mesh = graph, mesh
        self.sources: dict[int, tuple] = {}
        self.state_replicated: set[int] = set()
        self.op_inputs: dict[tuple[int, int], tuple] = {}
        self.op_outputs: dict[tuple[int, int], tuple] = {}
        self.origin: dict[tuple, str] = {}
        self.labels: dict[int, list[str]] = {}
        self.record: dict[str, dict] = {"params": {}, "inputs": {}, "ops": {}}

    def error(self, label: str, tensors: list[str], problem: HintProblem) -> ValueError:
        lines = [f"hint {label} cannot hold on {self.mesh}:"]
        lines += [f"  - {t}: {problem.reason}" for t in tensors[:_MAX_LISTED]]
        if len(tensors) > _MAX_LISTED:
            lines.append(f"  - ... and {len(tensors) - _MAX_LISTED} more tensors")
        lines.append(f"Fix: {problem.fix}.")
        return ValueError("\n".join(lines))

    def fix(self, key: tuple, pl: tuple, label: str, tensor: str, shape) -> None:
        """Fix one tensor position (``key``: ("src", i) | ("in", i, pos) | ("out", i, o)) to ``pl``.

        ``tensor`` describes it for messages (its name and shape); ``shape`` is its global shape.
        """
        kind, i = key[0], key[1]
        problem = fit_problem(tuple(shape), pl, self.mesh, source=kind == "src")
        if problem is not None:
            raise self.error(label, [tensor], problem)
        table = {"src": self.sources, "in": self.op_inputs, "out": self.op_outputs}[kind]
        k = i if kind == "src" else key[1:]
        if k in table and table[k] != pl:
            raise ValueError(
                f"hints {self.origin[key]} and {label} contradict on {self.mesh}:\n"
                f"  - {tensor}: {_fmt(table[k])} vs {_fmt(pl)}.\n"
                "Fix: make the patterns match disjoint tensors, or give both the same placements."
            )
        table[k] = pl
        self.origin.setdefault(key, label)
        self.labels.setdefault(i, [])
        if label not in self.labels[i]:
            self.labels[i].append(label)

    def parse(self, label: str, value: Any, tensors: list[str]) -> tuple[Placement, ...]:
        try:
            return parse_hint_placements(value, self.mesh)
        except HintProblem as p:
            raise self.error(label, tensors, p) from None


def resolve_hints(
    graph: OpGraph,
    mesh: Mesh,
    hints: Mapping[str, Any] | None = None,
    *,
    input_placements: Mapping[str, Any] | Sequence[Any] | None = None,
    output_placements: Mapping[int, Any] | Sequence[Any] | None = None,
    strict: bool = False,
) -> ResolvedHints:
    """Match every hint to the graph, check it, and return the fixed placements (module docstring)."""
    b = _Builder(graph, mesh)
    unmatched: list[tuple[str, str]] = []
    regions: list[tuple[str, str]] = []
    recompute: list[str] = []
    for pattern, value in (hints or {}).items():
        if not isinstance(pattern, str):
            raise TypeError(f"hint key {pattern!r}: expected a str pattern over parameter FQNs or module paths")
        label = f"{pattern!r} = {_shown(value)}"
        kind = _kind(value)
        if kind == "recompute":
            if any(n.kind == "op" and module_matches(n.module, pattern) for n in graph.nodes):
                recompute.append(pattern)
            else:
                unmatched.append((label, "module"))
        elif kind == "region":
            regions.append((pattern, label))
        elif kind == "op":
            if not _op_hint(b, pattern, value, label):
                unmatched.append((label, "module running one matmul with a weight parameter"))
        elif not _param_hint(b, pattern, value, label):
            unmatched.append((label, "parameter"))
    for pattern, label in regions:
        if _region_hint(b, pattern, label):
            b.record.setdefault("replicate", []).append(pattern)
        else:
            unmatched.append((label, "module"))
    _shard_nodes(b)
    _io_hints(b, input_placements, output_placements)
    for label, what in unmatched:
        _unmatched(graph, label, what, strict)
    if recompute:
        b.record["recompute"] = sorted(recompute)
    record = {k: v for k, v in b.record.items() if v}
    if "replicate" in record:
        record["replicate"] = sorted(record["replicate"])
    return ResolvedHints(
        b.sources,
        frozenset(b.state_replicated),
        b.op_inputs,
        b.op_outputs,
        {i: tuple(v) for i, v in b.labels.items()},
        record,
        mesh,
        tuple(sorted(recompute)),
    )


def _shown(value) -> str:
    """A hint's value as messages show it: placements as written on the CLI (``R,S(1)``), other forms as Python."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return ",".join(value)
    return repr(value)


def _kind(value) -> str:
    if isinstance(value, str) and value.strip().lower() == "replicate":
        return "region"
    if isinstance(value, str) and value.strip().lower() == "recompute":
        return "recompute"
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_operand(v) for v in value):
        return "op"
    return "param"


def _is_operand(v) -> bool:
    return isinstance(v, LayoutSpec) or (isinstance(v, (tuple, list)) and not isinstance(v, str))


def _param_fqns(graph: OpGraph) -> dict[str, int]:
    """Every parameter FQN, tied aliases included -> its (canonical) node index."""
    index = {n.fqn: n.index for n in graph.params()}
    return {**index, **{alias: index[canon] for alias, canon in graph.tied.items() if canon in index}}


def _param_hint(b: _Builder, pattern: str, value, label: str) -> bool:
    fqns = _param_fqns(b.graph)
    nodes = sorted({i for fqn, i in fqns.items() if fnmatch.fnmatchcase(fqn, pattern)})
    if not nodes:
        b.parse(label, value, ["(no parameter matches)"])  # still report a malformed value
        return False
    described = [_describe_param(b.graph.nodes[i]) for i in nodes]
    pl = b.parse(label, value, described)
    for i, desc in zip(nodes, described):
        node = b.graph.nodes[i]
        b.fix(("src", i), pl, label, desc, node.outputs[0].shape)
        b.record["params"][node.fqn] = format_placements(pl)
    return True


def _describe_param(node: OpNode) -> str:
    return f"parameter {node.fqn}, shape {node.outputs[0].shape}"


def _ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[: k + 1]) for k in range(len(parts))]


def module_matches(module: str, pattern: str) -> bool:
    """Whether ``module`` or one of its ancestors matches ``pattern``."""
    return any(fnmatch.fnmatchcase(m, pattern) for m in _ancestors(module))


def _region_hint(b: _Builder, pattern: str, label: str) -> bool:
    full = tuple(Replicate() for _ in b.mesh.shape)
    found = False
    for fqn, i in sorted(_param_fqns(b.graph).items()):
        if module_matches(fqn.rpartition(".")[0], pattern):
            node = b.graph.nodes[i]
            b.fix(("src", i), full, label, _describe_param(node), node.outputs[0].shape)
            b.state_replicated.add(i)
            b.record["params"][node.fqn] = format_placements(full)
            found = True
    for node in b.graph.nodes:
        if node.kind == "op" and module_matches(node.module, pattern):
            for pos, m in enumerate(node.call.inputs):
                b.fix(
                    ("in", node.index, pos),
                    full,
                    label,
                    f"input {pos} of {_describe_op(node)}, shape {m.shape}",
                    m.shape,
                )
            for o, m in enumerate(node.outputs):
                b.fix(
                    ("out", node.index, o), full, label, f"output {o} of {_describe_op(node)}, shape {m.shape}", m.shape
                )
            found = True
    return found


def _describe_op(node: OpNode) -> str:
    return f"node {node.name} ({node.target}, module {node.module or '<top>'})"


def _module_matmuls(graph: OpGraph) -> dict[str, list[tuple[OpNode, int, int]]]:
    """module path -> its matmul nodes with a 2-D weight parameter: (node, activation pos, weight pos)."""
    out: dict[str, list] = {}
    for node in graph.nodes:
        if node.kind != "op" or node.target not in _MATMULS or not node.module:
            continue
        w = [
            p
            for p, (u, _) in enumerate(node.inputs)
            if graph.nodes[u].kind == "param" and node.call.inputs[p].ndim == 2
        ]
        x = [p for p, (u, _) in enumerate(node.inputs) if graph.nodes[u].kind != "param"]
        if len(w) == 1 and x:
            out.setdefault(node.module, []).append((node, x[0], w[0]))
    return out


def _op_hint(b: _Builder, pattern: str, value, label: str) -> bool:
    matmuls = _module_matmuls(b.graph)
    modules = sorted(m for m in matmuls if fnmatch.fnmatchcase(m, pattern))
    for module in modules:
        if len(matmuls[module]) != 1:
            raise ValueError(
                f"hint {label}: module {module} runs {len(matmuls[module])} matmuls "
                f"({', '.join(n.name for n, _, _ in matmuls[module])}); an op-level hint names a module with one.\n"
                "Fix: hint its weight parameters by name instead."
            )
        node, xp, wp = matmuls[module][0]
        x_meta, w_meta = node.call.inputs[xp], node.call.inputs[wp]
        w_node = b.graph.nodes[node.inputs[wp][0]]
        tensors = [f"activation input of {_describe_op(node)}, shape {x_meta.shape}", _describe_param(w_node)]
        try:
            x_pl, w_pl = operand_placements(value, b.mesh, x_meta.ndim, _MATMULS[node.target])
        except HintProblem as p:
            raise b.error(label, tensors, p) from None
        b.fix(("in", node.index, xp), x_pl, label, tensors[0], x_meta.shape)
        b.fix(
            ("in", node.index, wp),
            w_pl,
            label,
            f"weight input of {_describe_op(node)}, shape {w_meta.shape}",
            w_meta.shape,
        )
        b.fix(("src", w_node.index), w_pl, label, tensors[1], w_meta.shape)
        b.record["params"][w_node.fqn] = format_placements(w_pl)
        entry = b.record["ops"].setdefault(node.name, {"inputs": {}, "outputs": {}})
        entry["inputs"][str(xp)] = format_placements(x_pl)
        entry["inputs"][str(wp)] = format_placements(w_pl)
    return bool(modules)


def _shard_nodes(b: _Builder) -> None:
    for node in b.graph.nodes:
        if node.kind != "op" or node.target is not SHARD_OP:
            continue
        spec = node.call.args[1]
        label = f"autopar.shard(x, {spec!r}) in module {node.module or '<top>'} (node {node.name})"
        desc = f"activation {node.name}, shape {node.outputs[0].shape}"
        pl = b.parse(label, spec, [desc])
        b.fix(("in", node.index, 0), pl, label, desc, node.outputs[0].shape)
        b.fix(("out", node.index, 0), pl, label, desc, node.outputs[0].shape)
        b.record["ops"].setdefault(node.name, {"inputs": {}, "outputs": {}})["outputs"]["0"] = format_placements(pl)


def _io_hints(b: _Builder, input_placements, output_placements) -> None:
    inputs = {n.fqn: n for n in b.graph.nodes if n.kind == "input"}
    names = [n for n in b.graph.user_inputs if n in inputs]
    # an input is named by its graph input name (``batch_ids``) or by its path in the call (``batch['ids']``)
    by_path = {path: name for name, path in b.graph.call.input_paths.items()} if b.graph.call is not None else {}
    given = {by_path.get(k, k): v for k, v in _by_key(input_placements, names, "input_placements").items()}
    for name, value in given.items():
        if name not in inputs:
            known = [n if b.graph.call is None else _name_or_path(n, b.graph.call.input_paths.get(n, n)) for n in names]
            raise ValueError(
                f"input_placements names {name!r}, which is not an input of {b.graph.model_name}; "
                f"its tensor inputs are {known}. Fix: use one of those names or paths."
            )
        node = inputs[name]
        label = f"input_placements[{name!r}] = {_shown(value)}"
        desc = f"input {name}, shape {node.outputs[0].shape}"
        b.fix(("src", node.index), b.parse(label, value, [desc]), label, desc, node.outputs[0].shape)
        b.record["inputs"][name] = format_placements(b.sources[node.index])
    outs = _by_key(output_placements, list(range(len(b.graph.outputs))), "output_placements")
    for k, value in outs.items():
        if not isinstance(k, int) or not 0 <= k < len(b.graph.outputs):
            raise ValueError(
                f"output_placements[{k!r}]: {b.graph.model_name} has {len(b.graph.outputs)} tensor outputs "
                f"(0..{len(b.graph.outputs) - 1}). Fix: index the outputs in the order forward() returns them."
            )
        i, o = b.graph.outputs[k]
        node = b.graph.nodes[i]
        label = f"output_placements[{k}] = {_shown(value)}"
        desc = f"output {k} ({node.name}), shape {node.outputs[o].shape}"
        pl = b.parse(label, value, [desc])
        if node.kind == "op":
            b.fix(("out", i, o), pl, label, desc, node.outputs[o].shape)
            entry = b.record["ops"].setdefault(node.name, {"inputs": {}, "outputs": {}})
            entry["outputs"][str(o)] = format_placements(pl)
        else:
            b.fix(("src", i), pl, label, desc, node.outputs[o].shape)


def _name_or_path(name: str, path: str) -> str:
    return name if name == path else f"{name} or {path}"


def _by_key(value, keys: list, what: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return {k: v for k, v in value.items() if v is not None}
    value = list(value)
    if len(value) != len(keys):
        raise ValueError(f"{what}: {len(value)} entries for {len(keys)} tensors {keys}; give one each (None: free)")
    return {k: v for k, v in zip(keys, value) if v is not None}


def _unmatched(graph: OpGraph, label: str, what: str, strict: bool) -> None:
    if what == "parameter":
        examples = [n.fqn for n in graph.params()][:3]
    elif what == "module":
        examples = sorted({n.module for n in graph.nodes if n.kind == "op" and n.module})[:3]
    else:
        examples = sorted(_module_matmuls(graph))[:3]
    msg = (
        f"hint {label} matches no {what} of {graph.model_name} (e.g. {', '.join(examples) or 'none'}); "
        "check the pattern (fnmatch: '*' matches any text, dots included)"
    )
    if strict:
        raise UnmatchedHintError(msg)
    warnings.warn(msg, UserWarning, stacklevel=4)
