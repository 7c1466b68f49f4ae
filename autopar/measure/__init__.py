"""Measuring the machine and the plans: what keeps the cost model honest.

* ``calibrate``: measure this machine (matmul rates, memory bandwidth, runtime
  overhead per op, every collective per group size) into a device profile;
* ``fidelity``: run a fixed benchmark of plans on N ranks and compare each plan's
  predicted step time and memory with the measured ones (``fidelity_report``
  prints them, ``benchmark`` holds the benchmark's definition);
* ``memory``: a step's peak memory as the allocator or profiler reports it;
* ``stats``: medians, spread, Spearman's rank correlation.
"""

from __future__ import annotations

from .commands import add_parsers, cmd_calibrate, cmd_fidelity

__all__ = ["add_parsers", "cmd_calibrate", "cmd_fidelity"]
