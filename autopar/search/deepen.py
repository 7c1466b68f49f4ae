"""The chained search's passes under a target, and the deepening that raises the target until the optimum is in.

:mod:`.chain` sets the problem up (the block and rest tables, the min-sum rows, the Lagrange slope, a first
plan under the cap) and hands it here: :func:`deepen` runs passes (:func:`_pass`) with rising targets; a pass
builds the rest's Pareto pairs, the block's, their chain ``F^(x)n`` by halving (:func:`_power`), and the best
plan of the two under the cap (:func:`_finish`).

Target: iterative deepening (:func:`deepen`).  ``lb`` is the Lagrange lower bound
(``min T + lam (M - cap)``, weak duality) and ``ub`` the best plan met (the min-sum plans
of the rows).  A pass with target ``T`` keeps every pair that some plan with time <= T
and memory <= cap can use, so

* it returns the optimum whenever the optimum is <= T, and
* it returns no plan with time <= T only when there is none (it may return a slower
  plan: the rest's pairs join the chain's unpruned in :func:`_finish`; kept, no proof).

The pass's cost grows steeply with ``T - lb`` (pruning is by ``T``), so the targets go up
from ``lb``: ``lb + s`` with the slack ``s = (ub - lb) 2^-12`` doubling each pass, and the
first pass that finds a plan within its target ends the search (a plan found above it
lowers ``ub``); the last target is ``ub`` itself, where "nothing" proves the plan met
optimal.  The last pass's slack is at most twice the optimum's ``T* - lb``, and a pass
with less slack prunes more, so the failed passes before it typically cost less than it
(96 layers at a 20 GiB cap: 4 passes, 2.4 s in all).  Every pass is exact for its
target: no heuristic, no thinning.

Gap (``rel_gap``, the planner's ``PLAN_GAP``).  A pass that returns no plan within its
target ``T`` proves the optimum above ``T``, so the proven bound ``p`` rises to it; the
passes stop once ``ub - p <= rel_gap ub``, and no target goes past ``ub (1 - rel_gap)``,
where a pass ends the search either way.  Where many plans lie within a hair of the
optimum (per-layer mixes of recomputation, whose (T, M) differ by a few layers' worth),
proving the last 2^-12 was most of the search (96 layers at a 15.8 GB cap: the last
two passes, 1.4 s and 3.4 s, of 6.7 s); with the gap the same plan came in 1.8 s.

Merging (with a gap: ``rel_gap`` > 0).  Many plans lie close to the optimum where the layers trade time for
memory at one rate (each layer's choices, and the cap's price lam*, agree), and a pass near the target carries
them all: thousands of pairs per state pair, in every product.  The gap allows losing a little time, so a pass
that may spend ``E`` (``_MERGE_SHARE`` of the gap at its target) merges: the product of length ``l`` keeps,
per state pair and time cell ``floor(t / step_l)``, only the pair with the least memory
(:func:`.segments.merge_keep`).  A pair dropped is stood for by one with no more memory and less than
``step_l`` more time, so by induction over the halving every pair of ``P_l`` has a kept pair with no more
memory and at most ``err_l`` more time, ``err_l = err_(l//2) + err_(l - l//2) + step_l - 1``; with
``step_l = E l / S(n)`` (``S``: :func:`_merge_weights`, the lengths of the products below with repeats),
``err_n <= E``.  ``P_l`` is pruned against its limits widened by ``err_l`` on the rows that weigh time, so
what stands for a pair within the target is kept.  Hence: if the optimum is within the target, the pass
returns a plan within ``err_n`` of it (memory exact, under the cap); if the pass returns nothing within
``T + err_n``, the optimum is above ``T``.  The proven bound after a pass is therefore ``T`` (nothing found
within ``T + err_n``) or ``min(T, found - err_n)``, and the passes stop once ``ub - proven <= rel_gap ub``,
as without merging.  A pass merges only while the gap is open by more than the float slack; the exact search
(``rel_gap`` 0) never merges.  The cells hold at most ``range / step`` pairs per state pair, so a product's
work no longer grows with how many near-equal plans there are.

Beaten (``PassSetup.above``: the time of a plan the caller met already, another mesh's or another candidate's).
The targets never pass ``above`` while the best plan met is slower than it, and once a pass at ``above`` finds
no plan within it the optimum is above it: :class:`.problem.BeatenError` with the proven bound, and the passes
towards this search's own optimum (what the exact search spends most on when two candidates lie within a few
tenths of a percent) are not run.  Exact: only a plan no faster than one in hand is left unproven.

Rest bound.  The Lagrange bound averages the rest's choices, which are few and far apart (an output gathered
to every rank or kept sharded, a loss computed whole or split): where the cap falls between two of them it can
lie far below the optimum (10% on a GPT-2 1.7B whose logits leave the model), and every pass below the
optimum then costs a full chain.  :class:`RestBound` keeps the rest exact and relaxes only the chain: a pass
builds the rest's Pareto pairs first, bounds each (the rest's pair plus the chain's min-sum at slopes around
lam*, the best slope per pair), and drops those bounded above the target; with none left the pass ends
without building the chain (no plan within the target), and otherwise the least bound of those kept rises the
proven bound (every plan within the target is at least that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .deadline import Deadline, OutOfTime
from .minsum import MinSumChain, halving
from .pareto import Bounds, ParetoTable, min_sum_bounds, pareto_pass, proven_within, row_limits, tol
from .problem import INF, BeatenError
from .segments import Seg, leaf_segment, product
from .tables import PortTable

if TYPE_CHECKING:
    from .chain_tables import Chain

__all__ = ["PassSetup", "RestBound", "VariantBounds", "deepen"]

_DEEPEN_FIRST = 2.0**-12  # first target lb + (ub - lb) x this, then the slack doubles (:func:`deepen`)
_FEW_PAIRS, _DEEPEN_FAST = 16, 8  # ... or grows 8x after a pass whose chain kept at most 16 pairs
#: slopes of the rest bound (:class:`RestBound`): 0, and the Lagrange slope times 2^-4 .. 2^4 in steps of 2^0.5
_REST_SPAN = 8
_MERGE_SHARE = 0.75  # of the gap a pass may spend merging pairs (module docstring, Merging)
_CHUNK_PAIRS = 1 << 16  # rest pairs bounded at once (:class:`RestBound`)


def _expand(seg: Seg, a: int, c: int, pair: int) -> list[tuple[int, int, int]]:
    """(in state, out state, leaf pair) per block of a segment's pair, in chain order.

    A pair of a product splits into a pair of each half (``bp``); the blocks a pair stands
    for depend on (segment, a, c, pair) only, so each distinct one is split once and its
    list reused: the Python work is per distinct (segment, a, c, pair), about one per length
    of the halving when the plan repeats itself, and only the list joins are per block."""
    memo: dict[tuple[int, int, int, int], list[tuple[int, int, int]]] = {}

    def walk(s: Seg, a: int, c: int, p: int) -> list[tuple[int, int, int]]:
        if s.halves is None:
            return [(a, c, int(s.leaf[p]))]
        key = (id(s), a, c, p)
        if key not in memo:
            mid, pa, pb = (int(x) for x in s.bp[p])
            memo[key] = walk(s.halves[0], a, mid, pa) + walk(s.halves[1], mid, c, pb)
        return memo[key]

    return walk(seg, a, c, pair)


class RestBound:
    """A lower bound on every plan through a rest pair that keeps the rest exact and relaxes only the chain
    (module docstring, Rest bound): for a rest pair ``r`` (state pair ``e``) and lam >= 0,

        T >= t_r + f^n_lam(e) + lam (m_r - cap)

    since the chain's plans with ``m_chain <= cap - m_r`` have ``t_chain >= f^n_lam(e) - lam (cap - m_r)``.
    The max over the slopes (0, and ``2^(j/2)`` within :data:`_REST_SPAN` steps of the Lagrange slope) bounds
    each pair; the least
    over the rest's Pareto pairs bounds every plan (the bound rises with ``t_r`` and ``m_r``).  Unlike the
    Lagrange bound it does not average the rest's choices, which are few and far apart (an output gathered or
    not, a loss sharded or not): where those set the plan, it is the tighter."""

    def __init__(self, chain: Chain, lam: float, cap: int) -> None:
        # slopes on a fixed grid of powers of 2^(1/2), so the caps of a peak loop (each its own lam) share rows
        at = round(2 * np.log2(lam)) if lam > 0 else 0
        steps = [at + j for j in range(-_REST_SPAN, _REST_SPAN + 1)]
        missing = [j for j in steps if j not in chain.rest_rows]
        if missing:
            w = np.array([[1.0, 2.0 ** (j / 2)] for j in missing])
            fn = chain.minsum(w).power().reshape(len(w), -1)
            chain.rest_rows.update(zip(missing, fn))
        if None not in chain.rest_rows:  # slope 0: the time row
            chain.rest_rows[None] = chain.time_row()[0].power()[0].reshape(-1)
        self.slopes = np.array([0.0] + [2.0 ** (j / 2) for j in steps])
        self.fn = np.stack([chain.rest_rows[None]] + [chain.rest_rows[j] for j in steps])
        self.cap = cap

    def per_pair(self, rest: Seg) -> np.ndarray:
        """The bound of each of the segment's pairs."""
        entry = np.repeat(np.arange(rest.off.size - 1), np.diff(rest.off))
        out = np.full(rest.t.size, -np.inf)
        for lo in range(0, rest.t.size, _CHUNK_PAIRS):  # (slopes, pairs) at most _CHUNK_PAIRS wide
            at = slice(lo, lo + _CHUNK_PAIRS)
            terms = rest.t[None, at] + self.fn[:, entry[at]] + self.slopes[:, None] * (rest.m[at] - self.cap)[None, :]
            out[at] = terms.max(axis=0)
        return out


