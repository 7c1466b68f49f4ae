"""The split of a chain of layers into pipeline stages: contiguous, uneven where that pays, under a memory cap.

Issue 31's stage split (``planner.pipeline_planning`` calls it with the prices of ``planner.stage_prices``).
Layers ``0 .. L-1`` run in order; stage
``j`` of ``p`` takes the run ``[k_j, k_(j+1))`` (``k_0 = 0``, ``k_p = L``, every run non-empty), stage 0 also the
part of the model before the layers (``prelude``: embeddings) and stage ``p - 1`` the part after them
(``postlude``: final norm, head, loss).  Per micro-batch, stage j's forward takes ``F_j`` (the sum of its
layers' and its end's forward times) and its backward ``B_j``.

Step time.  A pipeline of ``m`` identical micro-batches is a flow shop: under GPipe (every forward, then every
backward) the forwards finish after ``sum_j F_j + (m - 1) max_j F_j`` and the backwards, likewise, take
``sum_j B_j + (m - 1) max_j B_j`` more, so

    T = sum_j (F_j + B_j) + (m - 1) (max_j F_j + max_j B_j)

exactly (``tests/test_stage_split.py`` checks it against the list schedule of ``cost.pipeline.step_time``).
1F1B runs the same actions in another order and finishes no later (checked there too: the formula bounds it
from above, equal when the stages are equal).  The first sum does not depend on the split (every layer is in
some stage), so the split minimizes ``max_j F_j + max_j B_j``: the slowest stage sets the pace.

Transfers.  A stage sends what crosses its cut asynchronously (``torch.distributed.pipelining``'s ``isend``) and
goes on with its next micro-batch, so each link between stages is one more machine of the flow shop, taking
``c_j`` per micro-batch each way (``cuts``):

    T = sum_j (F_j + B_j) + 2 sum_j c_j + (m - 1) (max(F_j, c_j) + max(B_j, c_j))   (max over stages and links)

A link slower than every stage sets the pace; one faster only adds its latency to the first and last
micro-batch.  The search keeps the pairs with the links in the maxima; ``2 sum_j c_j``, which depends on where
the cuts fall, is left to ``step_of_split`` (a bound of ``2 (p - 1) max c`` on what the split's choice can
miss).

Memory.  Stage j holds its model state (``S_j``: its layers' parameters, gradients and optimizer state, and its
end's) and the activations of the ``h_j`` micro-batches in flight on it (``cost.pipeline.in_flight``, given by
the caller: ``m`` under GPipe, ``min(m, p - j)`` under 1F1B), each its layers' and end's saved activations
``A_j``:

    M_j = S_j + max(h_j A_j + W_j, E_j)  <=  cap     for every stage j
    E_j = max(min(G_j, max(b, g_j)), t g_j)

with, where the caller gives them (else 0), ``W_j`` the largest working set one of its layers' backward holds for
a moment beside the rest (``StageCosts.work_bytes``), and ``E_j`` what the step's end adds to its gradients: the
largest gradient bucket's flat copy (its bucketed gradients ``G_j``, buckets of ``b`` bytes holding at least one
gradient of at most ``g_j`` bytes; ``EndOfStep``; none where ``b = 0``) or the optimizer's ``t`` temporaries on
its largest gradient.
A parameter read in several places (a tied embedding: the prelude's lookup, a later lookup, the postlude's head) is
in the ``S`` and ``G`` of each: a stage that runs two of them holds it once, so the split takes the extra copies
off (``SharedState.copies``).  ``M_j`` bounds the rank's walk over its actions from above
(``planner.stage_prices._rank_peak``: a backward holds at most ``h_j A_j`` beside its gradients, which ``S_j``
holds).  Under 1F1B the first stages hold more micro-batches,
so the best split gives them fewer layers.

Search (:func:`split_stages`).  Dynamic programming over (stages placed, layers placed): ``P(j, k)`` is the
Pareto set of ``(max F, max B)`` over the splits of layers ``[0, k)`` into stages ``0 .. j - 1`` that fit the
cap, and

    P(j + 1, k') = Pareto U_(k < k', stage j on [k, k') fits)
                       { (max(f, F(k, k')), max(b, B(k, k'))) : (f, b) in P(j, k) }

with ``P(0, 0) = {(0, 0)}``; the answer is the least ``f + b`` in ``P(p, L)``.  Pareto pruning keeps the optimum:
a pair dominated at (j, k) stays dominated after any completion, since max is monotone.  Work O(p L^2) times the
sets' sizes (at most the distinct stage times), exact, with no floats compared past their own values.
Every stage's ``(F, B, M)`` over every run ``[i, k)`` is computed at once per stage as ``(L + 1) x (L + 1)`` arrays
(``_StageGrids``: the prefix sums' differences; ``step_of_split`` reads one split's runs from them, so both price
a stage by the same operations): on one mesh of Llama 3 405B's device-count plan (126 layers on 64 stages) the
splits took 2.06 s priced one run at a time (625,905 runs over 8 splits), 0.93 s over 10 with the arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["EndOfStep", "NoSplitFits", "SharedState", "StageCosts", "StageSplit", "split_stages", "step_of_split"]


class NoSplitFits(ValueError):
    """No split of the layers fits the cap; ``least_bytes``: the least memory of the fullest stage any split
    reaches."""

    def __init__(self, message: str, least_bytes: int) -> None:
        super().__init__(message)
        self.least_bytes = least_bytes


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Per micro-batch: forward and backward seconds, model-state bytes (held once per stage) and saved
    activation bytes (held per micro-batch in flight), of each layer (``layers``, sequences of equal length)
    or of one end of the model (``prelude`` on the first stage, ``postlude`` on the last: one value each)."""

    forward_s: Sequence[float]
    backward_s: Sequence[float]
    state_bytes: Sequence[int]
    act_bytes: Sequence[int]
    #: what each holds for a moment (module docstring, Memory; empty: nothing): its backward's largest working set,
    #: its gradients' bytes in the buckets' flat copies, its largest parameter gradient
    work_bytes: Sequence[int] = ()
    flat_bytes: Sequence[int] = ()
    largest_grad_bytes: Sequence[int] = ()

    @property
    def count(self) -> int:
        return len(self.forward_s)

    def at(self, name: str, k: int) -> int:
        """Layer ``k``'s figure ``name`` (a field's name; 0 where that field is empty: not given)."""
        values = getattr(self, name)
        return values[k] if values else 0


