"""The search: a pure-data problem, an exact DP solver under a memory cap, and a
CP-SAT model of the same problem as the referee."""

from __future__ import annotations

from .cpsat import solve_cpsat
from .dp import min_memory, solve_dp
from .problem import INF, InfeasibleError, SearchProblem, Solution, solve_brute_force

__all__ = [
    "INF",
    "SearchProblem",
    "Solution",
    "InfeasibleError",
    "solve_dp",
    "min_memory",
    "solve_cpsat",
    "solve_brute_force",
]
