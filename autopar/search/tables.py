"""A chain part's table over its port states: the part eliminated down to its ports, on the K x K state grid.

:mod:`.chain` cuts the problem into the repeated block F and the rest (:func:`.split.split_blocks`,
each a :class:`.split.Part` with its left and right port nodes).  A :class:`PortTable` builds
the part's elimination model with the port nodes kept
(``EliminationModel(keep=left + right)``), so its final table is over them, and maps each
entry of that final table to its state pair::

    state(a, b) = a * K + b,   a = ravel(left ports' choices),  b = ravel(right ports' choices)

(:meth:`PortTable.to_grid` / :meth:`PortTable.from_grid`, ``inf`` where a pair has no
entry).  It also decodes plans: from min-sum inside values (:meth:`PortTable.argmin_choice`,
for :mod:`.minsum`) and from Pareto tables (:meth:`PortTable.pareto_choice`, for
:func:`.pareto.pareto_pass`'s back-pointers), with the ports set for a state pair.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .elimination import EliminationModel, decode_lexicographic, decode_unique, lexicographic
from .split import Part

__all__ = ["PortTable"]


class PortTable:
    """A part eliminated down to its port nodes: per (left state, right state) entry."""

    def __init__(self, part: Part, k_states: int, width_budget: int) -> None:
        """``width_budget``: a wider elimination raises :class:`.ChainError` (:mod:`.chain`
        passes ``dp.WIDTH_BUDGET``)."""
        self.part = part
        self.width_budget = width_budget
        self.model = EliminationModel(part.problem, keep=frozenset(part.left + part.right), width_budget=width_budget)
        model, k = self.model, self.model.k
        scope = model.steps[-1].scope
        self.shape = tuple(k[v] for v in scope)
        coords = np.unravel_index(np.arange(math.prod(self.shape)), self.shape) if scope else ()
        full = {v: np.full(coords[0].size if scope else 1, model.allowed[v][0]) for v in part.left + part.right}
        for v, c in zip(scope, coords):
            full[v] = model.allowed[v][c]
        ks = part.problem.num_choices
        a = np.ravel_multi_index(tuple(full[v] for v in part.left), tuple(ks[v] for v in part.left))
        b = np.ravel_multi_index(tuple(full[v] for v in part.right), tuple(ks[v] for v in part.right))
        self.grid = np.asarray(a * k_states + b, np.int64).reshape(-1)  # final entry -> state pair
        self.k_states = k_states

    def to_grid(self, vals: np.ndarray) -> np.ndarray:
        """(rows, *final scope) -> (rows, K, K), inf where no entry."""
        rows = vals.shape[0]
        out = np.full((rows, self.k_states * self.k_states), np.inf)
        out[:, self.grid] = vals.reshape(rows, -1)
        return out.reshape(rows, self.k_states, self.k_states)

    def from_grid(self, grid: np.ndarray) -> np.ndarray:
        rows = grid.shape[0]
        return grid.reshape(rows, -1)[:, self.grid].reshape((rows,) + self.shape)

    def reduced(self, state_pair: int) -> np.ndarray:
        """The model's reduced choice vector with the kept nodes set for a state pair."""
        red = np.zeros(len(self.model.k), np.int64)
        e = int(np.flatnonzero(self.grid == state_pair)[0])
        if self.shape:
            for v, c in zip(self.model.steps[-1].scope, np.unravel_index(e, self.shape)):
                red[v] = c
        return red

    def argmin_choice(self, vals: list, row: int, state_pair: int) -> tuple[int, ...]:
        """Row ``row``'s min-sum plan of the part with the ports at ``state_pair``, decoded from the inside
        values (:func:`.elimination.inside` without argmins) in reverse elimination order
        (:func:`.elimination.decode`: the same sums, so the same argmins as the joint tables')."""
        return self.unique_argmin_choice(vals, row, state_pair)[0]

    def unique_argmin_choice(
        self, vals: list, row: int, state_pair: int
    ) -> tuple[tuple[int, ...], dict[int, int] | None]:
        """:meth:`argmin_choice`, and None where it is the part's only plan of least value at ``state_pair``, else
        the nodes every such plan chooses alike with their choices (reduced indices; :func:`.elimination.
        decode_unique`: every line's least taken once, the model without mini-buckets; exact where the row's sums
        are), for :meth:`fastest_choice`."""
        one = [None if v is None else v[row : row + 1] for v in vals]
        red, forced, unique = decode_unique(self.model, one, self.reduced(state_pair)[None, :])
        choice = self.model.original_choice(red[0])
        if unique and self.model.whole_buckets:
            return choice, None
        return choice, {v: int(red[0, v]) for v in forced} if self.model.whole_buckets else {}

    def fastest_choice(self, state_pair: int, alike: dict[int, int]) -> tuple[int, ...]:
        """The part's plan of least time with the ports at ``state_pair``, ties broken by memory, exactly
        (:func:`.elimination.lexicographic`), where every plan of least time chooses as ``alike`` says (reduced
        choices per node; :meth:`unique_argmin_choice`).  Over the part's problem with the ports and those nodes
        held to their choice, in the domains this table's pruning left: still exact, as a pruned strategy's
        dominator stays and the ports are never pruned (:mod:`.prune`), so every plan of the held problem has one no
        slower and no larger in these domains."""
        red, model = self.reduced(state_pair), self.model
        held = dataclasses.replace(self.part.problem, mem_cap_bytes=None)  # its own memo: the held domains
        at = {v: int(red[v]) for v in self.part.left + self.part.right} | alike
        domains = [a[at[v] : at[v] + 1] if v in at else a for v, a in enumerate(model.allowed)]
        held.memo(("allowed", frozenset()), lambda: domains)
        small = EliminationModel(held, width_budget=self.width_budget)
        t_vals, m_vals = lexicographic(small)
        red = decode_lexicographic(small, t_vals, m_vals, np.zeros((1, len(small.k)), np.int64))
        return small.original_choice(red[0])

    def pareto_choice(self, tabs: list, pair: int, state_pair: int) -> tuple[int, ...]:
        red = self.reduced(state_pair)
        stack = [(self.model.final, pair)]
        while stack:
            tid, p = stack.pop()
            st, tab = self.model.step_of[tid], tabs[tid]
            if st.var >= 0:
                red[st.var] = tab.xs[p]
            stack.extend((kid, int(tab.bp[p, j])) for j, kid in enumerate(st.inputs) if kid >= self.model.n_orig)
        return self.model.original_choice(red)