@dataclass(frozen=True, slots=True)
class EndOfStep:
    """What the step's end holds beside every gradient (module docstring, Memory): the runtime's gradient bucket
    (``bucket_bytes``, 0: none) and the optimizer's ``temporaries`` (copies of its largest gradient)."""

    bucket_bytes: int = 0
    temporaries: int = 0

    def bytes(self, bucketed: int, largest_grad: int) -> int:
        """``E``: the largest bucket's flat copy of ``bucketed`` gradient bytes, or the optimizer's temporaries."""
        bucket = min(bucketed, max(self.bucket_bytes, largest_grad)) if self.bucket_bytes else 0
        return max(bucket, self.temporaries * largest_grad)


@dataclass(frozen=True, slots=True)
class SharedState:
    """A parameter whose figures (its ``state_bytes``, of which ``grad_bytes`` its gradient and ``flat_bytes`` that
    in a bucket's flat copy, and its optimizer step ``step_s``) are in several positions' ``StageCosts``: the
    layers ``layers``, the ``prelude`` and the ``postlude`` (module docstring, Memory)."""

    state_bytes: int
    grad_bytes: int
    flat_bytes: int
    step_s: float
    layers: tuple[int, ...] = ()
    prelude: bool = False
    postlude: bool = False

    def copies(self, i: int, k: int, first: bool, last: bool) -> int:
        """How many times more than once a stage on layers ``[i, k)`` (with the prelude if ``first``, the postlude
        if ``last``) counts it: its positions there, less one (0 where it has none)."""
        here = sum(i <= layer < k for layer in self.layers) + (self.prelude and first) + (self.postlude and last)
        return max(here - 1, 0)


@dataclass(frozen=True, slots=True)
class StageSplit:
    """A split: stage j takes layers ``[bounds[j], bounds[j + 1])``; its step time (module docstring's ``T``),
    the forward and backward time (compute) and the memory ``M_j`` of each stage, and the seconds of each send
    between stages (``sends[j]``: after stage j, each way)."""

    bounds: tuple[int, ...]
    step_s: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]
    sends: tuple[float, ...] = ()


