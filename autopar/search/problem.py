"""The search problem as pure data, its objective, and a brute-force reference.

A :class:`SearchProblem` is what the cost model hands the solvers: ``n`` nodes in a
topological order, each with ``k_i`` strategies, and for every choice vector ``c``

    T(c) = sum_i node_time[i][c_i] + sum_(u,v) edge_time[e][c_u, c_v]              (ps)
    M(c) = base + sum_i node_mem[i][c_i] + sum_(u,v) edge_mem[e][c_u, c_v]       (bytes)

The solvers minimize ``T`` subject to ``M <= mem_cap_bytes``.  Entries equal to
:data:`INF` in ``node_time``/``edge_time`` mark forbidden choices/pairs.  All
numbers are int64, so two exact solvers must report the *same* optimum.

:func:`solve_brute_force` enumerates every assignment; it is the obviously-correct
reference the tests hold the fast solvers to.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

__all__ = ["INF", "SearchProblem", "Solution", "Start", "InfeasibleError", "solve_brute_force"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
# memo keys of the problem's own indexes (kept by forget)
_OWN = frozenset({"flat", "edge array", "ks array", "arrays key"})

#: Marks a forbidden choice (node_time) or pair (edge_time); a quarter of int64 max so
#: that a few of them can be added without overflowing.
INF: int = int(np.iinfo(np.int64).max // 4)

_MAX_BULLETS = 8


def _check_array(label: str, arr: object, shape: tuple[int, ...] | None, ndim: int, bad: list[str]) -> None:
    if not isinstance(arr, np.ndarray):
        bad.append(f"{label}: expected a numpy int64 array, got {type(arr).__name__}")
    elif arr.dtype != np.int64:
        bad.append(f"{label}: expected dtype int64, got {arr.dtype} (convert with np.asarray(x, dtype=np.int64))")
    elif arr.ndim != ndim or (shape is not None and arr.shape != shape):
        want = shape if shape is not None else f"{ndim}-D"
        bad.append(f"{label}: expected shape {want}, got {arr.shape}")


def _check_ranges(labelled: list[tuple[str, np.ndarray]], bad: list[str]) -> None:
    """Values in [-INF, INF]: one pass over all arrays, then the culprits by name."""
    arrays = [a.reshape(-1) for _, a in labelled if isinstance(a, np.ndarray) and a.dtype == np.int64 and a.size]
    if not arrays:
        return
    flat = np.concatenate(arrays)
    if int(flat.max()) <= INF and int(flat.min()) >= -INF:
        return
    for label, arr in labelled:
        if isinstance(arr, np.ndarray) and arr.dtype == np.int64 and arr.size and (arr.max() > INF or arr.min() < -INF):
            bad.append(
                f"{label}: values must lie in [-INF, INF] (INF = {INF} marks forbidden), got {arr.min()}..{arr.max()}"
            )


def _well_formed(names, node_time, node_mem, edges, edge_time, edge_mem) -> bool:
    """All of :class:`SearchProblem`'s checks at once, vectorized; False sends the caller to
    the detailed checks for the message.  Each distinct array is checked once: the tables of
    repeated layers share arrays (``problem_builder``), so the cost follows the distinct ones."""
    n = len(names)
    if len(node_time) != n or len(node_mem) != n or len(edge_time) != len(edges) or len(edge_mem) != len(edges):
        return False
    if any(a is None for a in (*node_time, *node_mem, *edge_time)):
        return False
    arrays = {id(a): a for a in (*node_time, *node_mem, *edge_time, *edge_mem) if a is not None}
    if not all(isinstance(a, np.ndarray) and a.dtype == np.int64 for a in arrays.values()):
        return False
    shapes = [a.shape for a in node_time]
    if any(len(sh) != 1 or sh[0] < 1 for sh in shapes) or [a.shape for a in node_mem] != shapes:
        return False
    if edges:
        uv = np.array(edges, np.int64)
        if not ((uv[:, 0] >= 0) & (uv[:, 0] < uv[:, 1]) & (uv[:, 1] < n)).all():
            return False
        if np.unique(uv[:, 0] * n + uv[:, 1]).size != len(edges):
            return False
        want = [shapes[u] + shapes[v] for u, v in edges]
        if [a.shape for a in edge_time] != want:
            return False
        if any(a is not None and a.shape != w for a, w in zip(edge_mem, want)):
            return False
    flat = [a.reshape(-1) for a in arrays.values() if a.size]
    if flat:
        flat = np.concatenate(flat)
        if int(flat.max()) > INF or int(flat.min()) < -INF:
            return False
    return True


def _readonly(arr: np.ndarray) -> np.ndarray:
    if not arr.flags.writeable:
        return arr  # nothing can write through it (its owner made it read-only)
    view = arr.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True, slots=True, eq=False)
class SearchProblem:
    """Per-node strategy costs and per-edge resharding costs; see the module docstring.

    Nodes are indexed in a topological order: every edge ``(u, v)`` has ``u < v``,
    and there is at most one edge per pair.  ``edge_mem[e]`` may be ``None`` (zeros).
    Equality is identity: the arrays make field-wise equality ambiguous.
    """

    names: tuple[str, ...]
    node_time: tuple[np.ndarray, ...]
    node_mem: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int], ...]
    edge_time: tuple[np.ndarray, ...]
    edge_mem: tuple[np.ndarray | None, ...]
    mem_cap_bytes: int | None
    base_mem_bytes: int = 0
    _ks: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)  # num_choices
    # what is derived from the arrays alone (evaluate's gather index, a solver's tables),
    # shared by the problems :meth:`with_cap` makes: they differ in the cap only
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = tuple(str(s) for s in self.names)
        edges = tuple((int(u), int(v)) for u, v in self.edges)
        ok = isinstance(self.mem_cap_bytes, (int, np.integer, type(None)))
        ok = ok and isinstance(self.base_mem_bytes, (int, np.integer))
        if not (ok and _well_formed(names, self.node_time, self.node_mem, edges, self.edge_time, self.edge_mem)):
            self._explain(names)
        self._settle(names, edges)

    def _explain(self, names: tuple[str, ...]) -> None:
        """Raise ValueError with one bullet per defect (the slow path of the checks)."""
        n = len(names)
        bad: list[str] = []
        for label, seq, want in (
            ("node_time", self.node_time, n),
            ("node_mem", self.node_mem, n),
            ("edge_time", self.edge_time, len(self.edges)),
            ("edge_mem", self.edge_mem, len(self.edges)),
        ):
            if len(seq) != want:
                bad.append(
                    f"{label}: expected {want} entries (one per {'node' if want == n else 'edge'}), got {len(seq)}"
                )
        if bad:
            raise ValueError(
                "SearchProblem is malformed:\n"
                + "\n".join(f"  - {b}" for b in bad)
                + "\nfix: build one array per node and per edge"
            )
        edges = tuple((int(u), int(v)) for u, v in self.edges)
        ks: list[int] = []
        for i in range(n):
            t = self.node_time[i]
            _check_array(f"node_time[{i}] ({names[i]})", t, None, 1, bad)
            k = t.shape[0] if isinstance(t, np.ndarray) and t.ndim == 1 else 0
            if isinstance(t, np.ndarray) and t.ndim == 1 and k < 1:
                bad.append(f"node_time[{i}] ({names[i]}): expected k_i >= 1 strategies, got 0")
            ks.append(k)
            _check_array(f"node_mem[{i}] ({names[i]})", self.node_mem[i], (k,), 1, bad)
        seen: set[tuple[int, int]] = set()
        for e, (u, v) in enumerate(edges):
            if not (0 <= u < v < n):
                bad.append(f"edges[{e}] = ({u}, {v}): expected 0 <= u < v < {n} (nodes in topological order)")
                continue
            if (u, v) in seen:
                bad.append(
                    f"edges[{e}] = ({u}, {v}) ({names[u]} -> {names[v]}): duplicate edge; "
                    "merge duplicates by adding their matrices"
                )
            seen.add((u, v))
            shape = (ks[u], ks[v])
            _check_array(f"edge_time[{e}] ({names[u]} -> {names[v]})", self.edge_time[e], shape, 2, bad)
            if self.edge_mem[e] is not None:
                _check_array(f"edge_mem[{e}] ({names[u]} -> {names[v]})", self.edge_mem[e], shape, 2, bad)
        _check_ranges(
            [(f"node_time[{i}] ({names[i]})", a) for i, a in enumerate(self.node_time)]
            + [(f"node_mem[{i}] ({names[i]})", a) for i, a in enumerate(self.node_mem)]
            + [(f"edge_time[{e}]", a) for e, a in enumerate(self.edge_time)]
            + [(f"edge_mem[{e}]", a) for e, a in enumerate(self.edge_mem) if a is not None],
            bad,
        )
        if self.mem_cap_bytes is not None and not isinstance(self.mem_cap_bytes, (int, np.integer)):
            bad.append(f"mem_cap_bytes: expected an int or None, got {type(self.mem_cap_bytes).__name__}")
        if not isinstance(self.base_mem_bytes, (int, np.integer)):
            bad.append(f"base_mem_bytes: expected an int, got {type(self.base_mem_bytes).__name__}")
        if bad:
            more = f"\n  ... and {len(bad) - _MAX_BULLETS} more" if len(bad) > _MAX_BULLETS else ""
            raise ValueError(
                "SearchProblem is invalid:\n"
                + "\n".join(f"  - {b}" for b in bad[:_MAX_BULLETS])
                + more
                + "\nfix: give int64 arrays, node_time[i] of shape (k_i,), edge matrices of shape (k_u, k_v), "
                "edges with u < v"
            )
        raise AssertionError("SearchProblem: the fast checks rejected a problem the detailed ones accept")

    def _settle(self, names: tuple[str, ...], edges: tuple[tuple[int, int], ...]) -> None:
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "_ks", tuple(int(t.shape[0]) for t in self.node_time))
        object.__setattr__(self, "node_time", tuple(map(_readonly, self.node_time)))
        object.__setattr__(self, "node_mem", tuple(map(_readonly, self.node_mem)))
        object.__setattr__(self, "edge_time", tuple(map(_readonly, self.edge_time)))
        object.__setattr__(self, "edge_mem", tuple(None if a is None else _readonly(a) for a in self.edge_mem))
        cap = None if self.mem_cap_bytes is None else int(self.mem_cap_bytes)
        object.__setattr__(self, "mem_cap_bytes", cap)
        object.__setattr__(self, "base_mem_bytes", int(self.base_mem_bytes))

    @property
    def n_nodes(self) -> int:
        return len(self.names)

    @property
    def num_choices(self) -> tuple[int, ...]:
        """``k_i`` for every node."""
        return self._ks

    def with_cap(self, mem_cap_bytes: int | None) -> SearchProblem:
        """The same problem under another memory cap: the arrays (checked once) and what is
        derived from them (:meth:`memo`) are shared, so this costs O(1), not O(nodes)."""
        if not isinstance(mem_cap_bytes, (int, np.integer, type(None))):
            raise ValueError(f"mem_cap_bytes: expected an int or None, got {type(mem_cap_bytes).__name__}")
        other = object.__new__(SearchProblem)
        for name in self.__slots__:
            object.__setattr__(other, name, getattr(self, name))
        object.__setattr__(other, "mem_cap_bytes", None if mem_cap_bytes is None else int(mem_cap_bytes))
        return other

    def forget(self) -> None:
        """Drop what the solvers derived from the arrays (for this problem and its
        :meth:`with_cap` copies), keeping the problem's own indexes (:meth:`flat`,
        :meth:`edge_array`): the next solve starts cold, as a benchmark of a first plan wants."""
        for key in [k for k in self._memo if k not in _OWN]:
            del self._memo[key]

    @property
    def arrays_key(self) -> object:
        """A hashable token for this problem's arrays, the same for every :meth:`with_cap` copy of it: for keying
        what is derived from several problems (its own memo, unlike an ``id``, is never reused by another)."""
        return self.memo("arrays key", object)

    def memo_has(self, key: object) -> bool:
        """Whether :meth:`memo` holds ``key`` (built for this problem or a cap copy of it)."""
        return key in self._memo

    def memo(self, key: object, build: Callable[[], T]) -> T:
        """``build()``, once per key for this problem and every :meth:`with_cap` copy of it:
        for data that depends on the arrays and not on the cap."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def _check_choice(self, choice: tuple[int, ...] | list[int] | np.ndarray) -> tuple[int, ...]:
        arr = np.asarray(choice if isinstance(choice, np.ndarray) else list(choice), dtype=np.int64).reshape(-1)
        if arr.size != self.n_nodes:
            raise ValueError(
                f"choice has {arr.size} entries but the problem has {self.n_nodes} nodes; "
                "give one strategy index per node"
            )
        ks = self.num_choices
        c = tuple(arr.tolist())
        if ((arr >= 0) & (arr < self.memo("ks array", lambda: np.asarray(ks, np.int64)))).all():
            return c
        bad = [
            f"  - node {i} ({self.names[i]}): choice {c[i]} not in 0..{ks[i] - 1}"
            for i in range(len(c))
            if not 0 <= c[i] < ks[i]
        ]
        if bad:
            raise ValueError(
                "choice out of range:\n"
                + "\n".join(bad[:_MAX_BULLETS])
                + "\nfix: pick an index below k_i for every node"
            )
        return c

    def evaluate(self, choice: tuple[int, ...] | list[int] | np.ndarray) -> tuple[int, int]:
        """``(T(c), M(c))`` as exact Python ints (a forbidden choice gives ``T >= INF``)."""
        c = self._check_choice(choice)
        got = self.flat().evaluate(np.asarray(c, np.int64))
        if got is not None:
            return got[0], self.base_mem_bytes + got[1]
        return self._evaluate_slow(c)

    def flat(self) -> _Flat:
        """Every distinct array in one flat array, with each node's and edge's offset (built once)."""
        return self.memo("flat", lambda: _Flat(self))

    def edge_array(self) -> np.ndarray:
        """``edges`` as an (edges, 2) int64 array (built once)."""
        return self.memo("edge array", lambda: np.asarray(self.edges, np.int64).reshape(-1, 2))

    def _evaluate_slow(self, c: tuple[int, ...]) -> tuple[int, int]:
        """:meth:`evaluate` term by term in Python ints (the reference; forbidden entries)."""
        t = sum(int(self.node_time[i][c[i]]) for i in range(len(c)))
        m = self.base_mem_bytes + sum(int(self.node_mem[i][c[i]]) for i in range(len(c)))
        for e, (u, v) in enumerate(self.edges):
            t += int(self.edge_time[e][c[u], c[v]])
            em = self.edge_mem[e]
            if em is not None:
                m += int(em[c[u], c[v]])
        return t, m

    def forbidden_in(self, choice: tuple[int, ...] | list[int] | np.ndarray) -> list[str]:
        """Names of the forbidden choices/pairs (``INF`` time) that ``choice`` hits."""
        c = self._check_choice(choice)
        hits = [f"node {self.names[i]} choice {c[i]}" for i in range(len(c)) if self.node_time[i][c[i]] >= INF]
        hits += [
            f"edge {self.names[u]} -> {self.names[v]} pair ({c[u]}, {c[v]})"
            for e, (u, v) in enumerate(self.edges)
            if self.edge_time[e][c[u], c[v]] >= INF
        ]
        return hits

    def allowed_choices(self) -> list[np.ndarray]:
        """Per node, the strategies some forbidden-free plan may use: INF choices dropped,
        then arc consistency (a choice needs a non-INF partner on every edge).

        Raises :class:`InfeasibleError` when a node is left with nothing.
        """
        alive = [np.asarray(t < INF) for t in self.node_time]
        dead = [self.names[i] for i, a in enumerate(alive) if not a.any()]
        if dead:
            raise InfeasibleError(
                f"nodes {dead}: every strategy has INF time, so every plan is forbidden; fix: allow a strategy "
                "(e.g. replicate) for each"
            )
        ok = [np.asarray(t < INF) for t in self.edge_time]
        incident: list[list[int]] = [[] for _ in range(self.n_nodes)]
        for e, (u, v) in enumerate(self.edges):
            incident[u].append(e)
            incident[v].append(e)
        queue = list(range(len(self.edges)))
        queued = set(queue)
        while queue:
            e = queue.pop()
            queued.discard(e)
            u, v = self.edges[e]
            pairs = ok[e] & alive[u][:, None] & alive[v][None, :]
            for node, other, support in ((u, v, pairs.any(axis=1)), (v, u, pairs.any(axis=0))):
                if (alive[node] & ~support).any():
                    alive[node] = alive[node] & support
                    if not alive[node].any():
                        raise InfeasibleError(
                            f"node {self.names[node]}: no strategy has an allowed (non-INF) pair with the strategies "
                            f"left to {self.names[other]}, so every plan is forbidden; fix: allow a resharding "
                            "between them (or a strategy both accept)"
                        )
                    fresh = [f for f in incident[node] if f not in queued]
                    queued.update(fresh)
                    queue.extend(fresh)
        return [np.flatnonzero(a) for a in alive]

    def summary(self) -> str:
        ks = self.num_choices
        cap = "none" if self.mem_cap_bytes is None else f"{self.mem_cap_bytes} B"
        return (
            f"SearchProblem({self.n_nodes} nodes, {len(self.edges)} edges, k max {max(ks, default=0)}, "
            f"log10 assignments {sum(math.log10(k) for k in ks):.1f}, cap {cap})"
        )


