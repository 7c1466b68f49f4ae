"""How much faster a CPU rank computes while others of its node wait, measured per action length.

Ranks that share a node's cores (4 gloo ranks on 2 cores) are calibrated with every rank busy.  A rank that
waits (a pipeline's bubble, a receive) lends its share of the cores to the others, but not all of it, and
less the shorter the actions are: the operating system shares the cores by time slices of a few
milliseconds, so an action much shorter than a slice already ran at nearly a whole core when every rank was
busy (its all-busy time, the profile's figure, is little slower than alone), and a rank waking from a receive
starts cold.  Measured on the 2-core CI machine (``scripts/core_lending.py``): one busy rank of 4 computes
0.9x the all-busy rate with 0.6 ms actions, 1.5x with 3.5 ms, 2x from 18 ms; the core-share rule
``min(1, cores / busy) / min(1, cores / ranks)`` says 2x for all of them.

:class:`CoreLending` holds such a measurement (``autopar calibrate`` writes it as a profile's
``[core_lending]`` table, measured the way a pipeline idles: tokens going round a ring of the ranks) and
answers ``speed_at(busy, action_s)``: the speed for ``busy`` computing ranks, interpolated linearly in
``log(action_s)`` between the measured lengths and held at the ends.

The answer comes from the measurement made monotone (:func:`monotone_table`), not from the raw figures.  Each
figure is a few rounds of a ring on a shared machine, and profiles of one quiet hour spread widely: one measured
one busy rank 2.38x faster at 16 ms and 1.50x at 43 ms, another 0.62x with two busy at 1.9 ms and 1.08x at 0.7
ms.  Priced raw, such a table made a pipeline of 8 micro-batches (its actions half as long) look 11% faster than
one of 4, which measured 8% slower (gpt2-bench on 4 ranks, 2026-11-29).  Two things hold on any machine: a rank
computes no slower while fewer ranks compute (the speed does not increase with ``busy``), and an action is lent
no less for being longer (the module's first paragraph), so the table is fitted to both orders by least squares
(alternating isotonic regressions over the two axes).  ``DeviceProfile.compute_speed`` also caps it at the
core-share rule: a rank cannot run faster than a whole core.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CoreLending:
    """Measured compute speed of a node's CPU ranks while only some of them compute.

    ``ranks``: the ranks of the node it was measured on; ``action_s``: the action lengths measured (seconds
    with every rank busy, increasing); ``speed[k - 1][j]``: how many times faster than with every rank busy
    a rank computes an action of ``action_s[j]`` while ``k`` of the ``ranks`` compute (``k`` in
    ``1 .. ranks - 1``)."""

    ranks: int
    action_s: tuple[float, ...]
    speed: tuple[tuple[float, ...], ...]
    fitted: tuple[tuple[float, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = "[core_lending]"
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 2:
            raise ValueError(f"{where}: ranks must be an int >= 2 (the node's ranks measured), got {self.ranks!r}")
        if not self.action_s or any(b <= a for a, b in zip(self.action_s, self.action_s[1:])):
            raise ValueError(f"{where}: action_s must be increasing seconds, at least one, got {self.action_s!r}")
        if self.action_s[0] <= 0:
            raise ValueError(f"{where}: action_s must be positive seconds, got {self.action_s!r}")
        if len(self.speed) != self.ranks - 1 or any(len(row) != len(self.action_s) for row in self.speed):
            raise ValueError(
                f"{where}: speed must hold {self.ranks - 1} rows (1 .. {self.ranks - 1} busy ranks), each with one "
                f"figure per action length ({len(self.action_s)}); got {[len(row) for row in self.speed]}"
            )
        if any(not s > 0 for row in self.speed for s in row):
            raise ValueError(f"{where}: speeds must be positive, got {self.speed!r}")
        object.__setattr__(self, "fitted", monotone_table(self.speed))

    def speed_at(self, busy: int, action_s: float) -> float:
        """The speed of one of ``busy`` computing ranks on an action of ``action_s`` seconds (all busy): 1.0 when
        every rank computes, else the monotone fit's row ``busy - 1`` (``fitted``) interpolated in
        ``log(action_s)`` (held beyond the ends)."""
        if busy >= self.ranks:
            return 1.0
        row = self.fitted[max(busy, 1) - 1]
        j = bisect.bisect_left(self.action_s, action_s)
        if j == 0:
            return row[0]
        if j == len(self.action_s):
            return row[-1]
        lo, hi = math.log(self.action_s[j - 1]), math.log(self.action_s[j])
        w = (math.log(action_s) - lo) / (hi - lo)
        return row[j - 1] * (1.0 - w) + row[j] * w

    def to_table(self) -> dict[str, Any]:
        """The profile's ``[core_lending]`` TOML table (the figures as measured; the fit is made on reading)."""
        return {"ranks": self.ranks, "action_s": list(self.action_s), "speed": [list(row) for row in self.speed]}

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str) -> CoreLending:
        """Read a ``[core_lending]`` table (``ranks``, ``action_s``, ``speed``); errors name ``where``."""
        keys = {"ranks", "action_s", "speed"}
        if set(table) != keys:
            raise ValueError(
                f"{where} [core_lending]: expected exactly the keys {sorted(keys)}, got {sorted(table)} "
                f"(autopar calibrate writes the table; delete it to use the core-share rule)"
            )
        try:
            return cls(
                table["ranks"],
                tuple(float(x) for x in table["action_s"]),
                tuple(tuple(float(x) for x in row) for row in table["speed"]),
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None


def monotone_table(speed: tuple[tuple[float, ...], ...], rounds: int = 100) -> tuple[tuple[float, ...], ...]:
    """``speed`` (rows: busy ranks 1, 2, ...; columns: action lengths, increasing) fitted so that every row is
    non-decreasing (longer actions lent no less) and every column non-increasing (more busy ranks, no faster).

    Each order alone has an exact least-squares fit, the isotonic regression (:func:`_isotonic`, pool adjacent
    violators); the two are applied in turn, rows then columns, until neither moves a figure by more than
    1e-12 (alternating projections onto the two convex sets of ordered tables: the limit is in both).  A table
    already in both orders is returned unchanged."""
    rows = [list(r) for r in speed]
    for _ in range(rounds):
        by_length = [_isotonic(r) for r in rows]
        columns = [_isotonic([-r[j] for r in by_length]) for j in range(len(by_length[0]))]
        fitted = [[-columns[j][k] for j in range(len(columns))] for k in range(len(rows))]
        moved = max(abs(a - b) for ra, rb in zip(fitted, rows) for a, b in zip(ra, rb))
        rows = fitted
        if moved <= 1e-12:
            break
    return tuple(tuple(r) for r in rows)


def _isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in squared distance: runs that break the order are pooled
    to their mean (pool adjacent violators)."""
    pools: list[list[float]] = []  # [mean, count]
    for v in values:
        pools.append([v, 1.0])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (m2, n2), (m1, n1) = pools.pop(), pools.pop()
            pools.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in pools for _ in range(int(n))]