class _Prefix:
    """Prefix sums of the layers' costs, and the largest of their moments over every run (``_StageGrids`` takes
    a stage's totals over every ``[i, k)`` from them)."""

    def __init__(self, layers: StageCosts) -> None:
        n = layers.count
        self.f, self.b, self.s, self.a, self.flat = ([0] for _ in range(5))
        flat = [layers.at("flat_bytes", k) for k in range(n)]
        for row in zip(layers.forward_s, layers.backward_s, layers.state_bytes, layers.act_bytes, flat, strict=True):
            for acc, x in zip((self.f, self.b, self.s, self.a, self.flat), row):
                acc.append(acc[-1] + x)
        self.work = _range_max([layers.at("work_bytes", k) for k in range(n)])
        self.largest = _range_max([layers.at("largest_grad_bytes", k) for k in range(n)])


def _range_max(values: list[int]) -> list[list[int]]:
    """``out[i][d]``: the largest of ``values[i : i + d + 1]`` (O(n^2) once, then O(1) a run)."""
    out = []
    for i in range(len(values)):
        row, top = [], 0
        for x in values[i:]:
            top = max(top, x)
            row.append(top)
        out.append(row)
    return out


@dataclass(frozen=True, slots=True)
class _Pipeline:
    """What prices one stage: the layers' prefix sums, the ends, the micro-batches in flight per stage, and the
    time to send what crosses each cut (``cuts[k]``: after layer k)."""

    prefix: _Prefix
    prelude: StageCosts
    postlude: StageCosts
    held: tuple[int, ...]
    cuts: tuple[float, ...] = ()
    end: EndOfStep = EndOfStep()
    shared: tuple[SharedState, ...] = ()

    @property
    def p(self) -> int:
        return len(self.held)

    def cut(self, k: int, n: int) -> float:
        """Seconds to send what crosses the cut before layer ``k`` of ``n`` (0 at the chain's ends)."""
        return self.cuts[k - 1] if 0 < k < n and k - 1 < len(self.cuts) else 0.0


class _StageGrids:
    """``(F, B, M)`` of stage j over every run ``[i, k)`` as ``(n + 1) x (n + 1)`` arrays indexed ``[i, k]`` (only
    ``k > i`` meaningful): its layers' sums and largest moments, plus its ends on the first and last stage, its
    shared parameters held once, and its micro-batches in flight (the module docstring's ``M_j``)."""

    def __init__(self, pipe: _Pipeline, n: int) -> None:
        self.pipe = pipe
        pre = pipe.prefix

        def diff(acc, dtype) -> np.ndarray:
            a = np.asarray(acc, dtype=dtype)
            return a[None, :] - a[:, None]

        def ranged(rows: list[list[int]]) -> np.ndarray:  # out[i, k] = rows[i][k - i - 1]
            out = np.zeros((n + 1, n + 1), dtype=np.int64)
            for i, row in enumerate(rows):
                out[i, i + 1 : i + 1 + len(row)] = row
            return out

        self.f, self.b = diff(pre.f, np.float64), diff(pre.b, np.float64)
        self.s, self.a, self.flat = (diff(x, np.int64) for x in (pre.s, pre.a, pre.flat))
        self.work, self.largest = ranged(pre.work), ranged(pre.largest)
        # per shared parameter: how many of its layers each run holds
        self.counts = [diff(np.cumsum([0] + [k in one.layers for k in range(n)]), np.int64) for one in pipe.shared]
        self._ends: dict[tuple[bool, bool], tuple] = {}

    def _with_ends(self, first: bool, last: bool) -> tuple:
        """(f, b, s, a, work, flat, largest) of every run with the ends a stage holds (``first``, ``last``) and the
        shared parameters held once (``SharedState.copies``, over every run at once)."""
        if (first, last) not in self._ends:
            pipe = self.pipe
            f, b, s, a, work, flat, largest = self.f, self.b, self.s, self.a, self.work, self.flat, self.largest
            for end, here in ((pipe.prelude, first), (pipe.postlude, last)):
                if here:
                    f, b = f + end.forward_s[0], b + end.backward_s[0]
                    s, a = s + end.state_bytes[0], a + end.act_bytes[0]
                    work, flat = np.maximum(work, end.at("work_bytes", 0)), flat + end.at("flat_bytes", 0)
                    largest = np.maximum(largest, end.at("largest_grad_bytes", 0))
            for one, count in zip(pipe.shared, self.counts):
                extra = np.maximum(count + (one.prelude and first) + (one.postlude and last) - 1, 0)
                s, flat = s - extra * one.state_bytes, flat - extra * one.flat_bytes
            self._ends[first, last] = (f, b, s, a, work, flat, largest)
        return self._ends[first, last]

    def stage(self, j: int, at: tuple[int, int] | None = None) -> tuple:
        """(F, B, M) of stage j over every run, or on the run ``at = (i, k)`` alone (numpy scalars)."""
        pipe = self.pipe
        f, b, s, a, work, flat, largest = self._with_ends(j == 0, j == pipe.p - 1)
        if at is not None:
            f, b, s, a, work, flat, largest = (x[at] for x in (f, b, s, a, work, flat, largest))
        end = pipe.end
        bucket = np.minimum(flat, np.maximum(end.bucket_bytes, largest)) if end.bucket_bytes else 0
        at_end = np.maximum(bucket, end.temporaries * largest)
        return f, b, s + np.maximum(pipe.held[j] * a + work, at_end)