class _Flat:
    """Every distinct cost array of a problem in one flat array, and where each node's and
    edge's entries start: :meth:`SearchProblem.evaluate` is then one gather and one sum."""

    def __init__(self, problem: SearchProblem) -> None:
        ks = np.array(problem.num_choices, np.int64)
        uv = np.array(problem.edges, np.int64).reshape(-1, 2)
        self.u, self.v, self.kv = uv[:, 0], uv[:, 1], ks[uv[:, 1]]
        self.t, (self.nt, self.et) = _flatten([problem.node_time, problem.edge_time])
        zero = np.zeros((1, 1), np.int64)  # edges without memory read entry (0, 0) of this
        edge_mem = [zero if a is None else a for a in problem.edge_mem]
        self.m, (self.nm, self.em) = _flatten([problem.node_mem, edge_mem])
        self.has_m = np.array([a is not None for a in problem.edge_mem], np.int64)

    def terms(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Choice ``c``'s time and memory terms, one per node and then one per edge (memory without the base)."""
        pair = c[self.u] * self.kv + c[self.v]
        t = np.concatenate([self.t[self.nt + c], self.t[self.et + pair]])
        m = np.concatenate([self.m[self.nm + c], self.m[self.em + pair * self.has_m]])
        return t, m

    def evaluate(self, c: np.ndarray) -> tuple[int, int] | None:
        """(T, M - base) for choice ``c``, or None when int64 might not hold the sums exactly
        (a forbidden entry, or values too large), for the caller's Python-int path."""
        return exact_sums(*self.terms(c))


def exact_sums(t: np.ndarray, m: np.ndarray) -> tuple[int, int] | None:
    """``(t.sum(), m.sum())`` as ints, or None where int64 might not hold them exactly (a forbidden
    entry, or values too large): the caller then sums in Python ints."""
    big = max(int(np.abs(t).max(initial=0)), int(np.abs(m).max(initial=0)))
    if big >= INF or big * (t.size + 1) >= 2**62:
        return None
    return int(t.sum()), int(m.sum())


def _flatten(groups: list) -> tuple[np.ndarray, list[np.ndarray]]:
    """One flat array of the distinct arrays (by identity) in ``groups``, and per group the
    offset of each member's first entry.  Equal offsets mean the same array: :mod:`.chain`
    compares repeated blocks by them."""
    members = [a for group in groups for a in group]
    if not members:
        return np.zeros(0, np.int64), [np.zeros(0, np.int64) for _ in groups]
    ids = np.fromiter(map(id, members), np.int64, len(members))  # CPython ids are addresses: fit int64
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    first_sorted = np.sort(first)  # distinct arrays in order of first use
    sizes = np.fromiter((members[i].size for i in first_sorted), np.int64, first_sorted.size)
    start = np.zeros(first_sorted.size, np.int64)
    np.cumsum(sizes[:-1], out=start[1:])
    at = start[np.argsort(np.argsort(first))]  # unique-id rank -> offset of that array
    off = at[inverse.reshape(-1)]
    flat = np.concatenate([members[i].reshape(-1) for i in first_sorted])
    bounds = np.cumsum([0] + [len(g) for g in groups])
    return flat, [off[bounds[j] : bounds[j + 1]] for j in range(len(groups))]


@dataclass(frozen=True, slots=True)
class Solution:
    """One assignment (``choice[i]`` indexes node i's strategies) with its exact cost."""

    choice: tuple[int, ...]
    time: int
    mem_bytes: int
    optimal: bool
    solver: str
    solve_s: float
    stats: dict = field(default_factory=dict)

    @property
    def time_lower_bound(self) -> int:
        """A proven lower bound on the optimum's time: the plan's own when it is optimal, else the search's
        ``stats["lower_bound"]`` (an approximate search's, or one stopped within its ``rel_gap``), else 0."""
        return self.time if self.optimal else int(self.stats.get("lower_bound", 0))


@dataclass(frozen=True, slots=True)
class Start:
    """Where one search starts from: ``above``, the time of a plan met already elsewhere (the chained search
    raises :class:`BeatenError` once its lower bound passes it), and ``seed``, a solution of the same problem
    at a coarser gap (its plan a plan met, its proven bound a lower bound: :func:`.chain.solve_chain`)."""

    above: int | None = None
    seed: Solution | None = None


class BeatenError(Exception):
    """The search stopped early: a lower bound proves no plan under the cap is faster than ``above`` (the
    objective, in picoseconds, of a plan the caller already has).  ``lower_bound_ps`` is that bound."""

    def __init__(self, lower_bound_ps: float, above: int) -> None:
        super().__init__(f"every plan takes at least {lower_bound_ps:.0f} ps, more than the {above} ps already met")
        self.lower_bound_ps = lower_bound_ps
        self.above = above


class InfeasibleError(ValueError):
    """No assignment meets the memory cap (or every assignment hits a forbidden entry).

    ``min_mem_bytes`` is the smallest reachable memory and ``min_mem_solution`` the
    assignment reaching it (ties broken by time); both ``None`` when every assignment
    is forbidden.  ``approximate``: the search that raised it was approximate (past the
    width budget, :mod:`.minibucket`): ``min_mem_bytes`` is the least memory of the plans
    it found, not necessarily the least there is, and the message says whether a bound
    proves that no plan fits or only that none was found.
    """

    def __init__(
        self,
        message: str,
        *,
        cap_bytes: int | None = None,
        min_mem_bytes: int | None = None,
        min_mem_solution: Solution | None = None,
        approximate: bool = False,
    ) -> None:
        super().__init__(message)
        self.cap_bytes = cap_bytes
        self.min_mem_bytes = min_mem_bytes
        self.min_mem_solution = min_mem_solution
        self.approximate = approximate

    @classmethod
    def over_cap(cls, problem: SearchProblem, min_mem: Solution) -> InfeasibleError:
        """``min_mem``: the least-memory plan; not ``optimal`` (an approximate search's) makes
        the error ``approximate`` and says the memory is the least found, not the least."""
        cap = problem.mem_cap_bytes
        if not min_mem.optimal:
            return cls(
                f"memory cap {cap} B per device: the approximate search (the problem is too wide to search "
                f"exactly) found no plan under it; the least-memory plan it found uses {min_mem.mem_bytes} B "
                f"(time {min_mem.time} ps), not proven least; fix: raise mem_cap_bytes, use more devices, or "
                "raise autopar.search.dp.WIDTH_BUDGET",
                cap_bytes=cap,
                min_mem_bytes=min_mem.mem_bytes,
                min_mem_solution=min_mem,
                approximate=True,
            )
        return cls(
            f"memory cap {cap} B per device is below the smallest reachable memory {min_mem.mem_bytes} B "
            f"(short by {min_mem.mem_bytes - (cap or 0)} B; that plan's time is {min_mem.time} ps); "
            "fix: raise mem_cap_bytes to at least the smallest reachable memory, use more devices, "
            "or add memory-saving strategies (activation checkpointing, sharded optimizer state)",
            cap_bytes=cap,
            min_mem_bytes=min_mem.mem_bytes,
            min_mem_solution=min_mem,
        )


def solve_brute_force(problem: SearchProblem, *, max_assignments: int = 2_000_000) -> Solution:
    """Enumerate every assignment: minimum time under the cap, ties broken by memory.

    The obviously-correct reference for tiny problems.  Raises :class:`InfeasibleError`
    (with the brute-force minimum memory) when nothing fits, ``ValueError`` when the
    problem has more than ``max_assignments`` assignments.
    """
    start = time.perf_counter()
    ks = problem.num_choices
    total = math.prod(ks)
    if total > max_assignments:
        raise ValueError(
            f"brute force over {problem.summary()}: {total} assignments > max_assignments={max_assignments}; "
            "use solve_dp"
        )
    best: tuple[int, int, tuple[int, ...]] | None = None
    least: tuple[int, int, tuple[int, ...]] | None = None
    cap = problem.mem_cap_bytes
    for c in itertools.product(*(range(k) for k in ks)):
        if problem.forbidden_in(c):
            continue
        t, m = problem.evaluate(c)
        if least is None or (m, t) < (least[1], least[0]):
            least = (t, m, c)
        if (cap is None or m <= cap) and (best is None or (t, m) < (best[0], best[1])):
            best = (t, m, c)
    elapsed = time.perf_counter() - start
    if least is None:
        raise InfeasibleError(
            f"{problem.summary()}: every assignment hits a forbidden (INF) choice or pair; fix the strategy lists"
        )
    if best is None:
        raise InfeasibleError.over_cap(problem, Solution(least[2], least[0], least[1], True, "brute", elapsed))
    return Solution(best[2], best[0], best[1], True, "brute", elapsed, {"assignments": total})