@dataclass(frozen=True, slots=True)
class PassSetup:
    """What every pass of one search shares: the chain, its min-sum rows ``sc`` (time, memory and maybe the
    Lagrange row: the bound rows' weights ``sc.w``), the tables' bounds ``(block's, rest's)`` (a
    :class:`VariantBounds` per variant: outside the block ``O_1``, outside the rest ``f^n``), the memory cap,
    the rest bound (:class:`RestBound`; None: the rest's pairs are not bounded first), the deadline, and
    ``above``: a time the caller has met already (``Start.above``; module docstring, Beaten)."""

    chain: Chain
    sc: MinSumChain
    bounds: tuple
    cap: int | None
    rest_bound: RestBound | None = None
    deadline: Deadline | None = None
    above: int | None = None


def deepen(setup: PassSetup, lb: float, ub: int, rel_gap: float = 0.0, seeded: bool = False) -> tuple[list, dict]:
    """Plans met by passes with rising targets (module docstring, Target): the last is the
    optimum, unless the best plan met before (time ``ub``) is.  A pass may also return a
    plan slower than its target (the rest's pairs join unpruned in :func:`_finish`): a real
    plan under the cap, kept (it lowers ``ub``), but no proof.

    A pass that returns no plan within its target proves the optimum above it (a pass
    returns the optimum whenever it is within the target), so ``proven`` rises to that
    target.  With ``rel_gap`` > 0 the passes stop once ``ub - proven <= rel_gap ub``
    (``stats["proven_lower"]`` is then ``proven``); the targets still rise from ``lb`` as
    in the exact search, but never past ``ub (1 - rel_gap)``: a pass with that target ends
    the search (it finds the optimum, or proves the gap closed).  Past ``setup.deadline`` the passes stop, and
    ``proven_lower`` is what they proved (``budget_hit``).  ``seeded``: ``lb`` is a coarser search's proven bound,
    so no cheap target is left above it: the first pass runs at ``ub``, or where the gap closes."""
    deadline, above = setup.deadline, setup.above
    plans: list = []
    passes, slack, proven, stats = 0, (ub - lb) * (1.0 if seeded else _DEEPEN_FIRST), lb, {"chain_pairs": 0}
    while True:
        low = proven_within(ub, proven, rel_gap)
        if low is not None:
            return plans, dict(stats, passes=passes, proven_lower=low)
        target = ub if ub - lb <= tol(ub) else min(ub, int(lb + slack))
        if above is not None and ub > above:  # no target past what the caller has (module docstring, Beaten)
            target = min(target, above)
        if rel_gap > 0:  # past ``closing`` the gap holds (in integers, as proven_within reads it)
            closing = int(ub - rel_gap * ub + tol(ub)) + 2
            if target > closing > proven:  # a pass there ends it: it finds the optimum, or the gap closed
                target = closing
        # merging (module docstring) when a gap is allowed and not yet met within the float slack: then the
        # exact pass at ``ub`` (cheap: the bound is there) settles it, ties by memory
        merge = rel_gap * target * _MERGE_SHARE if rel_gap > 0 and ub - proven > tol(ub) else 0.0
        if deadline is not None and deadline.passed():
            return plans, dict(stats, passes=passes, proven_lower=int(proven), budget_hit=True)
        try:
            found, stats = _pass(setup, target, merge)
        except OutOfTime:
            return plans, dict(stats, passes=passes, proven_lower=int(proven), budget_hit=True)
        err = stats["merge_error"]
        # a pass that kept a handful of pairs was far from the sizes that cost: the next one steps further
        passes, slack = passes + 1, slack * (_DEEPEN_FAST if stats["chain_pairs"] <= _FEW_PAIRS else 2)
        if found is None or found[0] > target + err:
            proven = max(proven, target)  # no plan within the target: the optimum is above it
        else:  # the optimum is above the target, or at least found - err (what stands for it is within err)
            proven = max(proven, min(target, found[0] - err))
        if "rest_bound" in stats:  # every plan within the target is at least that
            proven = max(proven, min(target, stats["rest_bound"]))
        if found is not None:
            plans.append(found)
            ub = min(ub, found[0])
            if err == 0 and found[0] <= target:  # an exact pass found the optimum
                break
        if above is not None and ub > above and proven >= above:  # every plan is slower than the caller's
            raise BeatenError(proven, above)
        if target >= ub and err == 0:
            break
    return plans, dict(stats, passes=passes, target=target)


