"""Costing: the time and memory of every strategy and every edge of the strategy table.

``Coster`` (``coster``) prices a ``CandidateGraph`` on a device profile with the
formulas of the top-level ``costmodel`` package: each op strategy's compute time,
collectives and saved activations (``saved``: what an op keeps for backward;
``saved_shares``: which node or edge pays each storage kept), each edge's
redistribution, each parameter's model state.  ``peak_memory`` (``peak``)
follows one training step's memory through backward for a chosen plan, which the
search's additive bound only approximates.  ``count_model_flops`` (``model_flops``) counts a step's model
FLOPs, what MFU is measured by.
"""

from __future__ import annotations

from .coster import BACKWARD_SHARE, BACKWARD_TO_FORWARD, Coster, TrainingSettings
from .model_flops import ModelFlops, count_model_flops
from .peak import BackwardMemory, StepPeak, peak_memory
from .pipeline import (
    SCHEDULES,
    ScheduleRun,
    Transfer,
    bubble_fraction,
    in_flight,
    least_schedule_time,
    rank_orders,
    schedule_run,
    stage_counts,
    step_time,
)

__all__ = [
    "BACKWARD_SHARE",
    "BACKWARD_TO_FORWARD",
    "BackwardMemory",
    "Coster",
    "ModelFlops",
    "SCHEDULES",
    "TrainingSettings",
    "bubble_fraction",
    "count_model_flops",
    "in_flight",
    "least_schedule_time",
    "rank_orders",
    "peak_memory",
    "ScheduleRun",
    "StepPeak",
    "Transfer",
    "schedule_run",
    "stage_counts",
    "step_time",
]
