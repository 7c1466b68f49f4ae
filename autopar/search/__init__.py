"""The search stage's public entry points: a pure-data problem, an exact DP solver under a
memory cap, the same DP chained over repeated blocks (``solve_chain``), and a CP-SAT model
of the problem as the referee.

Modules, each importing only modules listed before it:

* ``deadline``: the wall-clock budget the searches stop at;
* ``problem``: the problem as data, its objective, brute force;  ``prune``: exact dominance
  pruning;  ``split``: a problem cut into its repeated block and the rest;
* ``minplus``: the min-plus matrix product;
* ``elimination``: factor tables, the elimination plan, min-sum passes (and the lexicographic one);
* ``pareto``: the exact elimination over Pareto sets of (time, memory);  ``lagrange``:
  min-sum plans and the Lagrange slope;
* ``minibucket``: the approximate search past the width budget;  ``dp``: the exact search
  (``solve_dp``, ``min_memory``) and the switch to ``minibucket``;
* ``tables``: a chain part's table over its port states;  ``minsum``: the min-sum chain;
  ``segments``: Pareto tables over port-state pairs and their product;  ``deepen``: the chain's passes
  under a target;  ``chain``: ``solve_chain``;
* ``cpsat``: the referee;  ``generate``: synthetic problems for tests and benchmarks;
* ``stages``: the split of a chain of layers into pipeline stages under a memory cap (the planner's
  ``pipeline_planning`` calls it);  ``weighted_chain``: a Lagrange lower bound on a chain whose parts weigh their
  memory on their own (the planner's ``stage_floor``).
"""

from __future__ import annotations

from .chain import ChainError, solve_chain
from .cpsat import solve_cpsat
from .deadline import Deadline
from .dp import min_memory, solve_dp
from .problem import INF, BeatenError, InfeasibleError, SearchProblem, Solution, Start, solve_brute_force
from .stages import EndOfStep, NoSplitFits, SharedState, StageCosts, StageSplit, split_stages, step_of_split
from .weighted_chain import WeightedChain, lagrange_floor

__all__ = [
    "INF",
    "Deadline",
    "SearchProblem",
    "Solution",
    "Start",
    "InfeasibleError",
    "BeatenError",
    "solve_dp",
    "solve_chain",
    "ChainError",
    "min_memory",
    "solve_cpsat",
    "solve_brute_force",
    "EndOfStep",
    "NoSplitFits",
    "SharedState",
    "StageCosts",
    "WeightedChain",
    "lagrange_floor",
    "StageSplit",
    "split_stages",
    "step_of_split",
]