def _pass(setup: PassSetup, ub: int, merge: float = 0.0):
    """One Pareto pass under target ``ub`` (and the cap): the best plan with time <= ub, re-evaluated, or None
    when there is none.  ``merge`` > 0 (:func:`_power`): the plan returned is within ``stats["merge_error"]``
    of the best plan with time <= ub (module docstring, Merging).  ``setup.rest_bound``: the rest's pairs are
    found first and those it bounds above ``ub`` dropped; with none left the chain is not built (no plan within
    ``ub``), and ``stats["rest_bound"]`` is the least bound of those kept (every plan within ``ub`` is at
    least that).  Past ``setup.deadline``: :class:`.deadline.OutOfTime`."""
    chain, sc, cap, rest_bound, deadline = setup.chain, setup.sc, setup.cap, setup.rest_bound, setup.deadline
    k, w = chain.k, sc.w
    fb, rb = setup.bounds
    lim_rows = row_limits(fb[0].rows, float(ub), cap)
    lim = (lim_rows + tol(lim_rows))[:, None]
    rtabs = [_variant_pass(t.model, rb[j], lim_rows, lim, deadline) for j, t in enumerate(chain.rtabs)]
    rest, rvar, ridx = leaf_segment(chain.rtabs, [_final(t, tabs) for t, tabs in zip(chain.rtabs, rtabs)])
    stats: dict = {"rest_pairs": int(rest.t.size), "block_pairs": 0, "chain_pairs": 0, "merge_error": 0}
    if rest_bound is not None and rest.t.size:
        low = rest_bound.per_pair(rest)
        rest = _subset(rest, low <= ub + tol(ub))
        stats.update(rest_pairs=int(rest.t.size), rest_bound=float(low.min()))
    if rest.t.size == 0:
        return None, stats
    ftabs = [_variant_pass(t.model, fb[j], lim_rows, lim, deadline) for j, t in enumerate(chain.ftabs)]
    leaf, fvar, fidx = leaf_segment(chain.ftabs, [_final(t, tabs) for t, tabs in zip(chain.ftabs, ftabs)])
    g, err = _power(leaf, chain.n, k, w, sc.outside(), lim, merge, deadline)
    stats.update(block_pairs=int(leaf.t.size), chain_pairs=int(g.t.size), merge_error=err)
    best = _finish(rest, g, k, cap)
    if best is None:
        return None, stats
    e, pr, pg = best
    y, z = divmod(e, k)
    at = int(rest.leaf[pr])
    rest_var = int(rvar[at])
    rest_choice = chain.rtabs[rest_var].pareto_choice(rtabs[rest_var], int(ridx[at]), e)
    per_block = np.array(_expand(g, y, z, pg), np.int64).reshape(-1, 3)  # (a, c, leaf pair) per block
    if len(chain.ftabs) > 1:
        per_block = _later_variants_first(per_block, fvar)
    # equal (leaf pair, states): equal block choice, walked back once
    keys, which = np.unique(per_block[:, 2] * (k * k) + per_block[:, 0] * k + per_block[:, 1], return_inverse=True)
    distinct = []
    for key in keys.tolist():
        at, pair = divmod(key, k * k)
        j = int(fvar[at])
        distinct.append(chain.ftabs[j].pareto_choice(ftabs[j], int(fidx[at]), pair))
    choice = chain.assemble(rest_choice, distinct, which)
    variants = (rest_var, *(int(fvar[p]) for p in per_block[:, 2].tolist()))
    t, m = chain.evaluate(choice, variants)
    want = (int(rest.t[pr] + g.t[pg]), int(rest.m[pr] + g.m[pg]))
    if (t, m) != want:
        raise AssertionError(f"solve_chain: plan re-evaluates to {(t, m)}, the chain said {want}")
    return (t, m, choice, variants), stats