def split_stages(
    layers: StageCosts,
    in_flight: Sequence[int],
    m: int,
    cap_bytes: int | None = None,
    ends: tuple[StageCosts, StageCosts] | None = None,
    cuts: Sequence[float] = (),
    end: EndOfStep = EndOfStep(),
    shared: Sequence[SharedState] = (),
) -> StageSplit:
    """The split of ``layers`` into ``p = len(in_flight)`` contiguous stages with the least step time over ``m``
    micro-batches (module docstring) whose every stage fits ``cap_bytes`` (None: no cap), stage j holding the
    activations of ``in_flight[j]`` micro-batches (``cost.pipeline.in_flight`` of the schedule); ``ends``: the
    (prelude, postlude) costs on the first and last stage (None: nothing); ``cuts[k]``: the seconds to send what
    crosses a cut after layer k (forward; its gradient back takes as long), paid by the stages on either side;
    ``end``: what the step's end holds beside the gradients, ``shared``: the parameters several positions hold
    (module docstring, Memory).

    ValueError for more stages than layers (each stage needs one); ``NoSplitFits`` for a cap no split fits (its
    ``least_bytes``: the least memory of the fullest stage any split reaches)."""
    p = len(in_flight)
    if not 1 <= p <= layers.count:
        raise ValueError(
            f"{p} pipeline stages for {layers.count} layers: each stage needs at least one layer; "
            f"use at most {layers.count} stages, or a mesh axis of that size for the pipeline"
        )
    nothing = StageCosts((0.0,), (0.0,), (0,), (0,))
    prelude, postlude = ends or (nothing, nothing)
    pipe = _Pipeline(_Prefix(layers), prelude, postlude, tuple(in_flight), tuple(cuts), end, tuple(shared))
    grids = _StageGrids(pipe, layers.count)
    fronts = _fronts(pipe, grids, layers.count, cap_bytes)
    final = fronts[p].get(layers.count, {})
    if not final:
        least = _least_memory(pipe, grids, layers.count)
        raise NoSplitFits(
            f"no split of {layers.count} layers into {p} stages fits {cap_bytes} bytes per stage (micro-batches "
            f"in flight per stage {tuple(in_flight)}): the least any split needs on its fullest stage is {least} "
            "bytes; raise the cap, use more stages, or a schedule with fewer micro-batches in flight (1f1b holds "
            "fewer than gpipe)",
            least,
        )
    pace = min(final, key=lambda fb: fb[0] + fb[1])
    bounds = _walk_back(fronts, final[pace], p, layers.count)
    return _priced_split(pipe, grids, bounds, m)


def _fronts(
    pipe: _Pipeline, grids: _StageGrids, n: int, cap: int | None
) -> list[dict[int, dict[tuple[float, float], tuple]]]:
    """``fronts[j][k]``: the Pareto pairs ``(max F, max B)`` of the fitting splits of layers ``[0, k)`` into j
    stages, each with its back-pointer ``(k_prev, pair_prev)`` (module docstring, Search)."""
    fronts: list[dict[int, dict[tuple[float, float], tuple]]] = [{0: {(0.0, 0.0): ()}}]
    for j in range(pipe.p):
        nxt: dict[int, dict[tuple[float, float], tuple]] = {}
        fs, bs, mems = (x.tolist() for x in grids.stage(j))
        for k, pairs in fronts[j].items():
            for k2 in _stage_ends(pipe.p, j, k, n):
                f, b, mem = fs[k][k2], bs[k][k2], mems[k][k2]
                if cap is not None and mem > cap:
                    continue
                c = pipe.cut(k2, n)  # the link after the stage: a machine of the flow shop too
                f, b = max(f, c), max(b, c)
                cell = nxt.setdefault(k2, {})
                for fb in pairs:
                    cell.setdefault((max(fb[0], f), max(fb[1], b)), (k, fb))
        fronts.append({k: _pareto(cell) for k, cell in nxt.items()})
    return fronts


