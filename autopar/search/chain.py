"""Exact search over repeated blocks: one block solved once, chained by min-plus over Pareto sets.

Setting.  The problem's nodes split into blocks ``B_0 .. B_{L-1}`` (``blocks[i][j]`` is
node ``j`` of block ``i``) and the rest ``R``.  The *ports* are the positions ``j`` whose
node has an edge leaving its block; a *state* is the joint choice of a block's port
nodes (original strategy indices, raveled), ``K`` states in all.  Required structure,
checked by :func:`.split.split_blocks` (otherwise ``solve_chain`` solves flat with :func:`.dp.solve_dp`):

* an edge between blocks joins a port of ``B_i`` to ``B_{i+1}``;
* ``R`` nodes that feed ``B_1 .. B_{L-1}`` have one strategy (their edges fold into the
  block's unary costs); only ``B_{L-1}``'s ports feed ``R``;
* ``B_1 .. B_{L-1}``, with their folded costs and the edges from the previous ports, have
  equal tables (position by position), so one block table serves them all.

Factors (Pareto sets of (t, m) pairs per state pair; :func:`.pareto.pareto_pass` over a
:class:`.tables.PortTable`, the part's model with the port nodes kept)::

    F(a, b)    = Pareto over B_i's choices with ports in state b, of B_i's node and internal
                 edge costs plus the edges from the previous ports in state a       (i >= 1)
    Rest(y, z) = Pareto over R's and B_0's choices, B_0's ports in state y, of their costs,
                 the edges B_{L-1}'s ports (state z) -> R, and the base memory

Recurrence.  With ``n = L - 1`` and ``(A (x) B)(a, c) = Pareto U_b A(a, b) (+) B(b, c)``
(``(+)`` adds pairs: min-plus over Pareto sets, :func:`.segments.product`)::

    G = P_n,   P_1 = F,   P_l = P_(l//2) (x) P_(l - l//2)     (halving, one P per length: :func:`_power`)
    optimum = lexicographic min (t, m) over U_(y, z) Rest(y, z) (+) G(y, z), m <= cap   (:func:`_finish`)

Why it is exact.  T and M are sums over the parts, and once the port states are fixed
the parts share no variable, so every plan is one pair per factor and every choice of
pairs with matching states is a plan.  Replacing a part by one that dominates it at the
same states (t' <= t, m' <= m) gives a plan no worse in T and M, so Pareto filtering
keeps the optimum's (T, M); ``(x)`` is associative, so halving builds the same G.

Bounds (as in :mod:`.dp`: rows ``(w_t, w_m)``, pairs dropped past ``B`` = target / cap /
``target + lam cap``).  Per row, ``f`` and ``r`` are the min-sum tables of F and Rest::

    O_n(c, a) = r(a, c)                       (outside G: the rest, from B_{L-1}'s ports to B_0's)
    for P_l = P_x (x) P_y  (x = l//2, y = l - x), longest l first:
        O_x <- min(O_x, f^y (x) O_l)           (outside the left half: the right half, then P_l's outside)
        O_y <- min(O_y, O_l (x) f^x)           (outside the right half: P_l's outside, then the left half)

with ``f^l`` the min-sum of P_l (:meth:`.minsum.MinSumChain.fpow`, the same halving).  Each
use of a P_l is a half of a longer P whose outside is bounded by that P's ``O`` (by
induction from G, whose outside is exactly the rest), and the min-sum of the other half
bounds that half's pairs, so ``O_l(c, a)`` bounds from below what lies outside every use of
P_l; a pair of P_l at ``(a, c)`` goes when ``w (t, m) + O_l(c, a) > B``.  The block's table
(P_1 = F) is bounded by ``O_1``, the rest by ``f^n``.  The lengths are at most two per
level, so all of it is O(log n) min-plus products (:meth:`.minsum.MinSumChain.outside`).
Rows: time, memory, and when the cap binds the Lagrange slope lam*
(Eisner-Severance as :func:`.lagrange.lagrange_slope`).  Not the slopes around lam* that
:mod:`.dp` adds (``LAMBDA_GRID``): each row costs the chain's min-sum and outside values
again (linear in rows), and measured on GPT-shaped chains (24 and 96 layers, caps from the
free plan's memory down to the least; the Llama-7B recompute table) they cut too few pairs
to pay: every search ran faster without them, to the same plans.  Windows
(:func:`.pareto.pair_window`) skip the pairs of the second factor that the time and memory rows
already rule out.

Target: iterative deepening from the Lagrange bound (:mod:`.deepen`, which also holds how a search with a
gap merges near-equal pairs, and the rest bound).  A search that stops before it proves its plan (the deadline,
or within ``rel_gap``) returns the best of the plans met and their mixes (:mod:`.mixing`: the last blocks of a
faster plan over the cap laid onto one under it, priced exactly).

Without a cap, no pass.  The time row's min-sum is the optimum's time, exactly (int64 terms summed in float64
below 2^53); what is left is the tie-break by memory among the plans of that time, which the pass at target
``lb`` settled at the cost of an outside sweep of every part (two thirds of a 96-layer search on 4 x 8 x 8).
:meth:`.chain_tables.Chain.fastest_plan` settles it from the time row's decoding instead: where every least
value it took was reached once, its plan is the only fastest; where a part's choice tied but the port states
and the variants did not, every fastest plan has those states, so each tied part is re-solved alone at its
ports, lexicographically (least time, then least memory: :func:`.elimination.lexicographic`), with the nodes
decoded before its first tie held; where the states tied, the pass runs as before.

Lagrange rows.  lam* at a cap is found by Eisner-Severance from two plans that bracket
it; the chain keeps the plans every Lagrange row met (``Chain.hull``, across the caps of
the planner's peak loop), and a cap starts from the nearest of them, so a second cap
often needs one min-sum row; that row's min-sum joins the time and memory rows'
(:meth:`.minsum.MinSumChain.stacked`) instead of all three being solved again.

Variants (recomputation, per layer).  A block may take the terms of any of several
problems (``variants``), and B_0 with the rest those of more (``rest_variants``: the rest
of the graph recomputed too).  F is then the union of the variants' block tables and Rest
of theirs (Pareto per state pair; the min-sum rows the least), so the recurrence and the
proof above hold unchanged.  In a pass, a variant none of whose final entries can lie in a
plan within the target (each entry's lower bound, inside plus outside, above a row's
limit) is skipped whole (:func:`_variant_pass`): :func:`.pareto.pareto_pass` would drop
each of its pairs, so skipping it drops nothing a plan within the target can use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from .chain_tables import Chain
from .deadline import Deadline
from .deepen import PassSetup, RestBound, VariantBounds, deepen
from .dp import min_memory
from .minsum import MinSumChain
from .mixing import mixed_plan
from .pareto import tol
from .problem import BeatenError, InfeasibleError, SearchProblem, Solution, Start
from .split import ChainError

__all__ = ["Chain", "ChainError", "solve_chain"]  # Chain: chain_tables.py

logger = logging.getLogger(__name__)


# ---- the solver ---------------------------------------------------------------------------
def _lagrange_rows(chain: Chain, fast, small, cap: int, seen: list) -> tuple[float, MinSumChain]:
    """Eisner-Severance on the hull (as :func:`.lagrange.lagrange_slope`), with the chain's min-sum: lam* and
    its row's min-sum.  It starts from the plans adjacent to the cap among those any min-sum row of this chain
    met (``chain.hull``, kept across caps; ``fast`` over the cap, ``small`` under it, among them): any such
    pair brackets the cap, so the slope it converges to is lam* whichever it starts from, and the nearer the
    pair, the fewer rows (a second cap of the planner's peak loop often needs one)."""
    over = [p for p in chain.hull if p[1] > cap]
    under = [p for p in chain.hull if p[1] <= cap]
    fast = min([fast, *over], key=lambda p: (p[1], p[0]))  # the least memory over the cap
    small = min([small, *under], key=lambda p: (p[0], p[1]))  # the fastest under it
    seen.append(small)  # a plan under the cap: the first upper bound
    lam, row = 0.0, None
    for _ in range(64):
        lam = max(0.0, (small[0] - fast[0]) / max(fast[1] - small[1], 1))
        row = chain.minsum(np.array([[1.0, lam]]))
        p = chain.scalar_plans(row)[0]
        seen.append(p)
        chain.hull.append(p)
        line = fast[0] + lam * fast[1]
        if p[0] + lam * p[1] >= line - tol(line):
            break
        fast, small = (fast, p) if p[1] <= cap else (p, small)
    return lam, row


def solve_chain(
    problem: SearchProblem,
    blocks: list[list[int]],
    *,
    progress: Callable[[str, int, int], None] | None = None,
    start: Start | None = None,
    variants: tuple[SearchProblem, ...] = (),
    rest_variants: tuple[SearchProblem, ...] = (),
    rel_gap: float = 0.0,
    deadline: Deadline | None = None,
) -> Solution:
    """Minimum time under the memory cap (ties broken by memory), exactly, solving the
    repeated block once (see the module docstring).  ``start.above``: a time the caller has
    met already; when the lower bound proves every plan slower, :class:`BeatenError` instead
    of the exact pass.

    ``rel_gap`` > 0: stop deepening once the best plan met is proven within ``rel_gap`` of
    the optimum (``ub - lb <= rel_gap ub``, ``lb`` the Lagrange bound or the last target a
    pass found no plan under): then ``optimal=False`` and ``stats["lower_bound"]`` /
    ``stats["gap"]`` say how close, as :mod:`.minibucket`'s do.  0 (the default): exact.

    ``variants``: problems like ``problem`` (same nodes, strategies, edges and cap) whose
    blocks' terms are alternatives: each block (B_0 with the rest) takes the terms of
    the problem it picks, the nodes outside the blocks are priced alike in all, and an
    edge belongs to the node it enters.  The block table is then the union of the
    variants' (Pareto per state pair), the min-sum rows their least: the recurrence and
    its proof are unchanged.  ``Solution.stats["block_variants"]`` says which each block
    took (0: ``problem``).  ``rest_variants``: more problems B_0 with the rest may take
    (besides ``problem`` and ``variants``), whose terms outside the blocks differ too
    (the rest recomputed); blocks 1.. of each must be priced as in one of ``variants``
    (:class:`ChainError` otherwise).  The rest's table is the union over all of them, so
    the rest's choice and B_0's are made together; ``block_variants[0]`` indexes
    ``(problem, *variants, *rest_variants)``.

    ``deadline``: past it, no further pass starts and a pass under way is abandoned; the best plan met comes
    back with the proven bound (``optimal=False``, ``stats["budget_hit"]``, ``lower_bound`` and ``gap``).

    ``start.seed``: a solution of this same problem (same cap, strategies, variants), e.g. one a coarser ``rel_gap``
    returned: its plan is a plan met (the first upper bound, when under the cap) and its proven lower bound
    (``Solution.time_lower_bound``) a lower bound, so the passes start where it stopped rather than again from
    the Lagrange bound.

    ``blocks[i][j]``: node of position j in block i, blocks in chain order.  Raises
    :class:`ChainError` when the blocks do not chain (solve flat then), and
    :class:`InfeasibleError` as :func:`.dp.solve_dp` does.  ``progress(stage, done, total)``
    is called as the stages finish.
    """
    began = time.perf_counter()
    start = start or Start()
    above, seed = start.above, start.seed
    tick = progress or (lambda *_: None)
    # the block and rest tables and the time/memory min-sum do not depend on the cap: kept
    # with the problem's arrays, so another cap (SearchProblem.with_cap) starts from them
    keys = (tuple(v.arrays_key for v in variants), tuple(v.arrays_key for v in rest_variants))
    key = ("chain", tuple(map(tuple, blocks)), *keys)
    reused = problem.memo_has(key)
    chain = problem.memo(key, lambda: Chain(problem, blocks, variants, rest_variants))
    cap = problem.mem_cap_bytes
    tick("block tables", 1, 4)
    w, sc, seen = _bound_rows(chain, problem, blocks, variants, rest_variants)
    lb_seed = 0
    if seed is not None and (cap is None or seed.mem_bytes <= cap):
        picked = tuple(seed.stats.get("block_variants", (0,) * len(blocks)))
        seen.append((seed.time, seed.mem_bytes, tuple(seed.choice), picked))
        lb_seed = seed.time_lower_bound
    ub = min(p[0] for p in seen if cap is None or p[1] <= cap)
    tick("bounds", 2, 4)
    stats: dict = {"blocks": len(blocks), "block_nodes": len(blocks[0]), "states": chain.k, "rows": len(w)}
    stats["tables_reused"] = reused  # block/rest tables and the time/memory min-sum from an earlier cap
    stats["lagrange_ub"] = ub
    # lower bound: the min-sum of time, or of time + lam (M - cap) on a Lagrange row (weak duality)
    lb = max(float(sc.total[r]) - float(w[r, 1]) * (cap or 0) for r in range(len(w)) if w[r, 0] == 1.0)
    seeded = lb_seed > lb  # the seed's search proved more: the targets below its bound are spent
    lb = max(lb, float(lb_seed))  # both bound the optimum from below
    stats["lower_bound"] = lb
    if above is not None and lb > above + tol(above):
        raise BeatenError(lb, above)
    tick("exact pass", 3, 4)
    fastest = chain.fastest_plan() if cap is None else None  # ties broken without a pass (Chain.fastest_plan)
    if fastest is not None:
        found, pstats = [fastest], {"fastest_from_time_row": True}
    else:
        rest_bound = RestBound(chain, float(w[2, 1]), cap) if cap is not None and len(w) > 2 else None
        setup = PassSetup(chain, sc, _pass_bounds(chain, sc, w), cap, rest_bound, deadline, above)
        found, pstats = deepen(setup, lb, ub, rel_gap, seeded)
    stats.update(pstats, upper_bound=ub)
    cands = [p for p in seen if cap is None or p[1] <= cap] + found
    t, m, choice, picked = min(cands, key=lambda p: (p[0], p[1]))
    optimal = "proven_lower" not in pstats
    if pstats.get("budget_hit") and pstats["proven_lower"] >= t - tol(t):
        optimal = True  # the budget passed as the last pass proved it
    if not optimal and cap is not None:  # stopped early: the plans met and their mixes (.mixing)
        mixed = mixed_plan(chain, seen + found, cap)
        if mixed is not None and mixed[0] < t:
            stats["mixed_from"] = t  # the best plan met before mixing
            t, m, choice, picked = mixed
    if not optimal:  # stopped within rel_gap of the optimum: how close, as an approximate search says it
        stats.update(lower_bound=pstats["proven_lower"], gap=(t - pstats["proven_lower"]) / t)
    if variants or rest_variants:
        stats["block_variants"] = picked
    tick("done", 4, 4)
    elapsed = time.perf_counter() - began
    stats["solve_s"] = elapsed
    if logger.isEnabledFor(logging.INFO):  # the summary walks every node: only when it is printed
        msg = "solve_chain: %s, %d blocks, %d states -> (%d ps, %d B) in %.3fs"
        logger.info(msg, problem.summary(), len(blocks), chain.k, t, m, elapsed)
    return Solution(tuple(choice), t, m, optimal, "chain", elapsed, stats)


def _pass_bounds(chain: Chain, sc: MinSumChain, w: np.ndarray) -> tuple[list, list]:
    """What lies outside each part in a pass (:mod:`.deepen`): outside the block ``O_1``, outside the rest the
    chain's min-sum ``f^n``, per variant."""
    o1 = sc.outside()[1].transpose(0, 2, 1)
    return (
        [VariantBounds(t.model, w, sc.fv[j][0], t.from_grid(o1)) for j, t in enumerate(chain.ftabs)],
        [VariantBounds(t.model, w, sc.rv[j][0], t.from_grid(sc.power())) for j, t in enumerate(chain.rtabs)],
    )


def _bound_rows(
    chain: Chain, problem: SearchProblem, blocks: list[list[int]], variants: tuple, rest_variants: tuple
) -> tuple[np.ndarray, MinSumChain, list]:
    """The bound rows ``w`` (time; with a cap memory, and where the cap binds the Lagrange slope lam*), their
    min-sum, and the plans met on the way (``(T, M, choice, variant of each block)``; one under the cap among them).

    Raises :class:`InfeasibleError` when the memory row's min-sum (the exact least memory) is over the cap."""
    cap = problem.mem_cap_bytes
    if cap is None:  # no limit on memory: its row would bound nothing, the time row alone (half the min-sum)
        sc, seen = chain.time_row()
        return np.array([[1.0, 0.0]]), sc, list(seen)
    w = np.array([[1.0, 0.0], [0.0, 1.0]])
    sc, seen = chain.base()
    seen = list(seen)
    fast, small = seen
    if cap is not None and int(sc.total[1]) > cap:  # min-sum of memory is the exact least memory
        least = int(sc.total[1])
        least_plan = _least_memory(problem, blocks, least, small[1], variants, rest_variants)
        raise InfeasibleError.over_cap(problem, least_plan)
    if cap is not None and fast[1] > cap:
        if small[1] > cap:  # float ties in the memory row: take a plan that fits
            if variants or rest_variants:
                raise ChainError("the memory row's plan misses the cap by float ties: solve each variant alone")
            exact = min_memory(problem)
            small = (exact.time, exact.mem_bytes, exact.choice, (0,) * len(blocks))
            seen.append(small)
        lam, row = _lagrange_rows(chain, fast, small, cap, seen)
        # lam* only: the slopes around it (dp's LAMBDA_GRID) cost a min-sum row each here and cut few more pairs
        w = np.concatenate([w, [[1.0, lam]]])
        sc = sc.stacked(row)  # its plan is in seen already
    return w, sc, seen


def _least_memory(
    problem: SearchProblem,
    blocks: list[list[int]],
    least: int,
    reached: int,
    variants: tuple = (),
    rest_variants: tuple = (),
) -> Solution:
    """The least-memory plan, ties broken by time: the optimum under the cap ``least`` (the
    memory row's min-sum, exact in float64 below 2^53) when the memory row's plan reaches
    it (``reached``), so the chain answers in a pass; else :func:`.dp.min_memory` (flat)."""
    if least == reached and least < 2**53:
        return solve_chain(problem.with_cap(least), blocks, variants=variants, rest_variants=rest_variants)
    if variants or rest_variants:
        raise ChainError("the least memory is not the memory row's plan's: solve each variant alone")
    return min_memory(problem)
