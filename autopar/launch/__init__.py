"""``autopar run``: train a compiled model on local ranks (or under torchrun) and check it against one device.

``models`` finds what to train (built-in names from ``configs/models/``, or a user's
factory), ``runner`` trains it on every rank and compares outputs, gradients and
parameters with one device.
"""

from __future__ import annotations

from .models import builtin_models, default_seq, load_model, max_positions, model_config
from .report import render_report
from .resume import check_replayable, resolve_checkpoint, saved_step
from .runner import LaunchError, RunConfig, run

__all__ = [
    "LaunchError",
    "check_replayable",
    "RunConfig",
    "builtin_models",
    "default_seq",
    "load_model",
    "max_positions",
    "model_config",
    "render_report",
    "resolve_checkpoint",
    "run",
    "saved_step",
]
