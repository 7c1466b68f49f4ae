"""Pareto tables over port-state pairs and their min-plus product: the factors :mod:`.chain` chains.

A segment (:class:`Seg`) holds, per state pair ``(a, c)`` of a run of blocks, the Pareto
set of (t, m) pairs (CSR over the K*K entries, each run by t ascending).  :func:`product`
is ``(A (x) B)(a, c) = Pareto U_b A(a, b) (+) B(b, c)`` (``(+)`` adds pairs), keeping only
pairs that may still complete under the bound rows: a pair with ``w (t, m) + out > lim`` on
any row goes, ``out`` bounding from below everything outside the product (see
:mod:`.chain`, Bounds).  Each row is a sound filter on its own, so which rows a product
tests changes how many pairs it carries, never which plan the search returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .pareto import ParetoTable, pair_window, pareto_keep
from .tables import PortTable

__all__ = ["Seg", "leaf_segment", "merge_keep", "product"]

_CHUNK = 1 << 22  # pair combinations formed at once in a product
_SAMPLE = 2048  # survivors a row is tried on before it is tested on all (:func:`_survivors`)
_MIN_CUT = 1 / 32  # the least share of the sample a row must drop to be tested on all


@dataclass(slots=True)
class Seg:
    """Pareto pairs per (a, c) entry (CSR over K*K entries, each run by t ascending).

    A leaf (one block) keeps ``leaf``: the block table's final pair index; a product
    keeps its halves and per pair ``(b, ia, ib)``."""

    off: np.ndarray
    t: np.ndarray
    m: np.ndarray
    blocks: int
    leaf: np.ndarray | None = None
    halves: tuple | None = None
    bp: np.ndarray | None = None

    def entry_min(self, w: np.ndarray) -> np.ndarray:
        """(rows, K*K): least ``w_t t + w_m m`` per entry, inf when empty."""
        out = np.full((len(w), self.off.size - 1), np.inf)
        full = np.flatnonzero(np.diff(self.off))
        if full.size:
            vals = w[:, :1] * self.t + w[:, 1:] * self.m
            out[:, full] = np.minimum.reduceat(vals, self.off[full], axis=1)
        return out


def _csr(g: np.ndarray, n_entries: int) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.bincount(g, minlength=n_entries))])


def leaf_segment(tables: list[PortTable], finals: list) -> tuple[Seg, np.ndarray, np.ndarray]:
    """The part's final Pareto tables, one per variant, laid onto the state grid as one segment (their union,
    Pareto-filtered per state pair), with the variant and the final-table pair of each of its pairs (indexed
    by ``leaf``)."""
    gs, ts, ms, var, idx = [], [], [], [], []
    for j, (table, tab) in enumerate(zip(tables, finals)):
        gs.append(table.grid[np.repeat(np.arange(tab.off.size - 1), np.diff(tab.off))])
        ts.append(tab.t)
        ms.append(tab.m)
        var.append(np.full(tab.t.size, j, np.int64))
        idx.append(np.arange(tab.t.size, dtype=np.int64))
    g, t, m = np.concatenate(gs), np.concatenate(ts), np.concatenate(ms)
    o = np.lexsort((t, g)) if len(tables) == 1 else pareto_keep(g, t, m)
    k2 = tables[0].k_states ** 2
    return Seg(_csr(g[o], k2), t[o], m[o], 1, leaf=o), np.concatenate(var), np.concatenate(idx)


def product(a: Seg, b: Seg, k: int, w: np.ndarray, out: np.ndarray, lim: np.ndarray, step: int = 1) -> Seg:
    """``a (x) b`` (see the module docstring), keeping pairs with ``w (t, m) + out <= lim``.

    ``out``: (rows, K*K) lower bound of everything outside the product, per (a, c).  ``step`` > 1 merges
    pairs whose times fall in the same cell ``floor(t / step)`` of an entry, keeping the one with the least
    memory (:func:`merge_keep`): every pair dropped has a kept one with less memory and at most ``step - 1``
    more time."""
    ca, cb = np.diff(a.off).reshape(k, k), np.diff(b.off).reshape(k, k)
    ea, eb = _triples(np.flatnonzero(ca.reshape(-1)), np.flatnonzero(cb.reshape(-1)), k)
    ia_, ib_, ic_ = ea // k, ea % k, eb % k
    ec = ia_ * k + ic_
    bmin = b.entry_min(w)
    ok = (a.entry_min(w)[:, ea] + bmin[:, eb] + out[:, ec] <= lim).all(axis=0)
    ea, eb, ec, mid = ea[ok], eb[ok], ec[ok], ib_[ok]
    na, nb = ca.reshape(-1)[ea], cb.reshape(-1)[eb]
    n = na * nb
    parts: list[tuple[np.ndarray, ...]] = []
    btab = ParetoTable(b.off, b.t, b.m)
    pure_t = np.flatnonzero((w[:, 1] == 0) & np.isfinite(lim[:, 0]))
    pure_m = np.flatnonzero((w[:, 0] == 0) & np.isfinite(lim[:, 0]))
    cum = np.concatenate([[0], np.cumsum(n)])
    bval = w[:, :1] * b.t + w[:, 1:] * b.m  # (rows, b's pairs): w (t, m) of each pair of b
    lead = _LeadOrder(b.off, bval, _row_order(len(w))[0])
    start = 0
    while start < n.size:  # chunks of about _CHUNK combinations
        stop = max(int(np.searchsorted(cum, cum[start] + _CHUNK, side="right")) - 1, start + 1)
        sl = slice(start, stop)
        start = stop
        tri = np.repeat(np.arange(sl.start, sl.stop), na[sl])  # one row per pair of a
        pa = a.off[ea[tri]] + np.arange(tri.size) - (np.cumsum(na[sl]) - na[sl])[tri - sl.start]
        fit = _fits(w, a.t[pa], a.m[pa], [(bmin, eb[tri]), (out, ec[tri])], lim)  # with b's best pair
        tri, pa = tri[fit], pa[fit]
        g = ec[tri]
        # b's pairs that fit beside this pair of a: one range of the entry (t up, m down), cut by
        # the time and memory rows (as pareto.pair_window)
        qt = ((lim[pure_t] - out[pure_t][:, g]) / w[pure_t, :1]).min(axis=0) - a.t[pa] if pure_t.size else None
        qm = ((lim[pure_m] - out[pure_m][:, g]) / w[pure_m, 1:]).min(axis=0) - a.m[pa] if pure_m.size else None
        lo, hi = pair_window(btab, eb[tri], qt, qm)
        # w (t_a + t_b, m_a + m_b) + out <= lim  as  w (t_b, m_b) <= slack of the pair of a.  The lead row
        # (the first of :func:`_row_order`, lam* when the cap binds: it cuts the most) picks, per pair of a, a
        # prefix of its entry's pairs in that row's order (:class:`_LeadOrder`); of those, the pairs in the
        # window are formed, and the other rows test them (:func:`_survivors`)
        slack = lim - (w[:, :1] * a.t[pa] + w[:, 1:] * a.m[pa] + out[:, g])
        cnt = lead.prefix(eb[tri], slack[lead.row])
        rep = np.repeat(np.arange(tri.size), cnt)
        pb = lead.order[b.off[eb[tri]][rep] + np.arange(rep.size) - (np.cumsum(cnt) - cnt)[rep]]
        inside = (pb >= lo[rep]) & (pb < hi[rep])
        rep, pb = rep[inside], pb[inside]
        alive = _survivors(len(w), rep.size, _row_test(bval, pb, slack, rep), lead.row)
        rep, pb = rep[alive], pb[alive]
        pa, tri = pa[rep], tri[rep]
        t, m, g = a.t[pa] + b.t[pb], a.m[pa] + b.m[pb], g[rep]
        keep = merge_keep(g, t, m, step)
        parts.append((g[keep], t[keep], m[keep], mid[tri[keep]], pa[keep], pb[keep]))
    if not parts:
        e = np.zeros(0, np.int64)
        return Seg(
            np.zeros(k * k + 1, np.int64), e, e, a.blocks + b.blocks, halves=(a, b), bp=np.zeros((0, 3), np.int64)
        )
    g, t, m, mid, pa, pb = (np.concatenate(x) for x in zip(*parts))
    sel = merge_keep(g, t, m, step) if len(parts) > 1 else np.arange(g.size)
    g, t, m, mid, pa, pb = g[sel], t[sel], m[sel], mid[sel], pa[sel], pb[sel]
    return Seg(_csr(g, k * k), t, m, a.blocks + b.blocks, halves=(a, b), bp=np.stack([mid, pa, pb], 1))


def merge_keep(g: np.ndarray, t: np.ndarray, m: np.ndarray, step: int) -> np.ndarray:
    """:func:`.pareto.pareto_keep` of (g, t, m), pairs whose times share a cell ``floor(t / step)`` of their
    group merged into the one with the least memory (ordered by (g, t), times ascending and memory descending
    per group, as a Pareto run).  A pair dropped is dominated by a kept one (less memory, less time: an earlier
    cell) or shares its cell (less memory, less than ``step`` more time).  ``step`` 1: exactly Pareto."""
    if step <= 1:
        return pareto_keep(g, t, m)
    return pareto_keep(g, t // step, m)


def _triples(ea: np.ndarray, eb: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (a, b) entry of ``ea`` with every (b, c) entry of ``eb`` sharing its b (entries
    raveled ``x * k + y``, both sorted), in (a, b, c) order: the nonempty triples, found from
    the nonempty entries rather than the K^3 grid."""
    row = eb // k  # b of each entry of eb, ascending
    first = np.searchsorted(row, np.arange(k))
    cnt = np.bincount(row, minlength=k)[ea % k]
    rep = np.repeat(np.arange(ea.size), cnt)
    at = first[ea % k][rep] + np.arange(rep.size) - (np.cumsum(cnt) - cnt)[rep]
    return ea[rep], eb[at]


