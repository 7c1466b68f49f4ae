"""The chain's tables: one problem's repeated blocks as port tables, their min-sum rows, and plans from them.

:class:`Chain` is what :mod:`.chain` (the solver) and :mod:`.deepen` (its passes) share: the problem
split into ``B_0`` with the rest and ``n`` blocks joined through ``k`` port states (``split.py``), a
``PortTable`` per part and variant (``tables.py``), min-sum rows over them (``minsum.py``), and the
plan of each row assembled back onto the whole problem.  It holds no search policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .minsum import MinSumChain
from .problem import INF, InfeasibleError, SearchProblem, exact_sums
from .split import ChainError, split_blocks
from .tables import PortTable

__all__ = ["BLOCK_WIDTH_BUDGET", "Chain"]

#: Cells per weight row of the widest joint table a chain part's elimination may form; past it the blocks do not
#: chain (:class:`.split.ChainError`: the planner solves flat).  Wider than the flat search's ``dp.WIDTH_BUDGET``:
#: the block table is built once for every layer (not once per layer), and its min-sum passes run in slices
#: (:data:`.elimination.SLICE_CELLS`), so the width costs time, not memory.  Three-axis meshes need it: on 4 x 8 x 8
#: the hidden state between GPT-shaped layers has 511 placements and the block's widest joint 511 x 511 x 372 =
#: 9.7e7 cells (96 layers, 2026-11-27: the exact chain in 11-13 s and 1 GiB, its plan's searched step 0.355 s,
#: where the flat approximate search took 88 s to a plan of 2.49 s).  Read at each call: tests lower it.
BLOCK_WIDTH_BUDGET = 2**27


class Chain:
    """The chain of one problem (and its variants): the block and rest tables over the port states, the
    min-sum rows built from them, and what the caps of one peak loop share (the Lagrange hull, the rest
    bound's rows)."""

    def __init__(
        self, problem: SearchProblem, blocks: list[list[int]], variants: tuple = (), rest_variants: tuple = ()
    ) -> None:
        self.problem, self.blocks, self.problems = problem, blocks, (problem, *variants)
        self.rproblems = (*self.problems, *rest_variants)  # what B_0 with the rest may take
        # a problem's split and tables depend on its arrays and the blocks only: kept with the problem, so a
        # chain over other variants of the same problems (the planner's probe without variants) shares them
        key = tuple(map(tuple, blocks))
        splits = [p.memo(("split", key), lambda p=p: split_blocks(p, blocks)) for p in self.rproblems]
        _, _, self.k, self.port = splits[0]
        if any(s[2:] != splits[0][2:] for s in splits):
            raise ChainError("the variants' blocks have different ports")
        blocks_of = [s[0].problem for s in splits[: len(self.problems)]]
        for j, s in enumerate(splits[len(self.problems) :]):
            if not any(_same_terms(s[0].problem, f) for f in blocks_of):
                raise ChainError(f"rest variant {j} changes the terms of blocks 1.. (only the rest and B_0 may)")
        self.n = len(blocks) - 1
        self.ftabs = [
            p.memo(("block table", key), lambda s=s: PortTable(s[0], self.k, BLOCK_WIDTH_BUDGET))
            for p, s in zip(self.problems, splits)
        ]
        self.rtabs = [
            p.memo(("rest table", key), lambda s=s: PortTable(s[1], self.k, BLOCK_WIDTH_BUDGET))
            for p, s in zip(self.rproblems, splits)
        ]
        self.ftab, self.rtab = self.ftabs[0], self.rtabs[0]  # the parts' node maps (alike in every variant)
        self._where: tuple[np.ndarray, np.ndarray] | None = None  # assemble's scatter, built on first use
        self._time: tuple | None = None
        self._base: tuple | None = None
        self.hull: list = []  # plans of the Lagrange rows, every cap's (their (T, M) lie on the hull)
        self.rest_rows: dict = {}  # slope step j (None: 0) -> f^n of the row (1, 2^(j/2)): the rest bound's rows

    def minsum(self, w: np.ndarray) -> MinSumChain:
        return MinSumChain(self.ftabs, self.rtabs, self.n, w)

    def time_row(self) -> tuple[MinSumChain, list]:
        """The min-sum of the time row and its plan (built once): without a cap, all the bounds need."""
        return self._time_row()[:2]

    def _time_sums_exact(self) -> bool:
        """Whether float64 holds every sum of finite time terms a plan can form exactly: the rest's and ``n``
        blocks' largest finite ``|t|`` per factor table, summed, below 2^53 (int64 terms; a sum with a forbidden
        entry is past ``INF`` less that, far above every finite one)."""

        def most(tab: PortTable) -> float:
            model = tab.model
            return sum(float(np.abs(np.where(ok & (t < INF), t, 0)).max(initial=0)) for t, ok in zip(model.t, model.ok))

        return max(map(most, self.rtabs)) + self.n * max(map(most, self.ftabs)) < 2.0**53

    def _time_row(self) -> tuple[MinSumChain, list, _Decoded]:
        if self._time is None:
            sc = self.minsum(np.array([[1.0, 0.0]]))
            decoded = self._decoded(sc, 0)
            self._time = (sc, [self._assembled(decoded.rest, decoded.blocks, decoded)], decoded)
        return self._time

    def base(self) -> tuple[MinSumChain, list]:
        """The min-sum of the time and the memory rows, and their plans (built once; the time row's is
        :meth:`time_row`'s)."""
        if self._base is None:
            time_sc, time_plans = self.time_row()
            memory = self.minsum(np.array([[0.0, 1.0]]))
            self._base = (time_sc.stacked(memory), [*time_plans, *self.scalar_plans(memory)])
        return self._base

    def evaluate(self, choice: tuple[int, ...], variants: tuple[int, ...]) -> tuple[int, int]:
        """``(T, M)`` of a plan whose block i >= 1 takes ``variants[i]`` and whose rest, with B_0, takes
        ``rproblems[variants[0]]``: each node's and each edge's terms from its part's variant (an edge belongs
        to the node it enters)."""
        if len(self.rproblems) == 1 or not any(variants):
            return self.problem.evaluate(choice)
        owner = np.full(self.problem.n_nodes, variants[0], np.int64)
        for b, j in zip(self.blocks[1:], variants[1:]):
            owner[b] = j
        ps = self.rproblems
        # each term from its owner's problem (gathered by its flat index); summed in int64 where that is exact,
        # else in Python ints (a forbidden entry: T >= INF, as SearchProblem.evaluate gives it)
        owners = np.concatenate([owner, owner[self.problem.edge_array()[:, 1]]])
        c = np.asarray(choice, np.int64)
        t, m = np.empty(owners.size, np.int64), np.empty(owners.size, np.int64)
        for j in np.unique(owners).tolist():
            tj, mj = ps[j].flat().terms(c)
            mine = owners == j
            t[mine], m[mine] = tj[mine], mj[mine]
        sums = exact_sums(t, m) or (sum(t.tolist()), sum(m.tolist()))
        return sums[0], self.problem.base_mem_bytes + sums[1]

    def assemble(
        self, rest_choice: tuple[int, ...], distinct: list[tuple[int, ...]], which: np.ndarray
    ) -> tuple[int, ...]:
        """The full choice vector from the rest's choice and the blocks': block ``i + 1``
        takes the block choice ``distinct[which[i]]``.  Blocks between equal states choose
        alike, so the few distinct block choices are built in Python and laid onto every
        block in one scatter (``targets[i]``: block ``i + 1``'s nodes, ``subs``: their
        places in F's choice vector)."""
        if self._where is None:
            pos = {v: j for j, v in enumerate(self.blocks[1])}
            subs = [sub for sub, full in enumerate(self.ftab.part.nodes) if full >= 0]
            at = np.array([pos[self.ftab.part.nodes[sub]] for sub in subs], np.int64)
            self._where = (np.array(subs, np.int64), np.array(self.blocks[1:], np.int64)[:, at])
        subs, targets = self._where
        choice = np.zeros(self.problem.n_nodes, np.int64)
        choice[list(self.rtab.part.nodes)] = rest_choice
        choice[targets] = np.array(distinct, np.int64)[:, subs][which]
        return tuple(choice.tolist())

    def scalar_plans(self, sc: MinSumChain) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
        """Each row's min-sum plan: ``(T, M, choice, variant of each block)``."""
        return [self.scalar_plan(sc, row) for row in range(len(sc.w))]

    def scalar_plan(self, sc: MinSumChain, row: int) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
        """Row ``row``'s min-sum plan ``(T, M, choice, variant of each block)``."""
        d = self._decoded(sc, row)
        return self._assembled(d.rest, d.blocks, d)

    def _decoded(self, sc: MinSumChain, row: int) -> _Decoded:
        """Row ``row``'s min-sum plan, part by part, and where its decoding met ties (:class:`_Decoded`)."""
        k = self.k
        if not np.isfinite(sc.total[row]):
            raise InfeasibleError(f"{self.problem.summary()}: every plan hits a forbidden (INF) choice or pair")
        states, once = sc.unique_states(row)
        st = np.asarray(states, np.int64)
        j = int(sc.rsel[row, st[0], st[-1]])
        once &= not sc.rtied[row, st[0], st[-1]]
        rest_pair = int(st[0] * k + st[-1])
        rest, rest_alike = self.rtabs[j].unique_argmin_choice(sc.rv[j][0], row, rest_pair)
        # blocks between equal states choose alike: one argmin walk per distinct state pair
        pairs, which = np.unique(st[:-1] * k + st[1:], return_inverse=True)
        picks = [int(sc.fsel[row, p // k, p % k]) for p in pairs.tolist()]
        once &= not any(sc.ftied[row, p // k, p % k] for p in pairs.tolist())
        blocks = [self.ftabs[v].unique_argmin_choice(sc.fv[v][0], row, int(p)) for p, v in zip(pairs, picks)]
        alike = [a for _, a in blocks]
        return _Decoded(
            j, rest_pair, rest, rest_alike, pairs.tolist(), picks, which, [c for c, _ in blocks], alike, once
        )

    def _assembled(self, rest: tuple[int, ...], blocks: list[tuple[int, ...]], d: _Decoded) -> tuple:
        choice = self.assemble(rest, blocks, d.which)
        variants = (d.rest_variant, *(d.picks[w] for w in d.which.tolist()))
        return (*self.evaluate(choice, variants), choice, variants)

    def fastest_plan(self) -> tuple | None:
        """The plan of least time, ties broken by memory, from the time row without a pass: its plan where that is
        the only fastest (:meth:`scalar_plan`), else with each part whose choice tied re-solved at its port states
        (:meth:`.tables.PortTable.fastest_choice`, the nodes decoded before its first tie held).  That is exact
        where the port states and each part's variant were reached once: every fastest plan then has them, each
        part at its least time given its ports, so the least memory among them is each part's least at its least
        time.  None where they tied, or where float64 may not hold the row's sums (:meth:`_time_sums_exact`)."""
        if not self._time_sums_exact():
            return None
        _, (plan,), d = self._time_row()  # the row's plan and its decoding, ties marked
        if not d.states_once:
            return None
        if d.rest_alike is None and all(a is None for a in d.blocks_alike):
            return plan
        rest = d.rest if d.rest_alike is None else self.rtabs[d.rest_variant].fastest_choice(d.rest_pair, d.rest_alike)
        blocks = [
            choice if alike is None else self.ftabs[v].fastest_choice(p, alike)
            for choice, alike, p, v in zip(d.blocks, d.blocks_alike, d.pairs, d.picks)
        ]
        held = self._assembled(rest, blocks, d)
        return held if held[:2] <= plan[:2] else None  # no slower (the time row's least) and no larger


@dataclass
class _Decoded:
    """A min-sum plan decoded part by part (:meth:`Chain._decoded`): the rest's variant, port state pair and
    choice, and None where that choice was its part's only least (else what every least of it chooses alike,
    :meth:`.tables.PortTable.unique_argmin_choice`); the distinct state pairs of the blocks, each one's variant,
    choice and likewise; which pair each block ``1..`` takes; and whether the port states and every part's variant
    were reached once."""

    rest_variant: int
    rest_pair: int
    rest: tuple[int, ...]
    rest_alike: dict[int, int] | None
    pairs: list[int]
    picks: list[int]
    which: np.ndarray
    blocks: list[tuple[int, ...]]
    blocks_alike: list[dict[int, int] | None]
    states_once: bool


def _same_terms(a: SearchProblem, b: SearchProblem) -> bool:
    """Whether two parts have the same nodes, edges and terms (arrays compared by value; None as zeros)."""
    if a.edges != b.edges or a.num_choices != b.num_choices:
        return False

    def same(x, y) -> bool:
        if x is y:
            return True
        x = np.zeros_like(y) if x is None else x
        y = np.zeros_like(x) if y is None else y
        return np.array_equal(x, y)

    pairs = zip((a.node_time, a.node_mem, a.edge_time, a.edge_mem), (b.node_time, b.node_mem, b.edge_time, b.edge_mem))
    return all(same(x, y) for xs, ys in pairs for x, y in zip(xs, ys, strict=True))
