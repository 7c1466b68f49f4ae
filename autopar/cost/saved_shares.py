"""Where a graph's tensors kept for backward are paid: derived once per graph, on its global metas.

Every saved tensor refers to a storage root (``saved.storage_roots``: a view keeps its base).  A root its own op
keeps (an output saved by the op that makes it) is paid once as a node term (``GraphSaved.saved_outputs``).  Any
other root is paid on the input edges of the ops that keep it (or a view of it): the executor hands an op a new
tensor when its edge moves (``runtime.redistribute`` never aliases), which that op then keeps instead; when the
edge does not move, the op keeps the storage its input views.  So each of the root's ``k`` saving edges pays, when
it does not move, ``1/k`` of the storage under the input it reads (its tensor's local bytes scaled by root numel /
tensor numel: the whole base a view keeps, assuming the view is split across ranks like its base), and when it
moves, the copy (``Coster.edge_saved_bytes``).  Exact when all or none of the ``k`` edges move; when some do, the
root is under-paid by their shares; a copy made higher up a view chain is priced as the root scaled to the view.
Parameters (and views of them) are model state.

What an op saves depends on the graph and on the profile's attention kernel alone (``saved_for_backward``), so
``graph_saved`` is the same for every mesh the graph is priced on (``OpGraph.derived``)."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.capture import OpNode

from .saved import NOTHING_SAVED, SavedForBackward, memory_layouts, saved_for_backward, storage_roots

__all__ = ["GraphSaved", "graph_saved", "saved_by"]


@dataclass(frozen=True, slots=True)
class GraphSaved:
    """What a graph's ops keep for backward, on its global metas: ``layouts`` each output's memory layout
    (``saved.memory_layouts``), ``saved`` what each op keeps (by node index), ``roots`` the storage root of each
    view's output; ``saved_outputs`` the roots paid as node terms (kept by the op that makes them) and
    ``edge_shares`` the share of each saving edge ``(node, input position)``: ``(root kept by its op, k, n,
    root numel)``, where the edge is the ``k``-th (from 0) of the root's ``n`` saving edges."""

    layouts: dict[tuple[int, int], tuple[int, ...]]
    saved: dict[int, SavedForBackward]
    roots: dict[tuple[int, int], tuple[int, int]]
    saved_outputs: set[tuple[int, int]]
    edge_shares: dict[tuple[int, int], tuple[bool, int, int, int]]


def saved_by(graph, layouts: dict, attention: str, node: OpNode, call, kernel=None) -> SavedForBackward:
    """What ``node`` of ``graph`` keeps for backward on ``call``'s metas (global, or one rank's local), run as
    ``kernel`` (``(fn, ctx)``; None: the op itself), with scaled_dot_product_attention in the ``attention`` form."""
    if node.kind != "op" or not node.requires_grad:
        return NOTHING_SAVED
    nodes = graph.nodes
    rg = tuple(nodes[u].requires_grad and nodes[u].outputs[o].is_float for u, o in node.inputs)
    held = tuple(layouts.get(i) for i in node.inputs)
    return saved_for_backward(call, rg, layouts=held, attention=attention, kernel=kernel)


def graph_saved(graph, attention: str) -> GraphSaved:
    """``graph``'s ``GraphSaved`` with scaled_dot_product_attention in the ``attention`` form (module docstring)."""
    layouts = memory_layouts(graph)
    saved = {n.index: saved_by(graph, layouts, attention, n, n.call) for n in graph.nodes if n.kind == "op"}
    roots = storage_roots(graph)
    by_root: dict[tuple[int, int], set] = {}
    for v in graph.nodes:
        kept_by_v = saved.get(v.index)
        if kept_by_v is None:
            continue
        refs = [(v.inputs[pos], (v.index, pos)) for pos in kept_by_v.inputs]
        refs += [((v.index, o), None) for o in kept_by_v.outputs]
        for ref, edge in refs:
            root = roots.get(ref, ref)
            if graph.nodes[root[0]].kind != "param":
                by_root.setdefault(root, set()).add(edge)
    kept = {root for root, edges in by_root.items() if None in edges}
    shares = {}
    for root, edges in by_root.items():
        real = sorted(e for e in edges if e is not None)
        numel = graph.nodes[root[0]].outputs[root[1]].numel
        for k, edge in enumerate(real):
            shares[edge] = (root in kept, k, len(real), numel)
    return GraphSaved(layouts, saved, roots, kept, shares)