class VariantBounds:
    """One variant table's bound rows (:func:`.pareto.min_sum_bounds`), its outside values built on first use:
    a variant no pass reaches never needs them.  ``rows`` carries only the weights (for the limits)."""

    def __init__(self, model, w: np.ndarray, vals: list, final_out: np.ndarray) -> None:
        self.model, self.w, self.vals, self.final_out = model, w, vals, final_out
        self.rows = Bounds(w[:, :1].astype(float), w[:, 1:2].astype(float), [], [])
        self._full: Bounds | None = None

    def final_lower(self) -> np.ndarray:
        """(rows, entries): a lower bound on each row's w (T, M) of any plan through each final entry."""
        inside = self.vals[self.model.final]
        return (inside + np.broadcast_to(self.final_out, inside.shape)).reshape(len(self.w), -1)

    def full(self) -> Bounds:
        if self._full is None:
            self._full = min_sum_bounds(self.model, self.w, self.vals, self.final_out)
        return self._full


def _variant_pass(
    model, bnd: VariantBounds, lim_rows: np.ndarray, lim: np.ndarray, deadline: Deadline | None
) -> list | None:
    """:func:`.pareto.pareto_pass` of one variant's table, or None when no entry of its final table can be in a
    plan within the limits: every entry's lower bound (inside plus outside, per row) is above a limit, as
    ``pareto_pass`` would find step by step (a variant no plan near the target takes, skipped whole).  Past
    ``deadline``: :class:`.deadline.OutOfTime`."""
    if not (bnd.final_lower() <= lim).all(axis=0).any():
        return None
    return pareto_pass(model, bnd.full(), lim_rows, deadline=deadline)[0]