def _row_order(rows: int) -> list[int]:
    """The order rows are tested in: lam* (row 2, present when the cap binds) cuts the most,
    then time (row 0), then the other slopes and memory (measured: about 2x fewer survivors
    carried through the rows than testing the slopes first)."""
    first = [2, 0] if rows > 2 else [0]
    return first + [r for r in range(rows) if r not in first]


def _row_test(bval: np.ndarray, pb: np.ndarray, slack: np.ndarray, rep: np.ndarray):
    """``ok(row, at)`` for :func:`_survivors`: the combinations ``at`` (b's pair ``pb``, a's pair ``rep``) with
    b's value within the slack a's pair leaves on that row."""
    return lambda r, at: bval[r, pb[at]] <= slack[r, rep[at]]


class _LeadOrder:
    """A product's second factor's pairs ordered, within each entry, by the lead bound row's value, so that the
    pairs of an entry with value <= s are a prefix: ``order`` (the pairs' indices, entry by entry, by value)
    and one searchsorted for all entries (a pair's key is ``entry * width + rank of its value``, as
    :func:`.pareto.pair_window`)."""

    __slots__ = ("keys", "off", "order", "row", "values")

    def __init__(self, off: np.ndarray, bval: np.ndarray, row: int) -> None:
        ent = np.repeat(np.arange(off.size - 1), np.diff(off))
        v = bval[row]
        self.off, self.row, self.order = off, row, np.lexsort((v, ent))
        self.values = np.sort(v)
        self.keys = ent[self.order] * (v.size + 1) + np.searchsorted(self.values, v[self.order], "right")

    def prefix(self, e: np.ndarray, s: np.ndarray) -> np.ndarray:
        """Per query, how many pairs of entry ``e`` have the row's value <= ``s``."""
        width = self.values.size + 1
        stop = np.searchsorted(self.keys, e * width + np.searchsorted(self.values, s, "right"), "right")
        return np.maximum(stop - self.off[e], 0)


