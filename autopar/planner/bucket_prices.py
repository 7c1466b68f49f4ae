"""The gradient buckets' all-reduces priced as the runtime fills them (``runtime.buckets``), after the search.

The search prices a bucketed parameter gradient's all-reduce at its bytes' share of a full bucket's
(``cost.Coster._grad_terms``: ``t(B) b / B`` for ``b`` bytes and buckets of ``B``, the latency paid once per full
bucket), ``grad_reduce_overlap`` of it hidden behind backward.  The runtime's buckets (``bucket_layout``: the
parameters in reverse order of first use, a first bucket of 1 MiB, then up to ``B``) differ in two ways a step
pays for:

* a bucket holds what is left: its all-reduce takes ``t(b_k)`` for its ``b_k`` bytes, more than the shares
  ``t(B) b_k / B`` when it is not full and the collective has a latency (a model of 17 MB on 4 gloo ranks: buckets
  of 1 and 16 MB, two latencies where the shares paid 0.7 of one).  Each of its collectives is scaled by
  ``r_k = max(1, t(b_k) / (t(B) b_k / B))``: a bucket over ``B`` (one gradient larger than a bucket) keeps its
  share, so ``r_k >= 1`` and the step is never below the search's objective (``pipeline_choice`` bounds on it);
* the bucket filled last (the parameters used first in forward: the embedding, a tied head) is ready only when
  backward ends: its all-reduce hides behind nothing and is exposed whole.

So each bucketed collective ``c`` of bucket ``k`` adds ``r_k w_c e - t_c`` to the step, with ``w_c`` its whole
time, ``t_c`` its exposed time in the search and ``e`` 1 in the last bucket of its axes, ``t_c / w_c`` elsewhere:
the plan lists it at ``r_k w_c e`` (its ``all_reduce (backward)`` term with it).  The search does not see the
difference (as ``assemble.overlap_bounded``'s term): a plan's step is its objective plus it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.runtime import bucket_layout

from .plan_parts import Collective

__all__ = ["BucketedReduction", "buckets_as_filled"]


@dataclass(frozen=True, slots=True)
class BucketedReduction:
    """A bucketed parameter gradient's collective in the step's list: its ``position`` there, the parameter
    (graph node index) and the mesh ``axis`` it runs on (a tuple: the axes' flattened group)."""

    position: int
    param: int
    axis: int | tuple[int, ...]


def buckets_as_filled(
    ctx, collectives: tuple[Collective, ...], reductions: tuple[BucketedReduction, ...], sizes: dict[int, int]
) -> tuple[tuple[Collective, ...], float]:
    """(``collectives`` with each bucketed reduction priced as its bucket runs, the seconds that adds to the
    step) (module docstring); ``sizes``: each bucketed parameter's gradient bytes in its bucket."""
    coster, graph = ctx.coster, ctx.graph
    cap = coster.settings.grad_bucket_bytes
    if not reductions or not cap:
        return collectives, 0.0
    by_param: dict[int, list[BucketedReduction]] = {}
    for r in reductions:
        by_param.setdefault(r.param, []).append(r)
    axes_of = {p: _axes(rs) for p, rs in by_param.items()}
    consumers = graph.consumers()
    order = sorted(by_param, key=lambda p: min((c for c, _, _ in consumers[p]), default=p))  # first use
    layout = bucket_layout(order, axes_of, {p: sizes.get(p, 0) for p in order}, cap)
    last = {axes: params for axes, params in layout}  # each axis set's last bucket
    out, added = list(collectives), 0.0
    for axes, params in layout:
        filled = sum(sizes.get(p, 0) for p in params)
        for r in (r for p in params for r in by_param[p]):
            c = out[r.position]
            whole = c.time_s + c.hidden_s
            share = coster.comm_time_s("all_reduce", cap, r.axis) * filled / cap
            ratio = max(1.0, coster.comm_time_s("all_reduce", filled, r.axis) / share) if share > 0 else 1.0
            exposed = 1.0 if last[axes] is params or whole <= 0 else c.time_s / whole
            t = whole * ratio * exposed
            added += t - c.time_s
            out[r.position] = replace(c, time_s=t, hidden_s=whole * ratio - t)
    return tuple(out), added


def _axes(reductions: list[BucketedReduction]) -> tuple[int, ...]:
    """The mesh axes a parameter's bucketed gradient is partial on (the runtime's bucket key)."""
    found: set[int] = set()
    for r in reductions:
        found.update(r.axis if isinstance(r.axis, tuple) else (r.axis,))
    return tuple(sorted(found))