def _final(table: PortTable, tabs: list | None) -> ParetoTable:
    """The final Pareto table of a variant's pass (an empty one for a variant skipped whole)."""
    if tabs is None:
        return ParetoTable(np.zeros(1, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    return tabs[table.model.final]


def _subset(seg: Seg, keep: np.ndarray) -> Seg:
    """A leaf segment with only the pairs ``keep`` marks (each entry's run stays in order)."""
    entry = np.repeat(np.arange(seg.off.size - 1), np.diff(seg.off))
    off = np.concatenate([[0], np.cumsum(np.bincount(entry[keep], minlength=seg.off.size - 1))])
    return Seg(off, seg.t[keep], seg.m[keep], seg.blocks, leaf=seg.leaf[keep])


def _later_variants_first(per_block: np.ndarray, fvar: np.ndarray) -> np.ndarray:
    """The blocks' (a, c, leaf pair) rows with, among blocks between the same port states, the pairs of later
    variants first.  Such blocks may swap choices without changing T or M (every term they share is the
    same), so the order is free; the planner's variants run from saving to recomputing more, and a step's
    peak comes as backward starts, at the last blocks: recomputation there would add to it."""
    out = per_block.copy()
    keys = per_block[:, 0] * (per_block[:, 1].max() + 1) + per_block[:, 1]
    for key in np.unique(keys):
        rows = np.flatnonzero(keys == key)
        out[rows] = per_block[rows[np.argsort(-fvar[per_block[rows, 2]], kind="stable")]]
    return out


def _power(
    leaf: Seg,
    n: int,
    k: int,
    w: np.ndarray,
    outs: dict[int, np.ndarray],
    lim: np.ndarray,
    merge: float = 0.0,
    deadline: Deadline | None = None,
) -> tuple[Seg, int]:
    """``F^(x)n`` by halving (one segment per length), and the time its merges may have added to a pair.

    A segment of l blocks is pruned with ``O_l`` (``outs[l]``, indexed (c, a)).  ``merge`` > 0 (ps) is the
    most time merging may add to any pair of ``F^(x)n`` (module docstring, Merging): the product of length l
    merges within cells of ``step_l = merge l / S(n)`` (``S``: :func:`_merge_weights`), so a pair of P_l lies
    at most ``err_l`` (the steps of the products below it, with repeats) above the true pair it stands for,
    and P_l is pruned against its limits plus ``w_t err_l``: what stands for a pair within the limits is
    kept.  Returns the segment and ``err_n``; :class:`.deadline.OutOfTime` between products past
    ``deadline``."""
    segs, err = {1: leaf}, {1: 0}
    weights = _merge_weights(n)
    for length, x, y in halving(n):
        if deadline is not None:
            deadline.check()
        out = outs[length].transpose(0, 2, 1).reshape(len(w), -1)
        step = max(int(merge * length / weights[n]), 1) if merge > 0 else 1
        err[length] = err[x] + err[y] + step - 1
        wide = lim + w[:, :1] * err[length]
        segs[length] = product(segs[x], segs[y], k, w, out, wide, step)
    return segs[n], err[n]


def _merge_weights(n: int) -> dict[int, int]:
    """``S(l) = S(l//2) + S(l - l//2) + l``, ``S(1) = 0``: the lengths of the products that build P_l, with
    repeats (the halving reuses one segment per length; its error counts once per use).  ``S(n) <= n log2 n``,
    so steps ``merge l / S(n)`` add at most ``merge`` along any pair of ``F^(x)n``."""
    weights = {1: 0}
    for length, x, y in halving(n):
        weights[length] = weights[x] + weights[y] + length
    return weights


def _finish(rest: Seg, g: Seg, k: int, cap: int | None) -> tuple[int, int, int] | None:
    """(entry, rest pair, chain pair) of the lexicographically least (t, m) under the cap."""
    best: tuple[int, int, int, int, int] | None = None
    for e in np.flatnonzero((np.diff(rest.off) > 0) & (np.diff(g.off) > 0)):
        rs, re_ = rest.off[e], rest.off[e + 1]
        gs, ge = g.off[e], g.off[e + 1]
        gm = g.m[gs:ge]  # descending along the run
        room = (cap if cap is not None else INF) - rest.m[rs:re_]
        j = np.searchsorted(-gm, -room, side="left")  # first chain pair with m <= room: least t that fits
        ok = np.flatnonzero(j < gm.size)
        if not ok.size:
            continue
        tt = rest.t[rs:re_][ok] + g.t[gs:ge][j[ok]]
        mm = rest.m[rs:re_][ok] + gm[j[ok]]
        i = np.lexsort((mm, tt))[0]
        cand = (int(tt[i]), int(mm[i]), int(e), int(rs + ok[i]), int(gs + j[ok[i]]))
        if best is None or cand[:2] < best[:2]:
            best = cand
    return None if best is None else best[2:]
