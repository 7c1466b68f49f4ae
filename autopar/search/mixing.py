"""Plans between two of the chain's hull plans: the last ``k`` blocks of a faster plan over the cap laid onto a plan
under it, for the search that stops before its passes prove a plan (a deadline, :mod:`.deepen`).

Why.  The plans a chained search meets first are the min-sum plans of its Lagrange rows (:mod:`.chain`): each
minimizes ``T + lam M`` over every plan, and over a chain of equal blocks every block then chooses alike (its
table, its slope).  Near the cap the two plans bracketing lam* are typically "every layer saves its activations"
(over the cap) and "every layer recomputes" (under it); the optimum lies between, some layers of each (the linear
relaxation's optimum mixes the two at the cap, and with equal blocks the mix is a plan of whole blocks).  A search
stopped by its deadline before a pass finds it returns the plan under the cap, up to ``(T_B - T_A)`` slower than
the mix (measured on Llama 3 405B's 126 layers in a pipeline's stage search: every layer recomputed at 13 GiB of a
74.5 GiB bound).

What.  For plan ``B`` (the best under the cap) and each plan ``A`` met that is faster and over the cap, the mixed
plan ``B <- A[n-k+1..n]`` takes block ``i``'s choices and variant from ``A`` for the last ``k`` blocks and from
``B`` elsewhere (the rest and block 0 stay ``B``'s).  Each is priced exactly (:meth:`.chain_tables.Chain.evaluate`:
every node and edge term, the one edge between a ``B`` block and an ``A`` block included), so what comes back is a
plan of the problem with its true ``(T, M)``.  ``M`` changes by about one block's difference per ``k``, so ``k``
is bisected for the most blocks under the cap (each tried ``k`` evaluated, not assumed).  The last blocks take
``A``'s choice because a pipeline's later stages hold fewer micro-batches in flight (``cost.in_flight``): the
memory-hungry layers go where they are held least.  Nothing here is proven optimal; the search's proven lower
bound stays what its passes proved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .chain_tables import Chain

__all__ = ["mixed_plan"]

#: a plan as the chain keeps it: (T, M, choice, variant of each block)
Planned = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def mixed_plan(chain: Chain, plans: list[Planned], cap: int) -> Planned | None:
    """The fastest plan under ``cap`` among ``plans`` and their mixes (module docstring); None when no plan of
    ``plans`` is under the cap."""
    under = [p for p in plans if p[1] <= cap]
    if not under:
        return None
    best = base = min(under, key=lambda p: (p[0], p[1]))
    for fast in plans:
        if fast[1] <= cap or fast[0] >= base[0]:
            continue
        mix = _most_blocks_under(chain, base, fast, cap)
        if mix is not None and (mix[0], mix[1]) < (best[0], best[1]):
            best = mix
    return best


def _most_blocks_under(chain: Chain, base: Planned, fast: Planned, cap: int) -> Planned | None:
    """``base`` with the last ``k`` blocks of ``fast``, for the largest ``k`` bisection finds under ``cap`` (None
    when no ``k >= 1`` tried is)."""
    lo, hi, found = 0, chain.n, None  # k = 0 is base itself; k = n the whole chain of fast's blocks
    while lo < hi:
        k = (lo + hi + 1) // 2
        mix = _last_blocks(chain, base, fast, k)
        if mix[1] <= cap:
            lo, found = k, mix
        else:
            hi = k - 1
    return found


def _last_blocks(chain: Chain, base: Planned, fast: Planned, k: int) -> Planned:
    """``base`` whose blocks ``n - k + 1 .. n`` take ``fast``'s choices and variants, priced exactly."""
    choice, variants = list(base[2]), list(base[3])
    for i in range(chain.n + 1 - k, chain.n + 1):
        for node in chain.blocks[i]:
            choice[node] = fast[2][node]
        variants[i] = fast[3][i]
    t, m = chain.evaluate(tuple(choice), tuple(variants))
    return t, m, tuple(choice), tuple(variants)
