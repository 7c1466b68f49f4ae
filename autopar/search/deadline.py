"""A wall-clock budget for the searches: when it has passed, a search returns the best plan it has met and the
lower bound it has proven, rather than running on.

The chained search checks it before each deepening pass, and a pass checks it between the products of the chain
and before each step and fold of a block's Pareto pass (a pass past it is abandoned: :class:`OutOfTime`); the flat
DP before its exact pass and inside it the same way; the planner before each search of its peak loop and each
recomputation mode.  A plan always comes back: every search holds a real plan under the cap (the
Lagrange rows' plans) before its first pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Deadline", "OutOfTime"]


class OutOfTime(Exception):
    """Raised inside a search pass once its :class:`Deadline` has passed; the search catches it."""


@dataclass(frozen=True, slots=True)
class Deadline:
    """``budget_s`` seconds from when it was made (``time.monotonic``)."""

    budget_s: float
    at: float

    @classmethod
    def after(cls, budget_s: float | None) -> Deadline | None:
        """A deadline ``budget_s`` from now; None (no budget) for None."""
        if budget_s is None:
            return None
        if not budget_s > 0:
            raise ValueError(f"search_budget_s: expected a positive number of seconds or None, got {budget_s!r}")
        return cls(float(budget_s), time.monotonic() + float(budget_s))

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def check(self) -> None:
        """Raise :class:`OutOfTime` once the deadline has passed."""
        if self.passed():
            raise OutOfTime(f"the search budget of {self.budget_s:g} s has passed")
