"""The elimination model: the search problem as factor tables, an elimination plan over
them, and its min-sum passes.  :mod:`.pareto` runs the plan over Pareto sets (for
:mod:`.dp` and :mod:`.chain`); :mod:`.lagrange`, :mod:`.minsum` and :mod:`.minibucket` use
the min-sum passes directly.

Factors (:class:`EliminationModel`).  Over the allowed strategies (INF and arc consistency, then
dominance: :func:`.prune.prune_dominated`), node i gives a unary factor, edge (u, v) a
binary one, summed per scope into a table holding, per assignment of its scope, one
(t, m) pair, or none where a choice or pair is forbidden (``t``, ``m``, ``ok``).

Order (:func:`elimination_order`).  Greedy, smallest new table first, ties in topological order:
parameters (leaves) fold into their consumer, chain ops into an edge, residual blocks
reduce series-parallel, one front sweeps the stream.  Nodes in ``keep`` (a :mod:`.chain`
part's ports) are never eliminated: the final table is over them, not a scalar.

Buckets (:class:`Step`).  Eliminating x takes its bucket ``F_1..F_r`` (the live tables
whose scope holds x) to a new table ``g(s)`` through a joint table over (s, x), each input
laid onto the joint axes (:func:`_bc`); the last step (x = -1) adds up what is left.  The
width is the largest joint table's cells per weight row.  With ``budget`` (mini-buckets,
:mod:`.minibucket`) a bucket whose joint table would exceed it is split into parts
(:func:`mini_buckets`: greedy first-fit, largest table first), each eliminating x on its
own; with ``width_budget`` (a :mod:`.chain` part) a plan wider than it raises
:class:`.ChainError`, so the planner solves flat.

Min-sum (:func:`inside`, :func:`outside`: the plan's order, then its reverse).  With
weight rows (w_t, w_m), every table gets ``I_g(s)``, the least ``w_t t + w_m m`` below it,
and ``O_g(s)``, the same least over all factors not below g::

    I_g(s) = min_x sum_j I_{F_j}(s, x)
    O_{F_j}(s_j) = min over (s, x) \\ s_j of [ O_g(s) + sum_{l != j} I_{F_l}(s, x) ]

:func:`argmin_at` decodes one plan per row from the inside values, in reverse order.

Two sides (:func:`_sides`).  A step over ``(a, c)`` eliminating ``x`` whose inputs each hold ``x`` and at most one
of ``a``, ``c`` is a min-plus product, ``I(a, c) = min_x L(a, x) + R(x, c)`` (:func:`.minplus.minplus`, one pass
per ``x`` over the ``(a, c)`` table; the outside values likewise, ``min_c O(a, c) + R(x, c)``): the joint table
is never formed.  Every wide step of a GPT-shaped block on a three-axis mesh is one.

Lexicographic (:func:`lexicographic`).  The min-sum of (time, memory) pairs ordered by time, then memory: the
least memory among the plans of least time, exactly, for the chain's tie-break without a cap.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch

from .deadline import Deadline
from .minplus import minplus
from .problem import INF, SearchProblem
from .prune import prune_dominated, rows_cols
from .split import ChainError


def elimination_order(scopes: list[tuple[int, ...]], k: list[int], keep: frozenset[int] = frozenset()) -> list[int]:
    """Greedy elimination order: smallest new table (product of the neighbours' k)
    first, ties in topological order, so one front sweeps from input to loss.
    Nodes in ``keep`` are never eliminated (they stay in the final table's scope)."""
    adj: dict[int, set[int]] = {v: set() for v in range(len(k)) if k[v] > 1}
    for s in scopes:
        for v in s:
            adj[v].update(w for w in s if w != v)
    current = {v: math.prod(k[w] for w in adj[v]) for v in adj}
    heap = [(c, v) for v, c in current.items() if v not in keep]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        c, v = heapq.heappop(heap)
        if current.get(v) != c:
            continue
        del current[v]
        order.append(v)
        nbrs = adj.pop(v)
        for w in nbrs:
            adj[w].discard(v)
            adj[w].update(x for x in nbrs if x != w)
            current[w] = math.prod(k[x] for x in adj[w])
            if w not in keep:
                heapq.heappush(heap, (current[w], w))
    return order


def mini_buckets(
    inputs: tuple[int, ...], scopes: list[tuple[int, ...]], k: list[int], var: int, budget: int
) -> list[tuple[int, ...]]:
    """Parts of the bucket ``inputs`` (tables eliminating ``var``) whose joint tables, over
    their scopes and ``var``, hold at most ``budget`` cells: greedy first-fit, largest table
    first.  A table alone over the budget gets a part of its own."""
    parts: list[tuple[list[int], set[int]]] = []
    for tid in sorted(inputs, key=lambda t: (-math.prod(k[w] for w in scopes[t]), t)):
        for members, scope in parts:
            if math.prod(k[w] for w in scope | set(scopes[tid])) <= budget:
                members.append(tid)
                scope.update(scopes[tid])
                break
        else:
            parts.append(([tid], set(scopes[tid]) | {var}))
    return [tuple(sorted(members)) for members, _ in parts]


@dataclass(slots=True)
class Step:
    """One bucket: eliminate ``var`` (-1: add up the final scalars) from ``inputs``."""

    var: int
    inputs: tuple[int, ...]
    scope: tuple[int, ...]
    shape: tuple[int, ...]  # joint axes: scope, then var
    bcast: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per input: transpose (rows first), joint shape
    pos: tuple[tuple[int, ...], ...]  # per input: joint axis of each of its scope nodes
    out: int


class EliminationModel:
    """The problem as factors over the allowed strategies, and an elimination plan.

    ``keep``: nodes left uneliminated; the final table is then over them (a marginal
    Pareto table, as :mod:`.chain` uses), not a scalar.  ``budget``: mini-buckets (see
    :meth:`_plan`).  ``width_budget``: a plan whose largest joint table holds more cells
    per weight row raises :class:`.ChainError` (:class:`.tables.PortTable` passes ``dp.WIDTH_BUDGET``).
    ``deadline``: the dominance pruning stops there (:func:`.prune.prune_dominated`)."""

    def __init__(
        self,
        problem: SearchProblem,
        *,
        keep: frozenset[int] = frozenset(),
        budget: int | None = None,
        width_budget: int | None = None,
        deadline: Deadline | None = None,
    ) -> None:
        self.problem = problem
        # INF and arc consistency, then dominance (:mod:`.prune`, stopped past ``deadline``): cap-free, kept with
        # the arrays (a pruning the deadline stopped is kept as it stopped: still exact, only wider)
        self.allowed = problem.memo(
            ("allowed", keep), lambda: prune_dominated(problem, problem.allowed_choices(), keep, deadline)
        )
        k = self.k = [len(a) for a in self.allowed]
        base = [np.zeros((), np.int64), np.full((), problem.base_mem_bytes, np.int64), np.ones((), bool)]
        acc: dict[tuple[int, ...], list[np.ndarray]] = {(): base}  # scope -> [t, m, allowed]

        def add(nodes: tuple[int, ...], t: np.ndarray, m: np.ndarray) -> None:
            scope = tuple(v for v in nodes if k[v] > 1)
            shape = tuple(k[v] for v in scope)
            ok = (t < INF).reshape(shape)
            t, m = np.where(ok, t.reshape(shape), 0), np.where(ok, m.reshape(shape), 0)
            old = acc.get(scope)
            acc[scope] = [t, m, ok] if old is None else [old[0] + t, old[1] + m, old[2] & ok]

        for i, al in enumerate(self.allowed):
            add((i,), problem.node_time[i][al], problem.node_mem[i][al])
        for (u, v), et, em in zip(problem.edges, problem.edge_time, problem.edge_mem):
            au, av = self.allowed[u], self.allowed[v]
            m = np.zeros((k[u], k[v]), np.int64) if em is None else rows_cols(em, au, av)
            add((u, v), rows_cols(et, au, av), m)  # views where neither side was pruned
        scopes = list(acc)
        self.t, self.m, self.ok = ([acc[s][i] for s in scopes] for i in range(3))
        self.n_orig = len(scopes)
        self._plan(scopes, elimination_order(scopes, k, keep), budget)
        if width_budget is not None and self.width > width_budget:
            raise ChainError(
                f"a part's elimination needs a joint table of {self.width} cells per weight row, over the width "
                f"budget of {width_budget}; solve flat (the flat search approximates past the budget)"
            )

    def _plan(self, scopes: list[tuple[int, ...]], order: list[int], budget: int | None) -> None:
        """The steps eliminating ``order``, then the final sum; ``budget`` (mini-buckets,
        :mod:`.minibucket`): a bucket whose joint table would exceed it is split into parts
        that fit, each eliminating the node on its own."""
        k = self.k
        holding: dict[int, set[int]] = {v: set() for v in range(len(k)) if k[v] > 1}
        for tid, s in enumerate(scopes):
            for v in s:
                holding[v].add(tid)
        self.steps: list[Step] = []
        self.step_of: dict[int, Step] = {}
        self.buckets: dict[int, tuple[int, ...]] = {}  # node -> every table its bucket held (decoding)
        live = set(range(len(scopes)))
        self.whole_buckets = True  # no bucket split into mini-bucket parts: the inside values are exact minima
        for v in order + [-1]:
            inputs = tuple(sorted(holding.pop(v) if v >= 0 else live))
            live.difference_update(inputs)
            for tid in inputs:
                for w in scopes[tid]:
                    if w != v:
                        holding[w].discard(tid)
            self.buckets[v] = inputs
            if budget is None or v < 0:
                parts = [inputs]
            else:
                parts = mini_buckets(inputs, scopes, k, v, budget)
                self.whole_buckets &= len(parts) == 1
            for part in parts:
                step = self._step(scopes, v, part)
                live.add(step.out)
                for w in step.scope:
                    holding[w].add(step.out)
        self.scopes = scopes
        self.final = self.steps[-1].out
        self.width = max((math.prod(st.shape) for st in self.steps), default=1)  # cells per weight row

    def _step(self, scopes: list[tuple[int, ...]], v: int, inputs: tuple[int, ...]) -> Step:
        k = self.k
        scope = tuple(sorted({w for tid in inputs for w in scopes[tid]} - {v}))
        joint = scope + ((v,) if v >= 0 else ())
        bcast, poss = [], []
        for tid in inputs:
            pos = tuple(joint.index(w) for w in scopes[tid])
            bshape = [k[w] if w in scopes[tid] else 1 for w in joint]
            poss.append(pos)
            bcast.append(((0,) + tuple(int(p) + 1 for p in np.argsort(pos)), tuple(bshape)))
        step = Step(v, inputs, scope, tuple(k[w] for w in joint), tuple(bcast), tuple(poss), len(scopes))
        scopes.append(scope)
        self.steps.append(step)
        self.step_of[step.out] = step
        return step

    def original_choice(self, reduced: np.ndarray) -> tuple[int, ...]:
        return tuple(int(self.allowed[i][reduced[i]]) for i in range(len(self.k)))


#: Cells (all rows) of the joint a min-sum pass forms at once: a wider step runs in slices of its first axis
#: (:func:`_slices`), so the chain's wide block tables (:data:`.chain_tables.BLOCK_WIDTH_BUDGET`) cost time, not a
#: joint-sized array per row.  2^23 float64 cells are 64 MiB.
SLICE_CELLS = 2**23


def _slices(step: Step, rows: int) -> list[slice]:
    """Slices of the step's first joint axis whose joints hold at most :data:`SLICE_CELLS` cells (one slice:
    the whole step, also when its scope is empty)."""
    cells = rows * math.prod(step.shape)
    if cells <= SLICE_CELLS or not step.scope:
        return [slice(None)]
    per = max(1, SLICE_CELLS * step.shape[0] // cells)
    return [slice(lo, lo + per) for lo in range(0, step.shape[0], per)]


def _bc(step: Step, j: int, arr: np.ndarray, part: slice = slice(None)) -> np.ndarray:
    """Input j's (rows, *scope) table laid onto the step's joint axes (size 1 where it has none), at ``part`` of
    the first joint axis."""
    perm, bshape = step.bcast[j]
    laid = arr.transpose(perm).reshape((arr.shape[0],) + bshape)
    return laid if part == slice(None) or bshape[0] == 1 else laid[:, part]


def _joint(step: Step, vals: list, skip: int = -1, part: slice = slice(None), lay=None):
    """The sum of the step's inputs but ``skip`` on its joint axes, at ``part`` of the first; ``lay``
    (``torch.from_numpy``): summed as torch tensors (a sliced step's)."""
    acc = 0.0
    for j, tid in enumerate(step.inputs):
        if j != skip:
            x = _bc(step, j, vals[tid], part)
            acc = _add(acc, x if lay is None else lay(x))
    return acc


def _add(acc, x):
    """``acc + x`` for a running sum begun at the float 0.0, so an array ``acc`` is a
    temporary of an earlier ``_add``: in place once it has the full shape (the same
    floats, without a joint-sized allocation per term).  numpy arrays or torch tensors."""
    if isinstance(acc, (np.ndarray, torch.Tensor)) and np.broadcast_shapes(acc.shape, x.shape) == tuple(acc.shape):
        return acc.add_(x) if isinstance(acc, torch.Tensor) else np.add(acc, x, out=acc)
    return acc + x


def _inside_sliced(st: Step, vals: list, rows: int, args: dict | None) -> None:
    """:func:`inside`'s step over the slices of its first axis (:func:`_slices`), summed and reduced by torch's
    kernels (every core; the same floats: sums formed alike, min exact, argmin the first on ties)."""
    shape = (rows,) + (st.shape[:-1] if st.var >= 0 else st.shape)
    out = vals[st.out] = np.empty(shape)
    if args is not None and st.var >= 0:
        args[st.out] = np.empty(shape, np.int64)
    for part in _slices(st, rows):
        joint = _joint(st, vals, part=part, lay=torch.from_numpy)
        if st.var >= 0:
            if args is not None:
                args[st.out][:, part] = joint.argmin(dim=-1).numpy()
            joint = joint.amin(dim=-1)
        out[:, part] = joint.numpy()


def _outside_sliced(st: Step, vals: list, oh: np.ndarray, j: int, rows: int) -> np.ndarray:
    """Input j's outside value over the step's joint axes (before :func:`outside` transposes it), over the slices
    of the first axis as :func:`_inside_sliced`: the least of ``oh`` plus the other inputs over the axes input j
    does not have, kept per slice where it has the first axis, else the least across slices."""
    bshape = st.bcast[j][1]
    axes = tuple(1 + a for a, size in enumerate(bshape) if size == 1)
    acc = np.empty((rows, *(size for size in bshape if size > 1))) if bshape[0] > 1 else None
    for part in _slices(st, rows):
        size = len(range(st.shape[0])[part])
        cut = oh[:, part] if oh.flags.writeable else oh[:, part].copy()  # torch holds writable arrays only
        rest = torch.from_numpy(cut) + _joint(st, vals, skip=j, part=part, lay=torch.from_numpy)
        rest = rest.expand((rows, size) + st.shape[1:])
        low = (rest.amin(dim=axes) if axes else rest).numpy()
        if bshape[0] > 1:
            acc[:, part] = low
        else:
            acc = low if acc is None else np.minimum(acc, low)
    return acc


#: Cells per row from which :func:`inside` runs a step whose inputs lie on two sides of its node as a min-plus
#: product (:func:`_sides`): below it forming the joint costs less than the product's pass per middle choice
PRODUCT_CELLS = 2**16
#: ...and whose (a, c) table, which each of the product's passes (one per choice of the node) sweeps, holds at least
#: this many: a pass over fewer cells costs more in its call than in its work
PASS_CELLS = 2**12


def _sides(model: EliminationModel, st: Step) -> tuple[list[int], list[int]] | None:
    """Where step ``st`` eliminates ``x`` into a table over two nodes ``(a, c)`` and no input holds both (each is
    over ``x`` with at most one of them): its inputs by side, ``(over a and x or x alone, over x and c)``; else
    None.  Then ``I(a, c) = min_x L(a, x) + R(x, c)`` with ``L``, ``R`` the sums of each side's inputs: a min-plus
    product (:func:`.minplus.minplus`), one pass per ``x`` over the (a, c) table instead of forming the joint
    (a, c, x).  Every wide step of the chain's GPT-shaped blocks on three-axis meshes is one (the residual stream
    between two ports, 511 x 372 x 511 cells)."""
    cells = math.prod(st.shape)
    if st.var < 0 or len(st.scope) != 2 or cells < PRODUCT_CELLS or st.shape[0] * st.shape[1] < PASS_CELLS:
        return None
    a, c = st.scope
    left, right = [], []
    for j, tid in enumerate(st.inputs):
        scope = set(model.scopes[tid]) - {st.var}
        if a in scope and c in scope:
            return None
        (right if c in scope else left).append(j)
    return (left, right) if left and right and any(a in model.scopes[st.inputs[j]] for j in left) else None


def _inside_product(st: Step, vals: list, left: list[int], right: list[int]) -> np.ndarray:
    """:func:`inside`'s step ``st`` as the min-plus product of its two sides (:func:`_sides`): (rows, a, c).  Each
    side's inputs are summed before the sides meet, so on a row of fractional weights (a Lagrange row) a value may
    differ from the joint's in its last bits; on the time and memory rows (int64 terms) it is the same number.
    Only without argmins: :func:`decode` then recovers a plan from the values, as the chain's rows do."""
    lhs = sum(_bc(st, j, vals[st.inputs[j]]) for j in left)  # (rows, a, 1, x) where some input holds a
    rhs = sum(_bc(st, j, vals[st.inputs[j]]) for j in right)  # (rows, 1, c, x)
    lhs = np.array(np.broadcast_to(lhs[:, :, 0, :], (lhs.shape[0], st.shape[0], st.shape[2])))  # writable
    return minplus(lhs, np.ascontiguousarray(rhs[:, 0, :, :].transpose(0, 2, 1)))


def _outside_product(
    st: Step, vals: list, out: np.ndarray, j: int, sides: tuple[list[int], list[int]], across: dict
) -> np.ndarray:
    """Input j's outside value (on the step's joint axes, as :func:`outside` takes it) for a step of two sides
    (:func:`_sides`), ``out`` the step's own (rows, a, c): for j over (a, x), ``min_c out(a, c) + R(x, c)`` (a
    min-plus product, kept per side in ``across``) plus the other inputs of its side, then the least over the axes
    j does not hold; likewise over (x, c) with ``min_a L(a, x) + out(a, c)``."""
    left, right = sides
    on_left = j in left
    if on_left not in across:
        if on_left:
            rhs = sum(_bc(st, i, vals[st.inputs[i]]) for i in right)[:, 0]  # (rows, c, x)
            across[on_left] = minplus(_writable(out), _writable(rhs))[:, :, None, :]  # (rows, a, 1, x)
        else:
            lhs = sum(_bc(st, i, vals[st.inputs[i]]) for i in left)[:, :, 0]  # (rows, a|1, x)
            lhs = np.broadcast_to(lhs, (lhs.shape[0], st.shape[0], st.shape[2])).transpose(0, 2, 1)  # (rows, x, a)
            across[on_left] = minplus(_writable(lhs), _writable(out)).transpose(0, 2, 1)[:, None]  # (rows, 1, c, x)
    rest = across[on_left] + sum((_bc(st, i, vals[st.inputs[i]]) for i in (left if on_left else right) if i != j), 0.0)
    axes = tuple(1 + a for a, size in enumerate(st.bcast[j][1]) if size == 1)
    return rest.min(axis=axes) if axes else rest


def _writable(x: np.ndarray) -> np.ndarray:
    """``x`` as a C-contiguous writable array (torch takes only those), copied where it is not one."""
    return x if x.flags.writeable and x.flags.c_contiguous else np.array(x)


def inside(model: EliminationModel, w: np.ndarray, argmins: bool = True) -> tuple[list, dict[int, np.ndarray]]:
    """Min-sum elimination of ``w[b, 0] T + w[b, 1] M`` for every row b at once:
    inside values (rows, *scope) of every table, and (``argmins``) the argmins.
    Without them :func:`argmin_at` recovers one plan's choices: an argmin over the
    whole joint table costs as much as the min itself."""
    vals: list = []
    for t, m, ok in zip(model.t, model.m, model.ok):
        shape = (-1,) + (1,) * t.ndim
        vals.append(np.where(ok, w[:, 0].reshape(shape) * t + w[:, 1].reshape(shape) * m, np.inf))
    vals += [None] * len(model.steps)
    args: dict[int, np.ndarray] = {}
    rows = len(w)
    for st in model.steps:
        sides = None if argmins else _sides(model, st)
        if sides is not None:  # two sides of the node: a min-plus product, no joint formed
            vals[st.out] = _inside_product(st, vals, *sides)
            continue
        if len(_slices(st, rows)) > 1:  # a joint too wide to form at once
            _inside_sliced(st, vals, rows, args if argmins else None)
            continue
        joint = _joint(st, vals)
        if st.var >= 0:
            if argmins:
                args[st.out] = joint.argmin(axis=-1)
            joint = joint.min(axis=-1)
        vals[st.out] = joint
    return vals, args


def _line(model: EliminationModel, var: int, vals: list, red: np.ndarray) -> np.ndarray:
    """(rows, k of ``var``): per row b, the sum of ``var``'s bucket's tables at the choices ``red[b]`` of the nodes
    eliminated after it, summed as :func:`_joint` sums it (the same floats)."""
    rows = np.arange(red.shape[0])[:, None]
    xs = np.arange(model.k[var])[None, :]
    acc: np.ndarray | float = 0.0
    for tid in model.buckets[var]:
        idx = tuple(xs if v == var else red[:, v, None] for v in model.scopes[tid])
        acc = acc + vals[tid][(rows,) + idx]
    return np.broadcast_to(acc, (red.shape[0], model.k[var]))


def argmin_at(model: EliminationModel, var: int, vals: list, red: np.ndarray) -> np.ndarray:
    """Per row b, the argmin over ``var`` of the sum of its bucket's tables at the choices
    ``red[b]`` of the nodes eliminated after it: the exact joint's line summed as
    :func:`_joint` sums it (same floats, so the same argmin as ``joint.argmin(axis=-1)``);
    with mini-buckets, every part's tables (the classic mini-bucket decoding)."""
    return _line(model, var, vals, red).argmin(axis=-1)


def decode(model: EliminationModel, vals: list, red: np.ndarray) -> np.ndarray:
    """``red`` (rows, nodes; the kept nodes already set) with every eliminated node set to its argmin, in
    reverse elimination order (:func:`argmin_at`; row r reads row r of ``vals``): each row's min-sum plan."""
    return decode_unique(model, vals, red)[0]


def decode_unique(model: EliminationModel, vals: list, red: np.ndarray) -> tuple[np.ndarray, list[int], bool]:
    """:func:`decode`; the nodes it set before the first line whose least it met more than once (in some row), in
    decoding order; and whether there was none (every node is then among them).

    In a model without mini-buckets (``whole_buckets``) whose sums are exact (a row of integer weights over the
    int64 terms, every sum below 2^53), every plan of least value with the kept nodes as set agrees with the
    decoded one on those nodes, by induction in decoding order: with the nodes decoded before ``x`` as such a plan
    ``P`` has them, the line of ``x`` is the least of ``P``'s terms below ``x``'s bucket for each value of ``x``
    (inside values are minima over the nodes eliminated before it, which appear in no other term); were ``P``'s
    ``x`` not the line's least, choosing the least and the minima below it would make a plan of less value, so it
    is that least, and taken once, the decoded value.  Without a tie the decoded plan is the only one of least
    value."""
    forced: list[int] = []
    tied = False
    for var in reversed(model.buckets):
        if var >= 0:
            line = _line(model, var, vals, red)
            red[:, var] = line.argmin(axis=-1)
            tied = tied or not bool(((line == line.min(axis=-1, keepdims=True)).sum(axis=-1) == 1).all())
            if not tied:
                forced.append(var)
    return red, forced, not tied


def lexicographic(model: EliminationModel) -> tuple[list, list]:
    """Per table, its least time below it and the least memory among the ways below it to that time, ``(t_vals,
    m_vals)``, each (1, *scope): the min-sum of (time, memory) pairs ordered by time, then memory (a semiring:
    adding a pair keeps the order).  Exact where the time sums are (int64 terms below 2^53): each joint cell's
    memory is kept where its time equals the least over the eliminated node.  Wide steps in slices, on torch's
    kernels (every core), as :func:`_inside_sliced`."""
    t_vals: list = [np.where(ok, t, np.inf)[None] for t, ok in zip(model.t, model.ok)] + [None] * len(model.steps)
    m_vals: list = [np.where(ok, m, np.inf)[None] for m, ok in zip(model.m, model.ok)] + [None] * len(model.steps)
    lay = torch.from_numpy
    for st in model.steps:
        shape = (1,) + (st.shape[:-1] if st.var >= 0 else st.shape)
        t_out, m_out = t_vals[st.out], m_vals[st.out] = np.empty(shape), np.empty(shape)
        for part in _slices(st, 1):
            joint_t, joint_m = _joint(st, t_vals, part=part, lay=lay), _joint(st, m_vals, part=part, lay=lay)
            if st.var >= 0:
                least = joint_t.amin(dim=-1, keepdim=True)
                joint_m = joint_m.masked_fill(joint_t != least, np.inf).amin(dim=-1)
                joint_t = least.squeeze(-1)
            at = (slice(None), part)[: len(shape)]
            t_out[at], m_out[at] = _numpy(joint_t), _numpy(joint_m)
    return t_vals, m_vals


def _numpy(x):
    return x.numpy() if isinstance(x, torch.Tensor) else x


def decode_lexicographic(model: EliminationModel, t_vals: list, m_vals: list, red: np.ndarray) -> np.ndarray:
    """:func:`decode` in the order of :func:`lexicographic`: each node the least memory among its choices of least
    time (the first on ties): the plan of least time whose memory is least among those, as the values say."""
    for var in reversed(model.buckets):
        if var >= 0:
            line_t, line_m = _line(model, var, t_vals, red), _line(model, var, m_vals, red)
            line_m = np.where(line_t == line_t.min(axis=-1, keepdims=True), line_m, np.inf)
            red[:, var] = line_m.argmin(axis=-1)
    return red


def outside(model: EliminationModel, vals: list, final_out: np.ndarray | None = None) -> list:
    """Outside value of every eliminated table (the reverse pass of the docstring);
    ``final_out`` (rows, *final scope): a lower bound on what lies outside the model."""
    rows = vals[0].shape[0]
    outs: list = [None] * len(vals)
    shape = (rows,) + tuple(model.k[v] for v in model.steps[-1].scope)
    outs[model.final] = np.zeros(shape) if final_out is None else np.broadcast_to(final_out, shape).astype(float)
    for st in reversed(model.steps):
        oh = outs[st.out] if st.var < 0 else outs[st.out][..., None]
        sliced = len(_slices(st, rows)) > 1  # a joint too wide to form at once
        sides = _sides(model, st)
        across: dict[bool, np.ndarray] = {}  # per side, what lies across the node from it (_outside_product)
        for j, tid in enumerate(st.inputs):
            if tid >= model.n_orig:
                perm, bshape = st.bcast[j]
                if sides is not None:
                    low = _outside_product(st, vals, outs[st.out], j, sides, across)
                elif sliced:
                    low = _outside_sliced(st, vals, oh, j, rows)
                else:
                    rest = np.broadcast_to(oh + _joint(st, vals, skip=j), (rows,) + st.shape)
                    axes = tuple(1 + a for a, size in enumerate(bshape) if size == 1)
                    low = rest.min(axis=axes) if axes else rest
                outs[tid] = low.transpose(np.argsort(perm))
    return outs