def _survivors(rows: int, n: int, ok: Callable[[int, np.ndarray], np.ndarray], tested: int | None = None) -> np.ndarray:
    """Indices of the ``n`` candidates that pass the bound rows (``ok(row, indices)``: mask of those that pass).

    Each row is a sound filter on its own, so testing any subset of them keeps every pair the full test keeps,
    and some more: exactness does not depend on which rows are tested, only the pairs carried on.  The first row
    of :func:`_row_order` is tested on all; of the others, those that drop at least ``_MIN_CUT`` of an evenly
    spaced sample of the survivors, the most cutting first; ``tested``: a row the candidates passed already.
    (Measured on GPT-shaped 96-layer chains: after lam*, most slopes cut nothing, and testing them all was two
    thirds of a product's time.)"""
    order = _row_order(rows)
    alive = np.arange(n)
    if tested is None:
        tested = order[0]
        alive = alive[ok(tested, alive)]
    rest = [r for r in order if r != tested]
    if alive.size > _SAMPLE:
        sample = alive[:: alive.size // _SAMPLE]
        cut = {r: 1.0 - ok(r, sample).mean() for r in rest}
        rest = sorted((r for r in rest if cut[r] >= _MIN_CUT), key=lambda r: -cut[r])
    for r in rest:
        alive = alive[ok(r, alive)]
    return alive


def _fits(w: np.ndarray, t: np.ndarray, m: np.ndarray, terms: list[tuple], lim: np.ndarray) -> np.ndarray:
    """Mask of pairs with ``w_r (t, m) + rest_r <= lim_r`` on the rows :func:`_survivors` tests, one by one on
    the survivors.  ``rest_r`` is the sum of
    ``table[r, index]`` over ``terms`` (tables (rows, entries), an entry per pair), gathered
    per row for the survivors only: the rows x pairs matrix is never formed."""

    def ok(r: int, at: np.ndarray) -> np.ndarray:
        rest = sum(tab[r, idx[at]] for tab, idx in terms)
        return w[r, 0] * t[at] + w[r, 1] * m[at] + rest <= lim[r, 0]

    alive = _survivors(len(w), t.size, ok)
    mask = np.zeros(t.size, bool)
    mask[alive] = True
    return mask