def _stage_ends(p: int, j: int, k: int, n: int) -> range:
    """Where stage j of p may end when it starts at layer k: at least one layer, and one left for each stage
    after it (the last takes the rest)."""
    return range(n, n + 1) if j == p - 1 else range(k + 1, n - (p - j - 1) + 1)


def _pareto(cell: dict[tuple[float, float], tuple]) -> dict[tuple[float, float], tuple]:
    """The pairs no other pair of ``cell`` dominates (both maxima no larger)."""
    kept: dict[tuple[float, float], tuple] = {}
    least_b = float("inf")
    for fb in sorted(cell):
        if fb[1] < least_b:
            kept[fb] = cell[fb]
            least_b = fb[1]
    return kept


def _walk_back(fronts: list, pointer: tuple, p: int, n: int) -> tuple[int, ...]:
    bounds = [n]
    for j in range(p, 0, -1):
        k, fb = pointer
        bounds.append(k)
        pointer = fronts[j - 1][k][fb]
    return tuple(reversed(bounds))


def _least_memory(pipe: _Pipeline, grids: _StageGrids, n: int) -> int:
    """The least, over the splits, of the fullest stage's memory: the DP of min-max over the same runs,

        W(j + 1, k') = min over k < k' (stage j may end at k') of max(W(j, k), M_j(k, k')),   W(0, 0) = 0,

    one array operation per stage (an unreached ``k`` holds the int64 maximum, which no max lowers)."""
    never = np.iinfo(np.int64).max
    best = np.full(n + 1, never, dtype=np.int64)
    best[0] = 0
    starts, ends = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    for j in range(pipe.p):
        last = j == pipe.p - 1  # the last stage takes the rest; any other at least one layer, one left per later stage
        may = (ends > starts) & (ends == n) if last else (ends > starts) & (ends <= n - (pipe.p - j - 1))
        best = np.where(may, np.maximum(best[:, None], grids.stage(j)[2]), never).min(axis=0)
    return int(best[n])


def step_of_split(
    layers: StageCosts,
    bounds: Sequence[int],
    in_flight: Sequence[int],
    m: int,
    ends: tuple[StageCosts, StageCosts] | None = None,
    cuts: Sequence[float] = (),
    end: EndOfStep = EndOfStep(),
    shared: Sequence[SharedState] = (),
) -> StageSplit:
    """The step time over ``m`` micro-batches (module docstring's ``T``), stage times and stage memory of one
    split (stage j on layers ``[bounds[j], bounds[j + 1])``, holding ``in_flight[j]`` micro-batches)."""
    nothing = StageCosts((0.0,), (0.0,), (0,), (0,))
    prelude, postlude = ends or (nothing, nothing)
    pipe = _Pipeline(_Prefix(layers), prelude, postlude, tuple(in_flight), tuple(cuts), end, tuple(shared))
    return _priced_split(pipe, _StageGrids(pipe, bounds[-1]), bounds, m)


def _priced_split(pipe: _Pipeline, grids: _StageGrids, bounds: Sequence[int], m: int) -> StageSplit:
    """``step_of_split``'s split priced from its pipeline's grids (``split_stages`` passes those it searched)."""
    p = len(bounds) - 1
    stages = [[x.item() for x in grids.stage(j, (bounds[j], bounds[j + 1]))] for j in range(p)]
    fs, bs, mems = (tuple(x[i] for x in stages) for i in range(3))
    sends = [pipe.cut(k, bounds[-1]) for k in bounds[1:-1]]
    pace_f, pace_b = max([*fs, *sends]), max([*bs, *sends])
    step = sum(fs) + sum(bs) + 2 * sum(sends) + (m - 1) * (pace_f + pace_b)
    return StageSplit(tuple(bounds), step, fs, bs, mems, tuple(sends))
