"""A pipeline's stage plan under the cap: the fastest stage plan whose split fits every rank.

The stage mesh is searched for the whole model (every stage's ops) at one micro-batch
(``pipeline_choice``), so the search's memory is ``S + A``: the model state and one
micro-batch's saved activations, summed over the layers.  A rank holds something else:
its stages' state and the activations of the micro-batches it has in flight,

    need_r = S_r + h_r A_r        (h_r: the schedule's count, ``cost.in_flight``: GPipe m,
                                   1F1B min(m, p - r), interleaved Megatron's warmup + 1
                                   stage-micro-batches over its v stages)

and ``search.stages.split_stages`` checks ``max_r need_r <= cap`` for each split.  Where the
fastest stage plan's split fits, it is the plan.  Else the stage plan is searched again with
its memory row weighted: ``S + w A`` with ``w = max_r h_r`` (``problem_tables.weighted``: an
op's saved bytes ``w`` times, a parameter's state once), bounded by ``C``.  For layers alike
``need_0 ~ (S + w A) / p``, so the walk is:

1. ``C = W cap / N``: ``W = S + w A`` of the fastest plan, ``N`` its fullest rank's need.
2. Search under ``C`` and split.  Where the split is over the cap (the ends, embeddings and
   head, sit on the first and last stage, not spread), scale again from the plan found,
   ``C' = min(W' cap / N', below(C))`` (the grid point under ``C``'s, Bounds on a grid),
   up to ``LOWERING_TRIES`` searches.  Where the search finds no plan under ``C``, its
   least-memory plan (the least it names) is the last one tried; when its split does not
   fit either, no stage plan does, and the error names the least its fullest rank needs.
3. A fitting bound found below a failing one: bisect between them ``BISECT_TRIES`` times for
   a faster plan that fits (a higher bound allows the same plans and more), until the search
   budget has passed (``StageFit.deadline``: the plan is then marked ``budget_hit``).  Measured
   (Llama 3 405B forced to 128 x 16 x 8 of 16,384 H100s, 30 s budget): the bisection was 65 of
   the plan's 158 s, for a plan 0.3% faster.  It stops, as the peak loop does (``solving.PeakLoop``),
   once the stage objective can gain at most ``BISECT_GAP`` of the best plan's: every bound between
   the ends gives a plan no faster than the failing end's optimum (``StageFit.least_objective``).
   That is a tolerance on the stage plan, not on the step (a plan as fast may split better), as the
   peak loop's is on the plan and not on its peak.

Bounded (``StageFit.search`` given the objective past which the fastest candidate so far beats every run of this
weight, ``SearchRun.above``): a search that proves every plan under its bound ``C`` beyond it (``BeatenError``)
proves every plan under any bound ``<= C`` beaten too, so the walk goes on as if that bound fitted: the plans a
walk without the proof would meet below ``C`` lose anyway, and it bisects above ``C`` as it would where ``C``'s plan
fits.  Whatever it skips is slower than the fastest; when nothing it meets is left, ``fit_stages`` raises the
``BeatenError`` with the least bound proven (``StageFit.beaten``).

Bounds on a grid (``StageFit.snapped``): each bound is searched rounded up to ``BOUND_BITS`` significant bits, so
at most ``2^-8`` above the bound asked.  A bound is the walk's knob, not a constraint of the plan: whether a stage plan
fits is its split's check (``price``), made on every plan met.  The runs of one weight (1F1B and each interleaved
depth of one micro-batch count) share a walk's searches, and each asks its own bounds, scaled from its own split's
need: bounds a hair apart (Llama 3 405B at (4, 512, 8) of 16,384 H100s: 1,039.55, 1,039.62 and 1,039.65 GiB for
2, 4 and 8 stages per rank), which on the grid are one search.  Every proof stays one: a search under the rounded
bound covers every plan under the bound asked.  Measured there, bounded by the fastest step: the mesh's walks
27.1 -> 20.5 s (the mesh 36.1 -> 32.6 s); (16, 32, 32) 51.1 -> 45.8 s.

Probes: each search of the walk keeps its peak loop's probe (``SearchRun.refine`` False: within ``PROBE_GAP``
of the optimum under its bound, its proven gap in ``Plan.search``), not searched again at ``PLAN_GAP``: the walk
decides between bounds far coarser than that (a split fits or not, ``BISECT_TRIES`` halvings), as the peak loop
keeps a bisected plan unrefined.  Measured (Llama 3 405B at (32, 32, 8) of 8,192 H100s): refining each walk
search's plan was 47% of the mesh's planning (one refinement ran 50 s, to the search budget); without it the mesh
planned in 61 s instead of 111 s, the same plan, and the forced 8,192-GPU row (dp 64 x pp 16 x tp 8) plans the
same plan in the same 94 s.

Losing runs (``fit_stages``' ``loses``, per run: whether every stage plan of objective at least ``X`` makes the run
slower than the fastest candidate, ``pipeline_planning.step_at_least_of``).  The optimum under a bound does not
decrease as the bound falls, so every plan the walk can still meet under a bound ``C`` has an objective of at least
what the searches above ``C`` proved (``StageFit.least_objective``: the free plan's, and each search's proven lower
bound at a bound ``>= C``).  A search whose bound ``loses`` by that is not run: it is taken as a proof that every
plan under it loses (``BeatenError``, as a bounded search's); and once the failing end of the bisection loses so,
every bound between the ends does, and the bisection stops.  Nothing that could win is skipped: a winning plan
lies under no bound proven so.
The capped plans' objectives are what make this bite: the run's bound from the free plan cannot see the cost of
the cap (20-40% of the step on Llama 3 405B's meshes of 16,384 H100s), the failing plans' objectives can.

The result is the fastest fitting plan met.  It is a walk along the weighted search's
(time, memory) frontier, not the optimum of the split and the stage plan together: the
weight is the fullest rank's, and the stages' state and activations are not spread evenly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from autopar.cost import in_flight
from autopar.search import BeatenError, Deadline

from .errors import MemoryCapError
from .schema import Plan

__all__ = [
    "BISECT_GAP",
    "BISECT_TRIES",
    "BOUND_BITS",
    "LOWERING_TRIES",
    "StageFit",
    "fit_stages",
    "held_at_most",
]

log = logging.getLogger(__name__)

#: the most searches lowering the bound towards a split that fits (step 2)
LOWERING_TRIES = 5
#: the searches bisecting between a fitting bound and a failing one (step 3)
BISECT_TRIES = 4
#: the bisection stops once the stage objective can gain at most this share of the best plan's (step 3)
BISECT_GAP = 2.0**-8
#: the significant bits a searched bound keeps, rounded up (module docstring, Bounds on a grid)
BOUND_BITS = 9


@dataclass
class StageFit:
    """One walk's searches: ``search(C)`` the stage plan with activations weighted ``weight`` times under bound
    ``C`` (``MemoryCapError`` when none; ``BeatenError`` where it is bounded and proves every plan under ``C``
    slower than the fastest candidate), searched at ``snapped(C)`` and kept per snapped bound in ``found`` (the
    schedules of one micro-batch count and weight share them); ``free``: the fastest plan, searched without a bound;
    ``deadline``: the plan's search budget (None: none), past which no bisection starts."""

    search: Callable[[int], Plan]
    free: Plan
    weight: int
    deadline: Deadline | None = None
    found: dict[int, Plan | MemoryCapError | BeatenError] = field(default_factory=dict)

    @staticmethod
    def snapped(bound: int) -> int:
        """``bound`` rounded up to ``BOUND_BITS`` significant bits: the bound ``under`` searches (module docstring,
        Bounds on a grid)."""
        step = _grid_step(bound)
        return -(-bound // step) * step

    @classmethod
    def below(cls, bound: int) -> int:
        """The greatest bound on the grid under ``snapped(bound)``: every bound at most it is searched below
        ``bound``'s search, so a walk lowering its bound to it makes progress."""
        top = cls.snapped(bound) - 1
        return top // _grid_step(top) * _grid_step(top)

    def under(self, bound: int) -> Plan:
        """The plan of the search under ``snapped(bound)`` (searched once per snapped bound)."""
        at = self.snapped(bound)
        if at not in self.found:
            try:
                self.found[at] = self.search(at)
            except (MemoryCapError, BeatenError) as e:
                self.found[at] = e
        hit = self.found[at]
        if isinstance(hit, Exception):
            raise hit
        return hit

    def searched(self, bound: int) -> Plan | MemoryCapError | BeatenError | None:
        """What the search ``under(bound)`` made gave (None: not searched)."""
        return self.found.get(self.snapped(bound))

    def beaten(self, more: Sequence[BeatenError] = ()) -> BeatenError:
        """The proof with the least bound among the searches that proved their plans slower and ``more`` (a walk's
        own, ``fit_stages``' ``loses``; the walk met one)."""
        proofs = [e for e in self.found.values() if isinstance(e, BeatenError)] + list(more)
        return min(proofs, key=lambda e: e.lower_bound_ps)

    def least_objective(self, bound: int) -> int:
        """A lower bound on the objective of every stage plan under ``bound``: the most of the free plan's and of
        what each search at a bound ``>= bound`` proved (its plan's objective where exact, else its proven lower
        bound; a bounded search's proof)."""
        least = [self.free.search.least_objective_ps or 0]
        for at, hit in self.found.items():
            if at >= bound and isinstance(hit, BeatenError):
                least.append(int(hit.lower_bound_ps))
            elif at >= bound and not isinstance(hit, MemoryCapError):  # a plan
                least.append(hit.search.least_objective_ps or 0)
        return max(least)

    def weighted_bytes(self, plan: Plan) -> int:
        """``S + w A`` of ``plan``: its state and ``weight`` times its activations."""
        mem = plan.memory
        return mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes + self.weight * mem.activations_bytes


def _grid_step(bound: int) -> int:
    """The grid's spacing at ``bound``: bounds of one bit length keep ``BOUND_BITS`` significant bits."""
    return 1 << max(bound.bit_length() - BOUND_BITS, 0)


@dataclass
class _Walk:
    """One run's walk over ``fit``: ``price`` its split, ``loses`` its bound (``fit_stages``), ``proofs`` the bounds
    it skipped as losing."""

    fit: StageFit
    price: Callable[[Plan], Plan]
    loses: Callable[[int], bool] | None
    proofs: list[BeatenError] = field(default_factory=list)

    def under(self, bound: int) -> Plan:
        """``fit.under(bound)``, or ``BeatenError`` without a search where ``loses`` says every plan under it loses."""
        if self.loses is not None:
            least = self.fit.least_objective(bound)
            if self.loses(least):
                self.proofs.append(BeatenError(least, 0))
                raise self.proofs[-1]
        return self.fit.under(bound)

    def lost_above(self, bound: int) -> bool:
        """Whether every plan under ``bound`` (hence under any bound below it) loses."""
        return self.loses is not None and self.loses(self.fit.least_objective(bound))


def held_at_most(schedule: str, p: int, m: int, v: int = 1) -> int:
    """``w = max_r h_r``: the most micro-batches' activations of its stages a rank of a ``p``-rank ``schedule`` over
    ``m`` micro-batches holds at once (interleaved: its stage-micro-batches over its ``v`` stages, rounded up)."""
    return max(-(-in_flight(schedule, p, m, r, v) // v) for r in range(p))


def fit_stages(
    fit: StageFit,
    price: Callable[[Plan], Plan],
    cap: int | None,
    loses: Callable[[int], bool] | None = None,
    floor: Callable[[], int] | None = None,
) -> Plan:
    """The fastest pipelined plan ``price(stage_plan)`` whose split fits ``cap`` along the walk of the module
    docstring.  ``price`` raises ``MemoryCapError`` (its ``min_mem_bytes``: the least need of the fullest rank
    any split reached) when a stage plan's split does not fit; the last such error is raised when none fits, and
    ``BeatenError`` (``StageFit.beaten``) where every plan the walk met that fits is proven slower than the fastest.
    ``loses(X)``: whether every stage plan of objective ``>= X`` makes this run slower than the fastest candidate
    (None: never; module docstring, Losing runs).  ``floor()``: a lower bound on the stage objective of every plan of
    this run whose split fits the cap (``stage_floor``), asked only where the fastest plan's split misses it: where
    that loses, no plan of the run can win and nothing is walked (``BeatenError`` with the floor)."""
    try:
        return price(fit.free)
    except MemoryCapError as e:
        if cap is None:
            raise
        missed = e
    if loses is not None and floor is not None:
        least = floor()
        if loses(least):
            raise BeatenError(least, 0)
    walk = _Walk(fit, price, loses)
    best, fits_at, fails_at = _lowered(walk, cap, missed)
    best = _bisected(walk, best, fits_at, fails_at)
    if best is None:
        raise fit.beaten(walk.proofs)
    log.info("stage plan under a weighted bound of %d bytes fits the cap of %d", fits_at, cap)
    return best


def _lowered(walk: _Walk, cap: int, missed: MemoryCapError) -> tuple:
    """Step 2: ``(plan, fits_at, fails_at)``: the first bound ``fits_at`` lowered from the fastest plan's whose
    plan's split fits (``plan`` priced; None where the search proved the bound's plans slower than the fastest,
    ``BeatenError``: taken as fitting), and the bound tried before it.  The last ``MemoryCapError`` when none does."""
    fit = walk.fit
    plan, bound = fit.free, fit.weighted_bytes(fit.free) + 1  # the fastest plan's: any bound above finds it again
    for _ in range(LOWERING_TRIES):
        scaled = fit.weighted_bytes(plan) * cap // max(missed.min_mem_bytes, 1)
        fails_at, bound = bound, min(scaled, fit.below(bound))
        try:
            try:
                plan = walk.under(bound)
            except MemoryCapError as e:  # no stage plan under the bound: its least-memory one is the last to try
                if e.min_mem_bytes >= fails_at:
                    break
                bound = e.min_mem_bytes
                plan = walk.under(bound)
        except BeatenError:  # every plan under the bound loses: as if its split fitted (module docstring)
            return None, bound, fails_at
        try:
            return walk.price(plan), bound, fails_at
        except MemoryCapError as e:
            missed = e
    raise missed


def _bisected(walk: _Walk, best: Plan | None, fits_at: int, fails_at: int) -> Plan | None:
    """Step 3: the fastest plan that fits met bisecting between ``fits_at`` and ``fails_at`` (``best``: the one
    found at ``fits_at``), ``BISECT_TRIES`` times or until the deadline, or until every plan under ``fails_at``
    loses (module docstring, Losing runs).  A bound whose plans are proven slower than the fastest
    (``BeatenError``) is taken as fitting (module docstring)."""
    fit = walk.fit
    best_at = fits_at if best is not None else None  # the bound whose stage plan ``best`` is
    for _ in range(BISECT_TRIES):
        if fit.deadline is not None and fit.deadline.passed():  # out of time: the fastest split that fits so far
            if best is not None:
                best = replace(best, search=replace(best.search, budget_hit=True, budget_s=fit.deadline.budget_s))
            break
        middle = (fits_at + fails_at) // 2
        on_grid = fit.snapped(middle) in (fit.snapped(fits_at), fit.snapped(fails_at))  # its answer is known already
        if on_grid or walk.lost_above(fails_at) or _settled(fit, best_at, fails_at):
            break
        try:
            priced = walk.price(walk.under(middle))
        except MemoryCapError:
            fails_at = middle
            continue
        except BeatenError:
            fits_at = middle
            continue
        fits_at = middle
        if best is None or priced.cost.total_s < best.cost.total_s:
            best, best_at = priced, middle
    return best


def _settled(fit: StageFit, best_at: int | None, fails_at: int) -> bool:
    """Whether the stage plan found under ``best_at`` is within ``BISECT_GAP`` of every plan a bound below
    ``fails_at`` can give (step 3)."""
    found = fit.searched(best_at) if best_at is not None else None
    if found is None or isinstance(found, Exception):
        return False
    top = found.search.objective_ps
    return top - fit.least_objective(fails_at) <= top * BISECT_GAP
