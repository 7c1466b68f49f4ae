"""The search: a pure-data problem, an exact DP solver under a memory cap, the same DP
chained over repeated blocks (``solve_chain``), and a CP-SAT model of the problem as the referee."""

from __future__ import annotations

from .chain import ChainError, solve_chain
from .cpsat import solve_cpsat
from .dp import min_memory, solve_dp
from .problem import INF, InfeasibleError, SearchProblem, Solution, solve_brute_force

__all__ = [
    "INF",
    "SearchProblem",
    "Solution",
    "InfeasibleError",
    "solve_dp",
    "solve_chain",
    "ChainError",
    "min_memory",
    "solve_cpsat",
    "solve_brute_force",
]
